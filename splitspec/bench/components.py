"""Component timings on random weights of a real shape: AR step, verify per budget, draft step.

Every figure is the median wall time of one engine call, which ends by reading the accepted
path (verify) or the proposal (draft) back to the host, so it is what a step costs the service.
The roofline is the model's weight bytes over the device's measured copy bandwidth: a batch-1
step reads every weight once and cannot beat it. Weights kept in GGUF blocks (the ``*-q4km``
shapes) count as their packed bytes. Hybrid (qwen35) targets have no fixed-shape path: their rows
are labelled "eager".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.target.engine import TargetEngine, TargetLimits
from splitspec.bench.random_weights import random_draft, random_target, random_target_head
from splitspec.models.dense import DenseForCausalLM
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import build_ddtree

GREEDY = SamplingParams()


@dataclass
class ComponentReport:
    shape: str
    device: str
    dtype: str
    weight_bytes: int
    copy_bandwidth: float  # bytes/s, read + write
    ar_ms: dict[str, float] = field(default_factory=dict)  # path ("graphs", "eager") -> ms
    verify_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # path -> budget -> ms
    draft_ms: dict[str, float] = field(default_factory=dict)  # path -> ms
    prefill_ms: dict[str, float] = field(default_factory=dict)  # path -> ms for the whole prompt
    peak_bytes: int = 0  # device memory high-water mark while the target was timed (CUDA only)

    @property
    def roofline_ms(self) -> float:
        return 1e3 * self.weight_bytes / self.copy_bandwidth


def median_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes moved (read + write) per second by a large device-to-device copy."""
    if device.type != "cuda":
        nbytes = 1 << 26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10, warmup=3, device=device)
    return 2 * nbytes / (ms / 1e3)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a step reads: every parameter (and quantized buffer) once, except the embedding
    table, of which it reads one row (unless the LM head shares it)."""
    seen, total = set(), 0
    embed = getattr(model, "embed_tokens", None)
    tied = embed is not None and getattr(model.lm_head, "weight", None) is embed.weight
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or (name.startswith("embed_tokens") and not tied):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def random_tree(rng: np.random.Generator, vocab: int, budget: int, depth: int = 15, top_k: int = 8):
    ids = np.stack([rng.choice(vocab, top_k, replace=False) for _ in range(depth)])
    logprobs = -np.sort(rng.random((depth, top_k)) * 4, axis=1)
    tree = build_ddtree(ids, logprobs, budget)
    return tree.tokens.astype(np.int64).tolist(), tree.parents.astype(np.int64).tolist()


def time_target(
    path: str, device: torch.device, dtype: torch.dtype, budgets: list[int], prompt_len: int, iters: int, graphs: bool
) -> ComponentReport:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, _ = random_target(path, device, dtype)
    report = ComponentReport(path, str(device), str(dtype).removeprefix("torch."), weight_bytes(model), copy_bandwidth(device))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    steps = (len(budgets) + 1) * (iters + 3)  # every verify commits at least its root
    context = prompt_len + steps + max(budgets) + 1
    if not isinstance(model, DenseForCausalLM):
        paths = {"eager": False}  # fixed shapes (services/target/graphs.py) serve dense targets only
    elif graphs and device.type == "cuda":
        paths = {"graphs": True, "eager": False}
    else:
        paths = {"fixed shapes" if graphs else "eager": False}
    for label, capture in paths.items():
        limits = TargetLimits(max_tree_nodes=max(budgets), max_kv_tokens=2 * context + 64)
        engine = TargetEngine(model, limits, fixed_shapes=label != "eager", capture=capture)
        engine.prefill("bench", prompt, GREEDY, reserve_tokens=context)

        def prefill() -> None:  # a second sequence
            engine.prefill("prefill", prompt, GREEDY, reserve_tokens=context)
            engine.sequences.pop("prefill")

        report.prefill_ms[label] = median_ms(prefill, min(iters, 5), 1, device)
        report.ar_ms[label] = median_ms(lambda: engine.verify("bench", [], []), iters, 3, device)
        report.verify_ms[label] = {}
        for budget in budgets:
            tokens, parents = random_tree(rng, vocab, budget)
            report.verify_ms[label][budget] = median_ms(lambda: engine.verify("bench", tokens, parents), iters, 3, device)
        engine.sequences.pop("bench")
    del model
    if device.type == "cuda":
        report.peak_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
    return report


def time_draft(
    target_path: str, device: torch.device, dtype: torch.dtype, prompt_len: int, iters: int, top_k: int = 8
) -> dict[str, float]:
    """Median ms of one 16-token block proposal with a grown context (one feature row per step),
    per path: the CUDA-graph block pass (on a GPU) and eager."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # graph capture and cuBLAS follow the current device
    model, config = random_draft(target_path + "-dflash", device, dtype)
    embed, head, _ = random_target_head(target_path, device, dtype)
    width = config.num_taps * config.hidden_size
    times = {}
    paths = {"graphs": True, "eager": False} if device.type == "cuda" else {"eager": False}
    for label, graphed in paths.items():
        blocks = BlockGraphs(model, embed, head, prompt_len + iters + 64, 1, capture=True) if graphed else None
        engine = DraftEngine(model, embed, head, graphs=blocks)
        engine.propose("bench", 0, prompt_len, torch.randn(prompt_len, width, device=device, dtype=dtype), top_k)
        position = prompt_len

        def step() -> None:
            nonlocal position
            position += 1
            proposal = engine.propose("bench", 1, position, torch.randn(1, width, device=device, dtype=dtype), top_k)
            proposal.top_ids.cpu()  # the service sends them: that read is part of the step

        ms = median_ms(step, iters, 3, device)
        if not (blocks and blocks.failed):  # a failed capture ran the eager pass: not a graph figure
            times[label] = ms
        engine.sequences.pop("bench")
    del model, embed, head
    return times
