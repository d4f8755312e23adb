"""A DFlash2 draft's Propose step against a DFlash draft's on the GPU (benchmark-only random weights).

The Qwen3-8B-shaped 5-layer draft (``random:qwen3-8b-dflash``) at block sizes 8 and 16, and the
same backbone as a DFlash2 draft (convolutions around every sublayer, the candidate selector at
top-16 and rank 256, a 2048-position window), served by ``DraftEngine``, each eagerly and through its
one-sequence CUDA graphs (what a sequence is served with), and DFlash2's graphs captured with
the selector's reference instead of its kernel (``SPLITSPEC_NATIVE_OFF=selector``). Each step
appends 4 new feature rows to a 512-row context and asks for the top-16, with the proposal's copy
to the host (``torch.cuda.synchronize`` inside the engine); the random rows are made before the
clock starts. The contenders' steps are interleaved, one step each a round in a rotating order,
300 rounds after 20 of warm-up, so that the machine's drift (clocks, the host's load) falls on
all of them alike: median ms, and the median and quartiles of the per-round ratio to DFlash's step.

Checks: the dynamic convolution's kernel against its reference (bf16); with identity convolutions and a zero successor codebook (``init_dflash2_extras``) the
DFlash2 draft's proposals equal the DFlash draft's, ids and log-probs (bf16); the DFlash2 graphed
pass's proposals against its eager pass's over five steps, and its batched graph's against
eager passes one sequence at a time (8 sequences). Then 8 sequences a step through the batched
graphs, DFlash against DFlash2, interleaved likewise (``propose_batch``, 100 rounds after 10).

Usage: python3 scripts/gpu_dflash2_step.py   (GPU only)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from services.draft.engine import DraftEngine, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.bench.random_weights import _generator, _randomize, random_draft_config, random_target_head
from splitspec.models.dflash import DFlashDraft
from splitspec.models.dflash2 import DFlash2Config, DFlash2Draft, DynamicConv, init_dflash2_extras

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dtype = torch.bfloat16
embed, head, _ = random_target_head("random:qwen3-8b", dev, dtype)


def build(config, seed: int = 2):
    with torch.device("meta"):
        model = DFlash2Draft(config) if isinstance(config, DFlash2Config) else DFlashDraft(config)
    model = model.to(dtype).to_empty(device=dev)
    _randomize(model, _generator(dev, seed))
    return model


def interleaved(contenders: dict[str, tuple], rounds: int, warmup: int) -> dict[str, list[float]]:
    """ms of each contender's steps, one step each a round in a rotating order. A contender is
    ``(inputs, step, off)``: ``step(inputs(i))`` runs its i-th step, timed without ``inputs``
    (random feature rows take the host longer than a graphed step's own work), with
    ``SPLITSPEC_NATIVE_OFF=off`` set while it runs where ``off`` is given (a graph keeps the
    kernels it was captured with)."""
    names, times = list(contenders), {name: [] for name in contenders}
    for i in range(rounds + warmup):
        for name in names[i % len(names):] + names[: i % len(names)]:
            inputs, step, off = contenders[name]
            args = inputs(i)
            if off:
                os.environ["SPLITSPEC_NATIVE_OFF"] = off
            t0 = time.perf_counter()
            step(args)
            times[name].append((time.perf_counter() - t0) * 1e3)
            os.environ.pop("SPLITSPEC_NATIVE_OFF", None)
    return {name: t[warmup:] for name, t in times.items()}


def report(times: dict[str, list[float]], base: str) -> str:
    """Median ms of each contender; for the others, the ratio of medians to ``base``'s and the
    per-round ratio's median and quartiles."""
    parts = [f"{base} {statistics.median(times[base]):.3f} ms"]
    for name, t in times.items():
        if name != base:
            r = sorted(b / a for a, b in zip(times[base], t))
            parts.append(f"{name} {statistics.median(t):.3f} ms ({statistics.median(t) / statistics.median(times[base]):.3f}x; "
                         f"per round {r[len(r) // 2]:.3f}x, quartiles {r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f})")
    return "; ".join(parts)


def feature_rows(width: int, seed: int, sequences: int = 1):
    """:func:`interleaved`'s ``inputs``: step 0 fills a 512-row context of each sequence, each later
    step appends 4 rows; (anchor token, anchor position, rows per sequence)."""
    g = torch.Generator().manual_seed(seed)

    def inputs(i: int) -> tuple[int, int, list[torch.Tensor]]:
        rows, anchor, end = (512, 0, 512) if i == 0 else (4, 1, 512 + 4 * i)
        return anchor, end, [torch.randn(rows, width, generator=g).to(dtype) for _ in range(sequences)]
    return inputs


def one_sequence(engine: DraftEngine):
    """:func:`interleaved`'s ``step`` for one sequence a step."""
    return lambda args: engine.propose("s", args[0], args[1], args[2][0], 16)


def eight_sequences(engine: DraftEngine):
    """:func:`interleaved`'s ``step`` for 8 sequences a ``propose_batch`` through the batched graphs."""
    return lambda args: engine.propose_batch([ProposeStep(f"s{j}", args[0], args[1], f, 16) for j, f in enumerate(args[2])])


print(torch.cuda.get_device_name(), flush=True)
conv = DynamicConv(4096, 2, 16, 16).to(dev, dtype)
torch.nn.init.normal_(conv.base_kernel, 0.5, 0.5), torch.nn.init.normal_(conv.kernel_projection.weight, 0.0, 0.02)
with torch.inference_mode():
    u, x = torch.randn(2, 3, 16, 4096, device=dev, dtype=dtype)
    coefficients = conv.coefficients(u)
    fused = [conv(x, coefficients, side) for side in (0, 1)]
    os.environ["SPLITSPEC_NATIVE_OFF"] = "dynamic_conv"
    reference = [conv(x, coefficients, side) for side in (0, 1)]
    del os.environ["SPLITSPEC_NATIVE_OFF"]
worst = max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item() for a, b in zip(fused, reference))
equal = all(torch.equal(a, b) for a, b in zip(fused, reference))
print(f"dynamic_conv kernel vs reference (bf16, 3 x 16 rows x 4096): {'bitwise equal' if equal else f'largest difference {worst:.2e} of the largest'}", flush=True)
for block in (8, 16):
    base = dataclasses.replace(random_draft_config("random:qwen3-8b-dflash"), block_size=block)
    d1 = build(base)
    d2cfg = DFlash2Config(**vars(base), conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16, sliding_window=2048)
    d2 = build(d2cfg)
    d2.load_state_dict(d1.state_dict(), strict=False)  # the same backbone
    init_dflash2_extras(d2)
    d1.fuse_projections(), d2.fuse_projections()
    width = base.num_taps * base.hidden_size
    a, b = DraftEngine(d1, embed, head), DraftEngine(d2, embed, head)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(300, width, generator=g).to(dtype)
    pa, pb = a.propose("c", 7, 300, feats, 16), b.propose("c", 7, 300, feats, 16)
    same = torch.equal(pa.top_ids, pb.top_ids) and torch.equal(pa.top_logprobs, pb.top_logprobs)
    print(f"block {block}: identity DFlash2 == DFlash: {'PASS' if same else 'FAIL'}; pair scores finite: {bool(pb.pair_scores.isfinite().all())}", flush=True)
    _randomize(d2, _generator(dev, 3))  # real-shaped random extras for the timing
    d2.fuse_projections()
    kernel = DraftEngine(d2, embed, head).propose("k", 7, 300, feats, 16)
    os.environ["SPLITSPEC_NATIVE_OFF"] = "selector"
    reference = DraftEngine(d2, embed, head).propose("k", 7, 300, feats, 16)
    del os.environ["SPLITSPEC_NATIVE_OFF"]
    print(f"block {block}: selector kernel vs reference: top ids equal {torch.equal(kernel.top_ids, reference.top_ids)}, "
          f"pair scores within {(kernel.pair_scores - reference.pair_scores).abs().max().item():.2e}", flush=True)
    graphed = DraftEngine(d2, embed, head, graphs=BlockGraphs(d2, embed, head, 4096, 1, capture=True))
    contenders = {
        "DFlash graphed": (feature_rows(width, 0), one_sequence(DraftEngine(d1, embed, head, graphs=BlockGraphs(d1, embed, head, 4096, 1, capture=True))), ""),
        "DFlash2 graphed": (feature_rows(width, 0), one_sequence(graphed), ""),
        "DFlash2 graphed, selector reference": (
            feature_rows(width, 0), one_sequence(DraftEngine(d2, embed, head, graphs=BlockGraphs(d2, embed, head, 4096, 1, capture=True))), "selector",
        ),
        "DFlash eager": (feature_rows(width, 0), one_sequence(DraftEngine(d1, embed, head)), ""),
        "DFlash2 eager": (feature_rows(width, 0), one_sequence(DraftEngine(d2, embed, head)), ""),
    }
    times = interleaved(contenders, 300, 20)
    print(f"block {block}, one sequence: " + report({k: v for k, v in times.items() if "graphed" in k}, "DFlash graphed"), flush=True)
    print(f"block {block}, one sequence: " + report({k: v for k, v in times.items() if "eager" in k}, "DFlash eager"), flush=True)
    eager, ids_equal, worst = DraftEngine(d2, embed, head), 0, 0.0
    for n in range(5):  # the graphed pass against the eager one, step by step
        f = torch.randn(20 if n == 0 else 3, width, generator=g).to(dtype)
        end = 20 + 3 * n
        pg, pe = graphed.propose("v", 5 + n, end, f, 16), eager.propose("v", 5 + n, end, f, 16)
        ids_equal += torch.equal(pg.top_ids, pe.top_ids)
        worst = max(worst, (pg.pair_scores - pe.pair_scores).abs().max().item())
    print(f"block {block}: DFlash2 graphed vs eager: top ids equal in {ids_equal}/5 steps, pair scores within {worst:.3g}", flush=True)
    batched = {name: (feature_rows(width, 0, 8), eight_sequences(DraftEngine(d, embed, head, graphs=BlockGraphs(d, embed, head, 4096, 8, capture=True))), "")
               for name, d in (("DFlash", d1), ("DFlash2", d2))}
    batched_report = report(interleaved(batched, 100, 10), "DFlash")
    # The batched graph against one eager engine, sequence by sequence: a first step (a big append,
    # then the block-only batched graph), then a step appending 3 rows inside the graph. DFlash's
    # draft is the control: bf16 rounding differs between the two passes' attention kernels.
    checks = []
    for name, d in (("DFlash", d1), ("DFlash2", d2)):
        together, alone = DraftEngine(d, embed, head, graphs=BlockGraphs(d, embed, head, 4096, 8, capture=True)), DraftEngine(d, embed, head)
        gb = torch.Generator().manual_seed(7)
        first = [ProposeStep(f"f{i}", 3 + i, 40 + 7 * i, torch.randn(40 + 7 * i, width, generator=gb).to(dtype), 16) for i in range(8)]
        then = [ProposeStep(s.sequence_id, 9, s.anchor_position + 3, torch.randn(3, width, generator=gb).to(dtype), 16) for s in first]
        together.propose_batch(first)
        got = together.propose_batch(then)
        same = top1 = 0
        worst = 0.0
        for s, t, proposal in zip(first, then, got):
            alone.propose(s.sequence_id, s.anchor_token, s.anchor_position, s.features, 16)
            want = alone.propose(t.sequence_id, t.anchor_token, t.anchor_position, t.features, 16)
            same += torch.equal(want.top_ids, proposal.top_ids)
            top1 += torch.equal(want.top_ids[:, 0], proposal.top_ids[:, 0])
            worst = max(worst, (want.top_logprobs[:, 0] - proposal.top_logprobs[:, 0]).abs().max().item())
        checks.append(f"{name}: all 16 ids equal for {same}/8, top-1 for {top1}/8, top-1 log-prob within {worst:.3g}")
        del together, alone
    print(f"block {block}: 8 sequences, batched graph: {batched_report}; "
          f"batched vs alone: {'; '.join(checks)}", flush=True)
    del a, b, d1, d2
    torch.cuda.empty_cache()
