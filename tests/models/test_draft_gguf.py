"""Drafts in llama.cpp's ``dflash`` GGUF layout (splitspec.models.draft_gguf): a DFlash2 draft and
a DFlash one load equal to the same weights in z-lab's directory layout; bad files are refused
with the key named."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from splitspec.fixtures.tiny import TinySpec, random_draft, random_target, write_llama_dflash_gguf
from splitspec.models.dflash2 import DFlash2Config
from splitspec.models.gguf_file import ModelFileError
from splitspec.models.loader import check_draft_fits, load_dflash_draft, read_draft_config
from splitspec.text.tokenizer import byte_level_vocab


def _pair(tmp_path, draft_arch: str, **changes):
    """The same random draft as a z-lab directory and as a llama.cpp GGUF; its target's config."""
    vocab = byte_level_vocab()
    rng = np.random.default_rng(4)
    target, _ = random_target(TinySpec(target_layers=4), len(vocab.tokens), rng)
    config, tensors = random_draft(target, TinySpec(draft_layers=2, draft_arch=draft_arch), vocab.special_ids["<|mask|>"], rng)
    config = dataclasses.replace(config, **changes)
    directory = tmp_path / "draft"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_dict(target.num_layers)))
    write_llama_dflash_gguf(tmp_path / "draft.gguf", config, tensors)
    return target, config, tensors, directory


@pytest.mark.parametrize("draft_arch", ["dflash2", "dflash"])
def test_llama_layout_equals_the_directory_draft(tmp_path, draft_arch):
    target, config, _, directory = _pair(tmp_path, draft_arch, output_multiplier=0.5) if draft_arch == "dflash2" else _pair(tmp_path, draft_arch)
    from_dir, dir_config = load_dflash_draft(directory)
    from_gguf, gguf_config = load_dflash_draft(tmp_path / "draft.gguf")
    assert type(gguf_config) is type(dir_config) and (type(gguf_config) is DFlash2Config) == (draft_arch == "dflash2")
    assert gguf_config.target_layer_ids == config.target_layer_ids  # written as layer inputs, tap + 1
    fixed = {"rms_norm_eps": dir_config.rms_norm_eps, "vocab_size": dir_config.vocab_size}  # eps stored as float32; DFlash: vocab from the target
    assert dataclasses.replace(gguf_config, **fixed) == dir_config
    assert read_draft_config(tmp_path / "draft.gguf") == gguf_config
    a, b = from_dir.state_dict(), from_gguf.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    check_draft_fits(gguf_config, target, "draft.gguf", "target")


def _rewrite(tmp_path, config, tensors, name="bad.gguf"):
    write_llama_dflash_gguf(tmp_path / name, config, tensors)
    return tmp_path / name


def test_bad_llama_layout_files_are_refused_by_key(tmp_path):
    _, config, tensors, _ = _pair(tmp_path, "dflash2")
    full = (tmp_path / "draft.gguf").read_bytes()
    # A key renamed (same length) is a key missing.
    (tmp_path / "no_mask.gguf").write_bytes(full.replace(b"tokenizer.ggml.mask_token_id", b"tokenizer.ggml.zzzz_token_id"))
    with pytest.raises(ModelFileError, match="no tokenizer.ggml.mask_token_id"):
        load_dflash_draft(tmp_path / "no_mask.gguf")
    (tmp_path / "no_rank.gguf").write_bytes(full.replace(b"dflash.selector_rank", b"dflash.selector_zzzz"))
    with pytest.raises(ModelFileError, match="no dflash.selector_rank"):
        load_dflash_draft(tmp_path / "no_rank.gguf")
    (tmp_path / "unsaid.gguf").write_bytes(full.replace(b"dflash.attention.causal", b"dflash.attention.causaX"))
    load_dflash_draft(tmp_path / "unsaid.gguf")  # the key is optional: non-causal by default
    causal = bytearray(full)
    at = full.index(b"dflash.attention.causal") + len(b"dflash.attention.causal") + 4  # key, then its uint32 type, then the bool
    assert causal[at] == 0
    causal[at] = 1
    (tmp_path / "causal.gguf").write_bytes(bytes(causal))
    with pytest.raises(ModelFileError, match="causal is true"):
        load_dflash_draft(tmp_path / "causal.gguf")
    mixed = bytearray(_rewrite(tmp_path, dataclasses.replace(config, sliding_window=32), tensors, "mixed.gguf").read_bytes())
    key = b"dflash.attention.sliding_window_pattern"
    at = bytes(mixed).index(key) + len(key) + 4 + 4 + 8  # key, array type, element type, length, then one byte a layer
    assert mixed[at : at + 2] == b"\x01\x01"
    mixed[at + 1] = 0
    (tmp_path / "mixed.gguf").write_bytes(bytes(mixed))
    with pytest.raises(ModelFileError, match=r"\[True, False\] must give one kind of attention"):
        load_dflash_draft(tmp_path / "mixed.gguf")
    with pytest.raises(ModelFileError, match=r"target_layers \[0, 1\] count layer inputs"):
        load_dflash_draft(_rewrite(tmp_path, dataclasses.replace(config, target_layer_ids=(-1, 0)), tensors))
    with pytest.raises(ModelFileError, match="conv_group_size 7 does not divide hidden_size 64"):
        load_dflash_draft(_rewrite(tmp_path, dataclasses.replace(config, conv_group_size=7), tensors, "group.gguf"))
