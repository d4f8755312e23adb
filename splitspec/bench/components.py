"""Component timings on random weights of a real shape: AR step, verify per budget, draft step.

Every figure is the median wall time of one engine call, which ends by reading the accepted
path (verify) or the proposal (draft) back to the host, so it is what a step costs the service.
The roofline is the model's weight bytes over the device's measured copy bandwidth: a batch-1
step reads every weight once and cannot beat it. Weights kept in GGUF blocks (the ``*-q4km``
shapes) count as their packed bytes. Dense and hybrid (qwen35) targets alike run their fixed-shape
passes (graphed on a GPU) and exact shapes eagerly.

**Quantized-matmul kernel table** (``time_quant_kernels``, quantized shapes): ``native.gguf_matmul``
alone, for each GGUF type at the shape's MLP sizes (``ffn_up`` [intermediate x hidden], ``ffn_down``
[hidden x intermediate]) and each row count M of ``KERNEL_ROWS`` (1 is a decode step, 23 a
budget-22 tree with its root). Terms: *packed bytes* are the weight's GGUF blocks, all a call must
read (x and y are a few KB); *bandwidth* is packed bytes over the call's time; its *share* is that
over the copy bandwidth the roofline uses; *× M=1* is the time over the same type and size's
one-row time. On CUDA a call's time is the median over replays of one CUDA graph of calls that
each read another copy of the weight (the copies together span several L2 caches, so no call finds
its weight cached, as in a real step), divided by the calls; elsewhere the median wall time of one
call. Where the Triton kernel cannot run (a CPU without the interpreter) the row times the path
``QuantLinear`` takes instead, dequantize + matmul, and says so (``path`` "reference").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from native import gguf_mma
from native.gguf_matmul import gguf_matmul, gguf_matmul_reference, interleavable, interleave, triton_enabled
from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.target.engine import TargetEngine, TargetLimits
from splitspec.bench.random_weights import quant_types, random_blocks, random_draft, random_shape, random_target, random_target_head
from splitspec.spec.sampling import SamplingParams
from splitspec.spec.tree import DEFAULT_TOP_K, build_ddtree

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
    kernels: list[dict] = field(default_factory=list)  # quantized shapes: time_quant_kernels' rows

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
    tied = embed is not None and getattr(model.lm_head, "weight", None) is getattr(embed, "weight", False)  # blocks are never tied
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
    if graphs and device.type == "cuda":
        paths = {"graphs": True, "eager": False}
    else:
        paths = {"fixed shapes" if graphs else "eager": False}
    for label, capture in paths.items():
        # Two live sequences at most ("bench" and a prefill's): a hybrid target's state slots are per sequence.
        limits = TargetLimits(max_sequences=2, max_tree_nodes=max(budgets), max_kv_tokens=2 * context + 64)
        engine = TargetEngine(model, limits, fixed_shapes=label != "eager", capture=capture, hot_passes=1, hot_padding=0)  # each shape timed is captured at once
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
    target_path: str, device: torch.device, dtype: torch.dtype, prompt_len: int, iters: int, top_k: int = DEFAULT_TOP_K
) -> dict[str, float]:
    """Median ms of one 16-token block proposal with a grown context (one feature row per step),
    per path: the CUDA-graph block pass (on a GPU) and eager."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # graph capture and cuBLAS follow the current device
    model, config = random_draft(target_path + "-dflash", device, dtype)
    # A quantized target's head stays in its Q6_K blocks, as the system part's draft worker holds it.
    embed, head, _ = random_target_head(target_path, device, dtype, keep_quantized=random_shape(target_path).quantized)
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
        if not (blocks and blocks.uncaptured):  # a failed capture ran the eager pass: not a graph figure
            times[label] = ms
        engine.sequences.pop("bench")
    del model, embed, head
    return times


# ------------------------------------------------------------------ quantized-matmul kernel table

KERNEL_ROWS = (1, 2, 4, 8, 16, 23, 32, 64)  # x rows M: a decode step, batches, a budget-22 tree (23), prompt-sized passes
KERNEL_TABLE_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS)  # timed for every quantized shape, in the model or not
L2_SPANS = 4  # the weight copies of one graph span this many L2 caches (at least 256 MiB)
MAX_COPIES = 64
GRAPH_CALLS = 32  # calls per timed graph at least (the copies in turn, again and again): a replay's own cost is shared out


def _weight_copies(packed: int, device: torch.device) -> int:
    """How many copies of a weight of ``packed`` bytes one timing cycles through: enough that none
    is still in the L2 cache when its turn comes again (one off a GPU: the wall time of one call is
    taken there, and a CPU's caches are not what its figure is about)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(2, min(MAX_COPIES, math.ceil(max(L2_SPANS * l2, 256 << 20) / packed)))


def _per_call_us(calls: list[Callable[[], object]], iters: int, device: torch.device) -> tuple[float, str]:
    """Median microseconds of one of ``calls`` (each the same work on its own weight copy) and how it
    was timed. CUDA: one graph of all the calls, replayed ``iters`` times between CUDA events (no host
    launch cost between them), over ``len(calls)``; if the capture fails, the calls launched in a row
    between events. Elsewhere: the median wall time of ``calls[0]``."""
    if device.type != "cuda":
        return 1e3 * median_ms(calls[0], iters, 1, device), "wall time"
    for call in calls:  # compiles the kernels and makes IQ4_XS's level table before any capture
        call()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run, how = graph.replay, "CUDA graph replay"
    except RuntimeError:
        torch.cuda.synchronize(device)

        def run() -> None:
            for call in calls:
                call()

        how = "CUDA events, eager launches"
    run()
    times = []
    for _ in range(iters):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(calls))
    return statistics.median(times), how


def kernel_layers(config) -> dict[str, tuple[int, int]]:
    """The layer sizes the kernel table times: name -> (out_features N, in_features K)."""
    return {"ffn_up": (config.intermediate_size, config.hidden_size), "ffn_down": (config.hidden_size, config.intermediate_size)}


def time_quant_kernels(
    path: str, device: torch.device, dtype: torch.dtype, iters: int, copy_bandwidth: float, rows: tuple[int, ...] = KERNEL_ROWS,
) -> list[dict]:
    """One row per (GGUF type, layer size, row count M): ``native.gguf_matmul`` on random blocks of
    the type (``random_blocks``) at the shape's ``kernel_layers``, x of M rows in ``dtype``. Types: those of
    ``KERNEL_TABLE_TYPES`` and any other the model holds (``in_model`` says which the model holds). Each
    row: ``us`` (median per call), ``packed_bytes``, ``bandwidth`` (bytes/s), ``copy_share`` (of
    ``copy_bandwidth``), ``vs_one_row`` (× the M = 1 time), ``path`` ("kernel", or "reference" where
    the Triton kernel cannot run), ``timing`` (how it was timed; see the module docstring) and
    ``interleaved`` (Q4_K or Q6_K blocks in the layout the models hold them in on this device)."""
    config = random_shape(path).config
    present = quant_types(path)
    types = list(KERNEL_TABLE_TYPES) + [q for q in present if q not in KERNEL_TABLE_TYPES]
    generator = torch.Generator(device=device).manual_seed(4)
    out = []
    for qtype in types:
        for layer, (n, k) in kernel_layers(config).items():
            weight = random_blocks(qtype, n, k, 0.02, generator)
            interleaved = interleavable(weight, qtype) and gguf_mma.runs_on(device)  # as the models hold it there
            weight = interleave(weight, qtype) if interleaved else weight
            packed = weight.numel()
            weights = [weight] + [weight.clone() for _ in range(_weight_copies(packed, device) - 1)]
            turns = math.ceil(GRAPH_CALLS / len(weights)) if device.type == "cuda" else 1
            one_row = None
            for m in rows:
                x = torch.randn(m, k, device=device, generator=generator).to(dtype)
                kernel = triton_enabled(x)
                matmul = gguf_matmul if kernel else gguf_matmul_reference
                calls = [lambda w=w, x=x, matmul=matmul: matmul(x, w, qtype, n, interleaved=interleaved) for w in weights] * turns
                us, how = _per_call_us(calls, iters, device)
                one_row = one_row or us
                bandwidth = packed / (us * 1e-6)
                out.append({
                    "qtype": qtype.name, "layer": layer, "out_features": n, "in_features": k, "rows": m,
                    "in_model": qtype in present, "path": "kernel" if kernel else "reference", "timing": how, "interleaved": interleaved,
                    "us": us, "packed_bytes": packed, "bandwidth": bandwidth, "copy_share": bandwidth / copy_bandwidth,
                    "vs_one_row": us / one_row,
                })
            weights = calls = None  # this size's copies go before the next size's come
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
