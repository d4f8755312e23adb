"""The dense family (Llama, Qwen2, Qwen3) against transformers, from GGUF files and HF directories.

For GGUF, transformers' own GGUF loader reads the same file: weights must agree bit for bit (same
dequantization, llama's q/k permutation undone the same way) and logits to float32 rounding.
RoPE scaling (which transformers' GGUF loader ignores) is checked against the float model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitspec.models.dense import DenseForCausalLM, KVCache
from splitspec.models.gguf_file import GGUFFile
from splitspec.models.loader import load_target, read_target_config
from splitspec.text.tokenizer import Tokenizer
from tests.dense_fixtures import ARCHITECTURES, LINEAR_ROPE, LLAMA3_ROPE, QUANT_TYPES, hf_model, write_gguf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # float32 logits of the same weights, different op order


def _causal(n: int, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + n)
    return torch.arange(start + n)[None, :] <= positions[:, None]


def _ids(config, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _our_logits(model, config, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache.allocate(config, len(ids), torch.device("cpu"), torch.float32)
    logits, _ = model(ids, torch.arange(len(ids)), cache, 0, _causal(len(ids)))
    return logits


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _assert_same_weights(ours, hf) -> None:
    theirs = hf.state_dict()
    for name, p in ours.state_dict().items():
        ref = theirs[name if name == "lm_head.weight" else f"model.{name}"]
        assert torch.equal(p, ref), f"{name} differs by {(p - ref).abs().max().item()}"


@pytest.fixture(scope="module", params=ARCHITECTURES)
def float_model(request):
    # qwen2 ties its embeddings (like Qwen2.5-0.5B); llama and qwen3 keep a separate LM head.
    return hf_model(request.param, tie=request.param == "qwen2", seed=len(request.param), layers=3)


@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_gguf_matches_transformers_gguf_loading(float_model, quant, tmp_path):
    path = write_gguf(float_model, tmp_path / "model.gguf", quant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours, config = load_target(path)
    assert config.architecture == float_model.config.model_type
    assert config.tie_word_embeddings == float_model.config.tie_word_embeddings
    _assert_same_weights(ours, hf)
    ids = _ids(config, 16, seed=0)
    assert (_our_logits(ours, config, ids) - _hf_logits(hf, ids)).abs().max().item() < TOLERANCE


def test_incremental_decode_and_taps_match_transformers(float_model, tmp_path):
    path = write_gguf(float_model, tmp_path / "model.gguf", "f32")
    ours, config = load_target(path)
    ids = _ids(config, 10, seed=1)
    cache = KVCache.allocate(config, 16, torch.device("cpu"), torch.float32)
    ours(ids[:4], torch.arange(4), cache, 0, _causal(4))
    for t in range(4, 10):
        step, _ = ours(ids[t : t + 1], torch.tensor([t]), cache, t, _causal(1, t))
        assert (step[0] - _hf_logits(float_model, ids[: t + 1])[-1]).abs().max().item() < TOLERANCE
    with torch.no_grad():
        hidden = float_model(ids[None, :6], output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is the output of layer i (HF normalises only the last one, never a tap).
    _, features = ours(ids[:6], torch.arange(6), KVCache.allocate(config, 8, torch.device("cpu"), torch.float32), 0, _causal(6), taps=(1, 0))
    assert (features - torch.cat([hidden[2][0], hidden[1][0]], dim=-1)).abs().max().item() < TOLERANCE


def test_batched_sequence_forward_matches_transformers(float_model, tmp_path):
    """The cache-free batched forward (training path) gives the same logits and taps as HF."""
    ours, config = load_target(write_gguf(float_model, tmp_path / "model.gguf", "f32"))
    ids = torch.stack([_ids(config, 12, seed=s) for s in (3, 4)])  # [2, 12]
    hidden, features = ours.forward_sequences(ids, taps=(0, 1))
    with torch.no_grad():
        ref = float_model(ids, output_hidden_states=True)
    assert (ours.lm_head(hidden) - ref.logits).abs().max().item() < TOLERANCE
    expected = torch.cat([ref.hidden_states[1], ref.hidden_states[2]], dim=-1)  # HF norms the last
    assert (features - expected).abs().max().item() < TOLERANCE
    # Differentiable when not fused for inference (as a model built for training is): gradients reach layer 0.
    trainable = DenseForCausalLM(config)
    trainable.load_state_dict(ours.state_dict())
    trainable.lm_head(trainable.forward_sequences(ids)[0]).logsumexp(-1).mean().backward()
    assert trainable.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch,rope", [("llama", LLAMA3_ROPE), ("qwen2", LINEAR_ROPE)], ids=["llama3", "linear"])
def test_gguf_rope_scaling_matches_transformers(arch, rope, tmp_path):
    model = hf_model(arch, rope=rope, seed=7)
    ours, config = load_target(write_gguf(model, tmp_path / "model.gguf", "f32"))
    assert config.rope_freq_factors is not None
    ids = _ids(config, 48, seed=2)
    ref = _hf_logits(model, ids)
    assert (_our_logits(ours, config, ids) - ref).abs().max().item() < TOLERANCE
    # The scaling must matter at these positions, or this test would prove nothing.
    unscaled = hf_model(arch, seed=7)
    assert (_hf_logits(unscaled, ids) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize(
    "arch,tie,rope,shard",
    [
        ("llama", False, None, None),
        ("llama", True, LLAMA3_ROPE, "300KB"),
        ("qwen2", False, LINEAR_ROPE, None),
        ("qwen2", True, None, "300KB"),
        ("qwen3", False, None, "300KB"),
        ("qwen3", True, None, None),
    ],
)
def test_hf_directory_matches_transformers(arch, tie, rope, shard, tmp_path):
    model = hf_model(arch, tie=tie, rope=rope, seed=11)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ours, config = load_target(tmp_path)
    assert (config.architecture, config.tie_word_embeddings) == (arch, tie)
    _assert_same_weights(ours, model)
    ids = _ids(config, 40, seed=3)
    assert (_our_logits(ours, config, ids) - _hf_logits(model, ids)).abs().max().item() < TOLERANCE


def test_split_gguf_loads_as_one_model(tmp_path):
    model = hf_model("qwen3", seed=5)
    whole, _ = load_target(write_gguf(model, tmp_path / "whole.gguf", "q8_0"))
    from splitspec.fixtures.tiny import gguf_weights, write_target_gguf
    from splitspec.text.tokenizer import byte_level_vocab
    from tests.dense_fixtures import dense_config, quant_encoder  # the writer's own pieces, split this time

    config = dense_config(model)
    state = {k.removeprefix("model."): v.detach().numpy() for k, v in model.state_dict().items()}
    write_target_gguf(tmp_path / "split.gguf", config, gguf_weights(config, state), byte_level_vocab(), quant_encoder("q8_0"), split_max_tensors=8)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 2
    for part in (parts[0], parts[-1]):  # any part names the whole model
        assert Tokenizer.load(part).encode("split") == Tokenizer.load(tmp_path / "whole.gguf").encode("split")
        split, split_config = load_target(part)
        assert split_config == read_target_config(tmp_path / "whole.gguf")
        for (name, a), (_, b) in zip(whole.state_dict().items(), split.state_dict().items()):
            assert torch.equal(a, b), name


def test_dequantization_is_gguf_bit_for_bit(tmp_path):
    """Ours is gguf's numpy dequantizer; the loaded (un-permuted) weights must equal it exactly."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from splitspec.fixtures.tiny import llama_permute_rows

    model = hf_model("llama", seed=9)
    path = write_gguf(model, tmp_path / "model.gguf", "q4_k_m")
    ours, config = load_target(path)
    f = GGUFFile(path)
    raw = {t.name: t for t in GGUFReader(path).tensors}
    for gguf_name, ours_name, heads in [
        ("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight", config.num_heads),
        ("blk.1.attn_k.weight", "layers.1.self_attn.k_proj.weight", config.num_kv_heads),
        ("blk.0.ffn_down.weight", "layers.0.mlp.down_proj.weight", None),
        ("output.weight", "lm_head.weight", None),
    ]:
        info = raw[gguf_name]
        ref = dequantize(info.data, info.tensor_type).reshape(f.tensor_shape(gguf_name))
        loaded = ours.state_dict()[ours_name].numpy()
        if heads is not None:
            loaded = llama_permute_rows(loaded, heads)  # back to the file's row order
        assert np.array_equal(loaded.view(np.uint32), ref.astype(np.float32).view(np.uint32)), gguf_name


def test_bfloat16_hf_directory_loads_exactly(tmp_path):
    """Real checkpoints are bfloat16: the weights come through unchanged, whatever the compute dtype."""
    model = hf_model("qwen3", seed=13).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours, config = load_target(tmp_path, dtype=torch.float32)
    # Reloaded rather than model.float(): casting the model also rounds its RoPE frequencies.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_same_weights(ours, reference)
    ids = _ids(config, 20, seed=4)
    assert (_our_logits(ours, config, ids) - _hf_logits(reference, ids)).abs().max().item() < TOLERANCE
