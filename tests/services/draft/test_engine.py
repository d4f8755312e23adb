"""The draft engine's incremental proposals against a from-scratch implementation of the DFlash equations."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from safetensors.torch import load_file

from services.draft import engine as engine_module
from services.draft.engine import DraftEngine
from services.draft.graphs import BlockGraphs
from services.draft.server import DraftServicer
from services.metrics import WorkerMetrics
from splitspec.errors import FailedPrecondition, InvalidArgument
from splitspec.models.loader import load_dflash_draft, load_target_head
from splitspec.transport.received import TensorFieldReader
from splitspec.transport.tensors import tensor_to_pb
from splitspec.v1 import draft_pb2


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    """x [n, heads, d] rotated at positions [n]: pairs (i, i + d/2) by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # [n, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., : d // 2].double(), x[..., d // 2 :].double()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def reference_block(w, cfg, embed, head, features, ctx_positions, anchor, anchor_position):
    """The DFlash block pass (arXiv 2602.06036), written out: returns log-probs [B-1, vocab] for depths 1..B-1."""
    B, H, Hkv, D = cfg.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])  # once, shared by all layers
    block = torch.tensor([anchor] + [cfg.mask_token_id] * (B - 1))
    h = embed[block]
    block_positions = torch.arange(anchor_position, anchor_position + B)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        hn = _rms(h, w[p + "input_layernorm.weight"])
        q = _rms((hn @ w[p + "self_attn.q_proj.weight"].T).view(B, H, D), w[p + "self_attn.q_norm.weight"])
        kin = torch.cat([c, hn])  # context features skip input_layernorm
        k = _rms((kin @ w[p + "self_attn.k_proj.weight"].T).view(-1, Hkv, D), w[p + "self_attn.k_norm.weight"])
        v = (kin @ w[p + "self_attn.v_proj.weight"].T).view(-1, Hkv, D)
        q = _rope(q, block_positions, cfg.rope_theta)
        k = _rope(k, torch.cat([ctx_positions, block_positions]), cfg.rope_theta)
        out = torch.empty(B, H, D)
        for head_i in range(H):
            kv_i = head_i // (H // Hkv)
            scores = q[:, head_i] @ k[:, kv_i].T / math.sqrt(D)  # [B, S + B], no mask at all
            out[:, head_i] = torch.softmax(scores, -1) @ v[:, kv_i]
        h = h + out.reshape(B, H * D) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = _rms(h, w["norm.weight"])
    return torch.log_softmax(out[1:] @ head.T, -1)


@pytest.fixture(scope="module")
def draft(tiny_pair):
    model, cfg = load_dflash_draft(tiny_pair.draft)
    embed, head, _ = load_target_head(tiny_pair.target)
    weights = load_file(str(tiny_pair.draft / "model.safetensors"))
    return model, cfg, embed, head, weights


@pytest.mark.parametrize(
    ("window", "fixed_shapes", "native"),
    [(0, False, "0"), (5, False, "0"), (0, True, "0"), (5, True, "0"), (5, True, "1")],  # kernels: slow in the interpreter
    ids=["eager", "eager-window", "fixed-shapes", "fixed-shapes-window", "fixed-shapes-window-kernels"],
)
def test_incremental_proposals_match_reference(draft, window, fixed_shapes, native, monkeypatch):
    """Both paths: the eager pass and the graph path's fixed shapes (preallocated context, masked
    span, appends of up to a block inside the pass), with the plain-torch layers and with the
    native kernels (Triton's interpreter)."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
    model, cfg, embed, head, w = draft
    graphs = BlockGraphs(model, embed, head, context=96, sequences=1, capture=False) if fixed_shapes else None
    engine = DraftEngine(model, embed, head, graphs=graphs)
    in_pass_appends = []  # a spy: the real method runs
    append_cached = model.append_cached
    monkeypatch.setattr(model, "append_cached", lambda f, *a: in_pass_appends.append(len(f)) or append_cached(f, *a))
    g = torch.Generator().manual_seed(window)
    features = torch.randn(80, cfg.num_taps * cfg.hidden_size, generator=g)
    big = 21 + cfg.block_size + 3  # more new rows than a block: appended eagerly, then a block-only pass
    # Committed positions arrive in pieces: a prompt of 9, then steps of 1, 4, 7, more than a block, 2.
    for end, anchor in [(9, 17), (10, 3), (14, 200), (21, 64), (big, 5), (big + 2, 9)]:
        prev = max((s.ctx_end for s in engine.sequences.values()), default=0)
        proposal = engine.propose("s", anchor, end, features[prev:end], top_k=5, window=window)
        first = max(0, end - window) if window else 0
        ref = reference_block(w, cfg, embed, head, features[first:end], torch.arange(first, end), anchor, end)
        top = torch.topk(ref, 5, dim=-1)
        assert torch.equal(proposal.top_ids.long(), top.indices)
        assert torch.allclose(proposal.top_logprobs, top.values, atol=1e-5)
    if fixed_shapes:  # the preallocated context never grew: the graph path served every step
        assert engine.sequences.get("s").cache.k[0].shape[1] == 96
    # Every step of at most a block of new rows (9, 1, 4, 7 and 2) was appended inside the pass.
    assert in_pass_appends == ([cfg.block_size] * 5 if fixed_shapes else [])


def test_refuses_gaps_and_bad_arguments(draft):
    model, cfg, embed, head, _ = draft
    engine = DraftEngine(model, embed, head)
    width = cfg.num_taps * cfg.hidden_size
    with pytest.raises(FailedPrecondition, match="carries no features"):
        engine.propose("s", 1, 4, None, top_k=2)
    engine.propose("s", 1, 4, torch.zeros(4, width), top_k=2)
    with pytest.raises(FailedPrecondition, match="context ends at position 4"):
        engine.propose("s", 1, 9, torch.zeros(2, width), top_k=2)
    with pytest.raises(InvalidArgument, match="features: shape"):
        engine.propose("s", 1, 5, torch.zeros(1, width + 1), top_k=2)
    with pytest.raises(InvalidArgument, match="top_k"):
        engine.propose("s", 1, 4, None, top_k=0)
    with pytest.raises(InvalidArgument, match="anchor_token"):
        engine.propose("s", 10**6, 4, None, top_k=2)
    assert engine.sequences.pop("s") and not engine.sequences.pop("s")


def test_context_slots_are_reused_and_overflow_grows_its_own(draft):
    """Two slots: a released sequence's slot serves the next one (its graphs would replay), and
    a third live sequence gets no slot, grows its own context and still proposes correctly."""
    model, cfg, embed, head, _ = draft
    graphs = BlockGraphs(model, embed, head, context=64, sequences=2, capture=False)
    engine = DraftEngine(model, embed, head, graphs=graphs)
    features = torch.randn(6, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = {}
    for name in ("a", "b", "c"):
        ids[name] = engine.propose(name, 7, 6, features, top_k=3).top_ids
    slots = {name: engine.sequences.get(name).cache.slot for name in "abc"}
    assert sorted(s for s in slots.values() if s is not None) == [0, 1] and slots["c"] is None
    assert torch.equal(ids["a"], ids["c"]) and torch.equal(ids["b"], ids["c"])  # same context, same proposal
    engine.sequences.pop("a")
    engine.propose("d", 7, 6, features, top_k=3)
    assert engine.sequences.get("d").cache.slot == slots["a"]


def test_a_long_append_goes_in_chunks_and_matches_the_reference(draft, monkeypatch):
    """New context rows are projected ``APPEND_CHUNK`` at a time (a 16K-token prompt arrives
    whole, and all its rows' activations at once would take GiBs): chunks of 7 rows give the
    reference's proposals."""
    monkeypatch.setattr("services.draft.engine.APPEND_CHUNK", 7)
    model, cfg, embed, head, w = draft
    engine = DraftEngine(model, embed, head)
    rows = []  # a spy: the real method runs
    context_kv = model.context_kv
    monkeypatch.setattr(model, "context_kv", lambda f, p: rows.append(len(f)) or context_kv(f, p))
    features = torch.randn(40, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for start, end, anchor in [(0, 30, 17), (30, 40, 5)]:
        proposal = engine.propose("s", anchor, end, features[start:end], top_k=5, window=0)
        top = torch.topk(reference_block(w, cfg, embed, head, features[:end], torch.arange(end), anchor, end), 5, dim=-1)
        assert torch.equal(proposal.top_ids.long(), top.indices)
        assert torch.allclose(proposal.top_logprobs, top.values, atol=1e-5)
    assert rows == [7, 7, 7, 7, 2, 7, 3]


def test_a_gpu_engine_pins_the_host_rows_it_appends_eagerly(draft):
    """The servicer stages in pinned memory the host rows a GPU pass would copy to the device
    itself (more than a block: a prompt's); rows the graphed pass takes, rows already on a
    device, and every row of a CPU engine stay as they came."""
    model, cfg, embed, head, _ = draft
    engine = DraftEngine(model, embed, head)
    width = cfg.num_taps * cfg.hidden_size
    prompt, step = torch.zeros(cfg.block_size + 1, width), torch.zeros(cfg.block_size, width)
    assert not engine.pins(prompt)  # a CPU engine
    engine.device = torch.device("cuda")  # as a GPU engine sees it; nothing here touches the device
    assert engine.pins(prompt) and not engine.pins(step)
    assert not engine.pins(torch.empty(cfg.block_size + 1, width, device="meta"))  # not on the host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_pinned_cat_joins_rows_byte_for_byte(monkeypatch, dtype):
    """``pinned_cat`` joins host rows into one buffer (pinned on a CUDA host; here the allocation
    stands in, with no CUDA), whatever their dtype, a strided part included."""
    empty = torch.empty
    monkeypatch.setattr(engine_module.torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    g = torch.Generator().manual_seed(2)
    parts = [(torch.randn(n, 6, generator=g) * 100).to(dtype) for n in (3, 1, 5)]
    parts.append((torch.randn(6, 4, generator=g) * 100).to(dtype).t()[:, :6])  # [4, 6], not contiguous
    assert torch.equal(engine_module.pinned_cat(parts), torch.cat(parts))
    positions = [torch.arange(4, 7), torch.arange(20, 22)]
    assert engine_module.pinned_cat(positions).tolist() == [4, 5, 6, 20, 21]


def test_the_servicer_stages_a_prompts_rows_and_goes_on_without_pinned_memory(draft, monkeypatch, caplog):
    """``DraftServicer.Propose`` (and its step socket's ``propose_on_socket``) hands the rows
    ``pins`` names to ``pinned`` on a thread of its own; without pinned memory (here: no CUDA)
    ``pinned`` gives the rows back, warns once, and the proposal is the one the engine gives the
    rows as they came."""
    model, cfg, embed, head, _ = draft
    features = torch.randn(cfg.block_size + 4, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    staged = []
    monkeypatch.setattr(engine_module, "_unpinned_logged", False)
    monkeypatch.setattr("services.draft.server.pinned", lambda rows: staged.append(len(rows)) or engine_module.pinned(rows))

    async def propose(sequence_id: str, pin: bool):
        servicer = DraftServicer(WorkerMetrics("draft", "tiny"))
        engine = DraftEngine(model, embed, head)
        engine.pins = lambda rows: pin  # as a GPU engine answers for a prompt's rows
        servicer.host.attach(engine, None)
        try:
            request = draft_pb2.ProposeRequest(
                sequence_id=sequence_id, anchor_token=7, anchor_position=len(features), features=tensor_to_pb(features), top_k=4
            )
            first = await servicer.Propose(request, None)
            request.sequence_id += "-again"  # then on the step socket's path: the features read in place
            received = TensorFieldReader(draft_pb2.ProposeRequest, "features").FromString(request.SerializeToString())
            return first, await servicer.propose_on_socket(received, None)
        finally:
            servicer.host.executor.shutdown()

    with caplog.at_level("WARNING", logger="services.draft.engine"):
        staged_answers = asyncio.run(propose("pinned", True))
    plain_answers = asyncio.run(propose("plain", False))
    assert staged == [len(features)] * 2  # both prompts (gRPC, socket) went through pinned(); none of the plain ones did
    assert plain_answers[0].top_ids == plain_answers[1].top_ids  # the same prompt, either path
    assert [a.top_ids for a in staged_answers] == [p.top_ids for p in plain_answers]
    assert [a.top_logprobs for a in staged_answers] == [p.top_logprobs for p in plain_answers]
    assert sum("no pinned memory" in r.getMessage() for r in caplog.records) == (0 if torch.cuda.is_available() else 1)
