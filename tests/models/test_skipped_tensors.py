"""Files that carry more than a text model (a vision tower, its projector, multi-token-prediction
heads) load their text model and say what they skip; any other unread tensor is still refused."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from splitspec.fixtures.tiny import TinySpec
from splitspec.fixtures.tiny_qwen35 import qwen35_hf_weights, qwen35_to_gguf, tiny_qwen35_config, write_qwen35_gguf
from splitspec.models.gguf_file import ModelFileError, skip_other_tensors
from splitspec.models.loader import load_target
from splitspec.text.tokenizer import byte_level_vocab
from tests.dense_fixtures import hf_model, write_gguf

SPEC = TinySpec(architecture="qwen35", target_layers=4)
EXTRA = {  # what real multimodal / MTP files carry beside the text model (small stand-ins)
    "v.blk.0.attn_q.weight": np.ones((32, 32), np.float32),
    "mm.0.weight": np.ones((32, 32), np.float32),
    "blk.1.nextn.eh_proj.weight": np.ones((32, 64), np.float32),
}


def _qwen35(tmp_path, extra: dict[str, np.ndarray]):
    vocab = byte_level_vocab()
    config = tiny_qwen35_config(SPEC, len(vocab.tokens))
    weights = qwen35_to_gguf(config, qwen35_hf_weights(config, np.random.default_rng(0), 0.05))
    plain, full = tmp_path / "text.gguf", tmp_path / "full.gguf"
    write_qwen35_gguf(plain, config, weights, vocab, "f32")
    write_qwen35_gguf(full, config, {**weights, **extra}, vocab, "f32")
    return plain, full


def test_qwen35_gguf_skips_vision_and_mtp_tensors_and_says_so(tmp_path, caplog):
    plain, full = _qwen35(tmp_path, EXTRA)
    with caplog.at_level(logging.INFO, logger="splitspec.models.gguf_file"):
        ours, _ = load_target(full)
    assert "skipping 3 tensors it does not use (1 mm.*, 1 nextn.*, 1 v.*)" in caplog.text
    reference, _ = load_target(plain)
    for (name, a), (_, b) in zip(ours.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_qwen35_gguf_refuses_an_unknown_tensor(tmp_path):
    _, full = _qwen35(tmp_path, {"blk.0.mystery.weight": np.ones((4, 32), np.float32)})
    with pytest.raises(ModelFileError, match="unexpected tensor 'blk.0.mystery.weight' for a qwen35 model"):
        load_target(full)


def test_dense_gguf_skips_a_projector_but_refuses_an_unknown_tensor(tmp_path, caplog):
    path = write_gguf(hf_model("qwen3", seed=1, layers=1), tmp_path / "model.gguf", "f32")
    from gguf import GGUFReader

    names = [t.name for t in GGUFReader(path).tensors]
    with caplog.at_level(logging.INFO, logger="splitspec.models.gguf_file"):
        assert skip_other_tensors(path, [*names, "mm.0.weight", "mm.2.bias"], names, "qwen3") == ["mm.0.weight", "mm.2.bias"]
    assert "skipping 2 tensors it does not use (2 mm.*)" in caplog.text
    with pytest.raises(ModelFileError, match="unexpected tensor 'rope_freqs_x' for a qwen3 model"):
        skip_other_tensors(path, [*names, "rope_freqs_x"], names, "qwen3")


def test_qwen35_hf_directory_skips_its_vision_tower_and_mtp_head(tmp_path, caplog):
    vocab = byte_level_vocab()
    config = tiny_qwen35_config(SPEC, len(vocab.tokens))
    hf = qwen35_hf_weights(config, np.random.default_rng(0), 0.05)
    from tests.models.test_qwen35 import hf_config

    directory = tmp_path / "hf"
    directory.mkdir()
    hf_config(config).save_pretrained(directory)
    extra = {"model.visual.blocks.0.attn.qkv.weight": np.ones((8, 8), np.float32), "mtp.fc.weight": np.ones((8, 16), np.float32)}
    save_file({**{k: np.ascontiguousarray(v) for k, v in hf.items()}, **extra}, directory / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="splitspec.models.gguf_file"):
        ours, _ = load_target(directory)
    assert "skipping 2 tensors it does not use (1 mtp.*, 1 visual.*)" in caplog.text
    assert torch.equal(ours.embed_tokens.weight, torch.from_numpy(hf["model.embed_tokens.weight"]))
