"""Keep-quantized loads against the dequantized load of the same GGUF file.

The hybrid target (``tests.quantized_fixtures``: Q4_K, Q5_K, Q6_K, Q8_0 and a Q5_0 without a
kernel, tiled value heads) gives the same logits with its blocks kept as dequantized; the token
embedding kept in blocks (``QuantEmbedding``) looks up exactly the dequantized rows; the draft's
borrowed embedding and LM head, and a GGUF draft's own linears, propose exactly what the
dequantized ones propose. On the CPU a ``QuantLinear`` runs its torch reference (dequantize, then
``F.linear``), so what differs from the dequantized load is the layout alone: rows of blocks moved
where value heads were untiled, and inputs gathered where they could not be (``ssm_out``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from torch import nn

from native import gguf_mma
from native.gguf_dequant import dequantize
from native.gguf_matmul import KERNEL_TYPES, QuantLinear
from services.draft.engine import DraftEngine, ProposeStep
from services.draft.graphs import BlockGraphs
from splitspec.models.gguf_file import GGUFFile
from splitspec.models.layers import FusedLinear
from splitspec.models.loader import load_dflash_draft, load_target, load_target_head
from splitspec.models.quantized import QuantEmbedding, embedding_rows, head_logits
from splitspec.models.qwen35_loader import PermutedInputs, qwen35_gguf_names
from tests.dense_fixtures import hf_model, write_gguf
from tests.kquants import QUANTIZERS, quantize_k
from tests.quantized_fixtures import make_pair, write_target

# Relative to the largest logit. float32: summation order only (ssm_out's gathered inputs), over
# 4 layers. float64: the logits come back as float32, so a far smaller difference can still round
# to one float32 step apart (2**-23 of a power of two at most twice the largest logit).
# float32: the dequantized load runs fused projections (one matmul for gate/up, one for a DeltaNet
# layer's four inputs), whose BLAS sums in another order than the kept blocks' per-layer reference
# matmuls: 2.1e-5 seen (7.4e-6 unfused). A wrong weight or block is off by orders more.
TOLERANCE = {torch.float32: 5e-5, torch.float64: 2.5e-7}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen35-quantized")
    target, draft_dir, draft_gguf = make_pair(out)
    return {"target": target, "draft_dir": draft_dir, "draft_gguf": draft_gguf, "tied": write_target(out / "tied.gguf", tied=True)}


def _causal(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]


def _logits(model, ids: torch.Tensor, dtype: torch.dtype, prompt: int) -> torch.Tensor:
    """Logits [n, vocab] of a prefill of ``prompt`` tokens (the chunked delta rule) then one-token steps."""
    n = len(ids)
    cache = model.new_cache(n, "cpu", dtype)
    rows = [model(ids[:prompt], torch.arange(prompt), cache, 0, _causal(prompt))[0]]
    rows += [model(ids[t : t + 1], torch.tensor([t]), cache, t, _causal(1, t))[0] for t in range(prompt, n)]
    return torch.cat(rows)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _kernel_typed(model: nn.Module, path) -> dict[str, bool]:
    """Module name of every linear -> whether its GGUF weight has a kernel type (from the file)."""
    f = GGUFFile(path)
    names = qwen35_gguf_names(model.config)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)):
            module_name = name.removesuffix(".linear")  # PermutedInputs wraps out_proj's QuantLinear
            gguf = names[f"{module_name}.weight"] if f.has_tensor(names[f"{module_name}.weight"]) else "token_embd.weight"
            out[module_name] = f.raw(gguf)[1] in KERNEL_TYPES
    return out


def test_hybrid_keeps_every_kernel_typed_linear_and_the_embedding_in_blocks(files):
    packed, config = load_target(files["target"], keep_quantized=True)
    kernel_typed = _kernel_typed(packed, files["target"])
    assert len(kernel_typed) == 1 + 3 * 8 + 7  # the head, three DeltaNet layers, one attention layer
    for name, has_kernel in kernel_typed.items():
        module = packed.get_submodule(name)
        if isinstance(module, PermutedInputs):
            assert name.endswith("linear_attn.out_proj")
            module = module.linear
        assert isinstance(module, QuantLinear if has_kernel else nn.Linear), name
    assert not all(kernel_typed.values()) and sum(kernel_typed.values()) > 20  # the fixture's Q5_0 up_proj has no kernel
    assert isinstance(packed.embed_tokens, QuantEmbedding) and packed.embed_tokens.qtype == Q.Q4_K
    # The blocks are the file's bytes: the embedding's rows are in the model's order already.
    raw, _ = GGUFFile(files["target"]).raw("token_embd.weight")
    assert np.array_equal(packed.embed_tokens.raw.numpy(), np.asarray(raw).reshape(config.vocab_size, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_hybrid_logits_equal_the_dequantized_load(files, dtype):
    dense, config = load_target(files["target"], dtype=dtype)
    packed, _ = load_target(files["target"], dtype=dtype, keep_quantized=True)
    ids = torch.randint(0, config.vocab_size, (72,), generator=torch.Generator().manual_seed(7))
    reference, ours = _logits(dense, ids, dtype, 68), _logits(packed, ids, dtype, 68)  # 68: two delta-rule chunks
    assert _relative(ours, reference) < TOLERANCE[dtype]
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_tied_hybrid_head_reads_the_embeddings_blocks(files):
    dense, config = load_target(files["tied"])
    packed, _ = load_target(files["tied"], keep_quantized=True)
    assert config.tie_word_embeddings and _same_storage(dense.lm_head.weight, dense.embed_tokens.weight)
    assert isinstance(packed.lm_head, QuantLinear) and _same_storage(packed.lm_head.raw, packed.embed_tokens.raw)  # one copy
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(8))
    assert _relative(_logits(packed, ids, torch.float32, 16), _logits(dense, ids, torch.float32, 16)) < TOLERANCE[torch.float32]


def _blocks(values: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(quantize_k(values, qtype) if qtype in QUANTIZERS else quantize(values, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_quant_embedding_rows_are_the_dequantized_tables(qtype, dtype):
    vocab, hidden = 50, 512
    raw = _blocks(np.random.default_rng(1).standard_normal((vocab, hidden)).astype(np.float32), qtype)
    assert raw.shape == (vocab, hidden // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])
    embed = QuantEmbedding.of(raw, qtype, hidden, dtype)
    table = dequantize(raw, qtype, (vocab, hidden)).to(dtype)
    ids = torch.tensor([[3, 49, 0, 3], [17, 17, 1, 48]])  # repeats, both ends of the table
    rows = embed(ids)
    assert rows.shape == (2, 4, hidden) and rows.dtype == dtype
    assert torch.equal(rows, table[ids])
    assert torch.equal(embedding_rows(embed, ids), embedding_rows(table, ids))


@pytest.mark.parametrize("quant, tie", [("q4_k_m", False), ("q4_k_m", True), ("q4_1", True)], ids=["q4_k_m", "q4_k_m-tied", "q4_1-tied"])
def test_dense_target_keeps_its_embedding_in_blocks(tmp_path, quant, tie):
    """The dense family takes the same embedding: kept where it has a block type, and a tied head
    reads the same blocks where their type has a kernel; otherwise both share one dequantized tensor."""
    path = write_gguf(hf_model("qwen3", tie=tie, seed=4, layers=1), tmp_path / "dense.gguf", quant)
    dense, config = load_target(path)
    packed, _ = load_target(path, keep_quantized=True)
    embed_type = GGUFFile(path).raw("token_embd.weight")[1]
    assert isinstance(packed.embed_tokens, QuantEmbedding) == (not tie or embed_type in KERNEL_TYPES)
    if tie and isinstance(packed.embed_tokens, QuantEmbedding):
        assert _same_storage(packed.lm_head.raw, packed.embed_tokens.raw)
    elif tie:
        assert _same_storage(packed.lm_head.weight, packed.embed_tokens.weight)
    tokens = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.inference_mode():
        ours, reference = packed.forward_sequences(tokens)[0], dense.forward_sequences(tokens)[0]
        assert torch.equal(packed.lm_head(ours), dense.lm_head(reference))  # same weights, same order: the same bits


def _interleaved_load(path, monkeypatch):
    """``load_target(path, dtype=bfloat16, keep_quantized=True)`` as on a GPU where gguf_mma's
    kernels run (the loaders then interleave each layer's Q4_K and Q6_K blocks: ``quantized.interleave_layers``)."""
    with monkeypatch.context() as patched:
        patched.setattr(gguf_mma, "runs_on", lambda device: True)
        model, _ = load_target(path, dtype=torch.bfloat16, keep_quantized=True)
    layouts = {name: m.interleaved for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert any(layouts.values())
    assert all(m.interleaved == (m.qtype in (Q.Q4_K, Q.Q6_K) and m.out_features % 16 == 0)
               for name, m in model.layers.named_modules() if isinstance(m, QuantLinear))
    assert not getattr(model.lm_head, "interleaved", False)  # the head keeps the file's layout (the draft may borrow it)
    return model


def test_interleaved_hybrid_gives_the_file_layouts_logits_bit_for_bit(files, monkeypatch):
    packed, config = load_target(files["target"], dtype=torch.bfloat16, keep_quantized=True)
    interleaved = _interleaved_load(files["target"], monkeypatch)
    fused = [f for m in interleaved.modules() for f in vars(m).values() if isinstance(f, FusedLinear) and f.interleaved]
    assert fused  # fused projections keep their parts' layout
    ids = torch.randint(0, config.vocab_size, (72,), generator=torch.Generator().manual_seed(8))
    assert torch.equal(_logits(interleaved, ids, torch.bfloat16, 68), _logits(packed, ids, torch.bfloat16, 68))


def test_interleaved_dense_gives_the_file_layouts_logits_bit_for_bit(tmp_path, monkeypatch):
    path = write_gguf(hf_model("qwen3", seed=5, layers=1), tmp_path / "dense.gguf", "q4_k_m")
    packed, _ = load_target(path, dtype=torch.bfloat16, keep_quantized=True)
    interleaved = _interleaved_load(path, monkeypatch)
    tokens = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.inference_mode():
        assert torch.equal(interleaved.forward_sequences(tokens)[0], packed.forward_sequences(tokens)[0])


def test_nothing_is_interleaved_where_the_kernel_does_not_run_or_the_switch_says_so(files, monkeypatch):
    def interleaved(**kwargs) -> bool:
        model, _ = load_target(files["target"], keep_quantized=True, **kwargs)
        return any(m.interleaved for m in model.modules() if isinstance(m, QuantLinear))

    assert not interleaved(dtype=torch.bfloat16)  # the CPU
    monkeypatch.setattr(gguf_mma, "runs_on", lambda device: True)
    assert not interleaved(dtype=torch.float32)  # not the kernel's dtype: the Triton kernels would de-interleave each call
    monkeypatch.setenv("SPLITSPEC_NATIVE_OFF", "interleave")
    assert not interleaved(dtype=torch.bfloat16)


def test_draft_head_and_embedding_in_blocks_equal_the_dequantized_ones(files):
    embed, head, config = load_target_head(files["target"])
    q_embed, q_head, q_config = load_target_head(files["target"], keep_quantized=True)
    assert q_config == config and isinstance(embed, torch.Tensor) and isinstance(head, torch.Tensor)
    assert isinstance(q_embed, QuantEmbedding) and q_embed.qtype == Q.Q4_K
    assert isinstance(q_head, QuantLinear) and q_head.qtype == Q.Q6_K
    ids = torch.arange(config.vocab_size)
    assert torch.equal(embedding_rows(q_embed, ids), embed)
    hidden = torch.randn(15, config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(head_logits(hidden, q_head), head_logits(hidden, head))


def _proposals(model, embed, head, fixed_shapes: bool) -> list:
    """Three sequences' proposals over two steps: one alone (the single pass), then all three
    together (the batched pass); on fixed shapes when asked (``BlockGraphs``, no capture on a CPU)."""
    c = model.config
    graphs = BlockGraphs(model, embed, head, context=64, sequences=4, capture=False) if fixed_shapes else None
    engine = DraftEngine(model, embed, head, graphs=graphs)
    features = torch.randn(30, c.num_taps * c.hidden_size, generator=torch.Generator().manual_seed(4))
    out = [engine.propose("a", 7, 9, features[:9], top_k=4)]
    steps = [ProposeStep("a", 11, 12, features[9:12], 4), ProposeStep("b", 3, 6, features[:6], 8), ProposeStep("c", 250, 10, features[10:20], 4)]
    out += engine.propose_batch(steps)
    return [(p.top_ids, p.top_logprobs) for p in out]


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["eager", "fixed-shapes"])
def test_draft_proposals_through_the_blocks_equal_the_dequantized_head(files, fixed_shapes):
    model, _ = load_dflash_draft(files["draft_dir"])
    reference = _proposals(model, *load_target_head(files["target"])[:2], fixed_shapes)
    ours = _proposals(model, *load_target_head(files["target"], keep_quantized=True)[:2], fixed_shapes)
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(ours, reference, strict=True):
        assert torch.equal(ids, ref_ids) and torch.equal(logprobs, ref_logprobs)


def test_gguf_draft_keeps_its_linears_in_blocks(files):
    dense, config = load_dflash_draft(files["draft_gguf"])
    packed, _ = load_dflash_draft(files["draft_gguf"], keep_quantized=True)
    linears = [m for m in packed.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    assert len(linears) == 1 + 7 * config.num_layers and all(isinstance(m, QuantLinear) and m.qtype == Q.Q8_0 for m in linears)
    assert isinstance(dense.fc, nn.Linear)
    embed, head, _ = load_target_head(files["target"], keep_quantized=True)
    reference, ours = _proposals(dense, embed, head, True), _proposals(packed, embed, head, True)
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(ours, reference, strict=True):
        # The dequantized draft fuses q/k/v and gate/up into single matmuls: other shapes, other last bits.
        assert torch.equal(ids, ref_ids) and torch.allclose(logprobs, ref_logprobs, atol=1e-5)


def _linked(model) -> list[tuple]:
    """Each layer's (input norm's consumer, post-attention norm's, MLP activation's down_proj type)."""
    return [(layer.input_layernorm.consumer, layer.post_attention_layernorm.consumer, layer.mlp.produced) for layer in model.layers]


def test_producers_link_to_their_readers_block_types_where_produce_runs(files, monkeypatch):
    assert set(sum(_linked(load_target(files["target"], keep_quantized=True)[0]), ())) == {None}  # the CPU: nowhere to run
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    model, _ = load_target(files["target"], keep_quantized=True)
    # The fixture: layer 1's up_proj is Q5_0 (no kernel, a float linear), so its post-attention
    # norm stays apart; Q4_K_M gives the DeltaNet layers' in_proj_qkv Q6_K beside Q4_K z, b and a
    # (the input norm runs for the commoner type; the other prepares x again from its inputs).
    assert _linked(model) == [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q6_K, None, Q.Q6_K), (Q.Q6_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K, Q.Q6_K)]
    assert model.norm.consumer is None  # the logits' rows are picked from its output
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "")
    packed, _ = load_target(files["target"], dtype=torch.float64)
    assert set(sum(_linked(packed), ())) == {None}  # dequantized: no quantized reader


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_linked_hybrid_computes_what_the_launches_apart_do(files, monkeypatch, dtype):
    """The CPU reference path of the producers inside the x preparation: every placeholder it
    returns is NaN, so a reader that is no quantized matmul would poison the logits; the values
    the matmuls read are the producers' own, so the logits are the unlinked model's bit for bit.
    Passes of 1-32 rows run linked (here: each step), more rows apart (the 36-row prompt)."""
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    model, config = load_target(files["target"], dtype=dtype, keep_quantized=True)
    calls = []
    produce = gguf_mma.produce
    monkeypatch.setattr(gguf_mma, "produce", lambda p, qtype: calls.append(p.kind) or produce(p, qtype))
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    linked = _logits(model, ids, dtype, 36)
    # Each of the 4 one-row steps: layer 0's input norm (of the embedding), 6 added norms (3 input,
    # 3 post-attention: layer 1's stays apart), 3 activations (layer 1's gate and up are no one
    # matmul: their types differ); the 36-row prompt none.
    assert (calls.count(gguf_mma.NORM), calls.count(gguf_mma.ADD_NORM), calls.count(gguf_mma.SILU_MUL)) == (4, 24, 12)
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "")
    assert torch.equal(linked, _logits(model, ids, dtype, 36)) and not linked.isnan().any()
    assert len(calls) == 40


def test_linked_dense_computes_what_the_launches_apart_do(tmp_path, monkeypatch):
    """As above for a dense Q4_K_M target (the 8B's family): its attention and MLP read every placeholder through their matmuls."""
    path = write_gguf(hf_model("qwen3", seed=5, layers=2), tmp_path / "dense.gguf", "q4_k_m")
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "gguf_prepare")
    model, config = load_target(path, keep_quantized=True)
    assert _linked(model) == [(Q.Q4_K, Q.Q4_K, Q.Q6_K)] * 2
    calls = []
    produce = gguf_mma.produce
    monkeypatch.setattr(gguf_mma, "produce", lambda p, qtype: calls.append(p.kind) or produce(p, qtype))
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    linked = _logits(model, ids, torch.float32, 8)  # an 8-row prompt, then steps: every pass linked
    assert len(calls) == 5 * 6  # 5 passes x (2 layers x (input norm, post-attention norm, activation))
    monkeypatch.setenv("SPLITSPEC_NATIVE_ON", "")
    assert torch.equal(linked, _logits(model, ids, torch.float32, 8)) and not linked.isnan().any()
