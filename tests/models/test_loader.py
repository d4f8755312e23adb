"""Loader edges: bad files named precisely, GGUF drafts, draft/target fit, Hub references."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from splitspec.fixtures.gguf_writing import encoder
from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_draft, random_target, write_draft_gguf, write_target_gguf
from splitspec.models.gguf_file import ModelFileError
from splitspec.models.hub import parse_hf_reference
from splitspec.models.loader import check_draft_fits, load_dflash_draft, load_target, read_target_config
from splitspec.text.tokenizer import byte_level_vocab

SPEC = TinySpec(hidden_size=64, target_layers=2, seed=4)


def _target(tmp_path, name="t.gguf", edit=None, encode=None, arch="qwen3"):
    """A tiny target GGUF whose GGUF-named weights ``edit`` may change first."""
    vocab = byte_level_vocab()
    config, state = random_target(TinySpec(**{**SPEC.__dict__, "architecture": arch}), len(vocab.tokens), np.random.default_rng(0))
    weights = gguf_weights(config, state)
    if edit:
        edit(weights)
    path = tmp_path / name
    write_target_gguf(path, config, weights, vocab, encode or "f32")
    return path


def _expect(path_fragment, *fragments):
    return pytest.raises(ModelFileError, match=".*".join([str(path_fragment).replace(".", r"\."), *fragments]))


def test_truncated_gguf(tmp_path):
    path = _target(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with _expect(path, "truncated or corrupt"):
        load_target(path)


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_loading_a_target_does_not_import_torch_dynamo(tmp_path, arch):
    # The models are built on the meta device before the file's weights fill them; a random
    # initialisation there runs in torch's Python reference kernels, whose first call imports
    # torch._dynamo: 1.1 s of every worker's start (BENCHMARKS.md, run [U2]).
    from splitspec.fixtures.tiny import make_tiny

    target, _ = make_tiny(tmp_path, TinySpec(architecture=arch, target_layers=2, seed=1))
    code = "import sys; from splitspec.models.loader import load_target; load_target(sys.argv[1]); print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_unknown_architecture(tmp_path):
    path = _target(tmp_path)
    data = path.read_bytes().replace(b"qwen3", b"bert5")  # architecture value and its metadata keys alike
    path.write_bytes(data)
    with _expect(path, "unsupported architecture 'bert5'", "llama, qwen2, qwen3"):
        load_target(path)


def test_unsupported_quant_type(tmp_path):
    f32 = encoder("f32")

    def encode(name, array):
        if name == "blk.1.ffn_up.weight":  # Q2_K: 84-byte blocks of 256 values
            return np.zeros((array.shape[0], array.shape[1] // 256 * 84), np.uint8), Q.Q2_K
        return f32(name, array)

    path = _target(tmp_path, edit=lambda w: w.update({"blk.1.ffn_up.weight": np.zeros((128, 256), np.float32)}), encode=encode)
    with _expect(path, "'blk.1.ffn_up.weight'", "unsupported type Q2_K"):
        load_target(path)


def test_missing_and_misshapen_tensors(tmp_path):
    missing = _target(tmp_path, "missing.gguf", edit=lambda w: w.pop("blk.1.attn_v.weight"))
    with _expect(missing, "missing tensor 'blk.1.attn_v.weight'"):
        load_target(missing)
    wrong = _target(tmp_path, "wrong.gguf", edit=lambda w: w.update({"blk.0.ffn_down.weight": np.zeros((64, 64), np.float32)}))
    with _expect(wrong, "'blk.0.ffn_down.weight' has shape \\(64, 64\\), expected \\(64, 128\\)"):
        load_target(wrong)
    extra = _target(tmp_path, "extra.gguf", edit=lambda w: w.update({"blk.0.attn_output.bias": np.zeros(64, np.float32)}))
    with _expect(extra, "unexpected tensor 'blk.0.attn_output.bias'"):
        load_target(extra)
    metadata = _target(tmp_path, "metadata.gguf")
    metadata.write_bytes(metadata.read_bytes().replace(b"qwen3.context_length", b"qwen3.context_lengtX"))
    with _expect(metadata, "missing metadata key 'qwen3.context_length'"):
        load_target(metadata)


def _hf_dir(tmp_path, architectures=("Qwen3ForCausalLM",)):
    tmp_path.mkdir()
    config, state = random_target(SPEC, 260, np.random.default_rng(0))
    tensors = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in state.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": list(architectures), "vocab_size": 260, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False,
    }))
    return tmp_path


def test_hf_directory_errors(tmp_path):
    good = _hf_dir(tmp_path / "good")
    assert read_target_config(good).architecture == "qwen3"
    bad_arch = _hf_dir(tmp_path / "arch", ["BertModel"])
    with _expect(bad_arch / "config.json", "unsupported architectures \\['BertModel'\\]"):
        load_target(bad_arch)
    corrupt = good / "model.safetensors"
    corrupt.write_bytes(b"\xff" * 8 + b"{not json" + corrupt.read_bytes()[17:])
    with _expect(corrupt, "not a readable safetensors file"):
        load_target(good)
    (good / "model.safetensors").unlink()
    with _expect(good / "model.safetensors", "no such file"):
        load_target(good)


def test_gguf_draft_equals_directory_draft_and_must_fit(tmp_path):
    vocab = byte_level_vocab()
    rng = np.random.default_rng(1)
    target, _ = random_target(TinySpec(target_layers=6), len(vocab.tokens), rng)
    config, tensors = random_draft(target, TinySpec(draft_layers=2), vocab.special_ids["<|mask|>"], rng)
    directory = tmp_path / "draft"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_dict(target.num_layers)))
    write_draft_gguf(tmp_path / "draft.gguf", config, tensors)
    from_dir, dir_config = load_dflash_draft(directory)
    from_gguf, gguf_config = load_dflash_draft(tmp_path / "draft.gguf")
    assert gguf_config.rms_norm_eps == pytest.approx(dir_config.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(gguf_config, rms_norm_eps=dir_config.rms_norm_eps) == dir_config
    for (name, a), (_, b) in zip(from_dir.state_dict().items(), from_gguf.state_dict().items()):
        assert torch.equal(a, b), name
    check_draft_fits(gguf_config, target, "draft", "target")
    small = random_target(TinySpec(hidden_size=32, head_dim=8, target_layers=2), 100, rng)[0]
    with pytest.raises(ModelFileError) as info:
        check_draft_fits(gguf_config, small, "draft.gguf", "small.gguf")
    message = str(info.value)
    assert "draft.gguf" in message and "hidden_size 64 (draft) vs 32 (target)" in message
    assert "vocab_size 260 (draft) vs 100 (target)" in message and "target_layer_ids [2] outside the target's 2 layers" in message


def test_gguf_draft_without_tap_list_uses_the_reference_default(tmp_path):
    vocab = byte_level_vocab()
    rng = np.random.default_rng(2)
    target, _ = random_target(TinySpec(target_layers=36), len(vocab.tokens), rng)
    config, tensors = random_draft(target, TinySpec(draft_layers=5), vocab.special_ids["<|mask|>"], rng)
    write_draft_gguf(tmp_path / "full.gguf", config, tensors)
    path = tmp_path / "draft.gguf"
    # Rename the optional key (same length) so that the file no longer lists its taps.
    path.write_bytes((tmp_path / "full.gguf").read_bytes().replace(b"dflash.target_layer_ids", b"dflash.unknown_key_zzzz"))
    with _expect(path, "target's layer count is unknown"):
        load_dflash_draft(path)
    _, derived = load_dflash_draft(path, num_target_layers=36)
    assert derived.target_layer_ids == (1, 9, 17, 25, 33)  # the published Qwen3-8B draft's taps


def test_hf_references():
    assert parse_hf_reference("hf://Qwen/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf") == ("Qwen/Qwen3-8B-GGUF", None, "Qwen3-8B-Q4_K_M.gguf")
    assert parse_hf_reference("hf://org/repo@v1.0/sub/dir/m.gguf") == ("org/repo", "v1.0", "sub/dir/m.gguf")
    assert parse_hf_reference("hf://org/repo") == ("org/repo", None, None)
    with pytest.raises(ModelFileError, match="hf://OWNER/REPO"):
        parse_hf_reference("hf://just-a-name")


def test_offline_hub_reference_resolves_from_the_cache(tmp_path):
    """A model placed in a Hugging Face cache layout resolves with HF_HUB_OFFLINE=1, split parts too."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--splitspec-test--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    vocab = byte_level_vocab()
    config, state = random_target(SPEC, len(vocab.tokens), np.random.default_rng(0))
    write_target_gguf(snapshot / "m.gguf", config, gguf_weights(config, state), vocab, "f32", split_max_tensors=10)
    script = (
        "from splitspec.models.hub import resolve_model; from splitspec.models.loader import read_target_config\n"
        "p = resolve_model('hf://splitspec-test/tiny/m-00002-of-00003.gguf'); print(p.name, read_target_config(p).num_layers)\n"
        "try:\n    resolve_model('hf://splitspec-test/tiny/absent.gguf')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "m-00001-of-00003.gguf 2"
    assert second.startswith("ModelFileError hf://splitspec-test/tiny/absent.gguf: cannot fetch") and "HF_HUB_OFFLINE" in second


def test_a_load_without_a_terminal_logs_its_progress(caplog):
    """Under serve, docker or Kubernetes a worker's stderr is no terminal: a long load logs a
    progress line now and then instead of drawing a bar (splitspec.models.weights.progress)."""
    from splitspec.models.weights import progress

    with caplog.at_level("INFO", logger="splitspec.models.weights"):
        assert list(progress(list(range(5)), "loading x.gguf", every_s=0.0)) == list(range(5))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"loading x.gguf: {i} of 5 tensors after 0 s" for i in range(1, 5)]
