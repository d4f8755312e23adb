"""``--keep-quantized auto|on|off`` (splitspec/models/keep_quantized.py): the sizes it weighs, its
decision, and the real ``splitspec target`` process keeping a GGUF's blocks only where their
dequantized copy would not fit."""

from __future__ import annotations

import argparse

import pytest
import torch
from gguf import GGUFReader

from splitspec.fixtures.tiny import TinySpec, make_tiny
from splitspec.models import keep_quantized as kq

GiB = 1 << 30
SPEC = TinySpec(hidden_size=512, num_heads=8, head_dim=64, intermediate_size=2048)


@pytest.fixture(scope="module")
def q8_target(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("keep"), SPEC, weight_type="q8_0")
    return path


def test_dequantized_bytes_are_every_value_at_the_dtype_size(q8_target, tmp_path):
    values = {t.name: int(t.n_elements) for t in GGUFReader(q8_target).tensors}
    assert kq.dequantized_bytes(q8_target, torch.bfloat16) == 2 * sum(values.values())
    assert kq.dequantized_bytes(q8_target, torch.float32) == 4 * sum(values.values())
    # Only the named tensors: what a draft borrows of its target.
    assert kq.dequantized_bytes(q8_target, torch.float32, ("token_embd.weight",)) == 4 * values["token_embd.weight"]


def test_nothing_to_keep_where_nothing_is_in_blocks(tmp_path):
    float_target, _ = make_tiny(tmp_path, SPEC)  # F32 tensors only
    assert kq.dequantized_bytes(float_target, torch.float32) is None
    assert kq.dequantized_bytes(tmp_path, torch.float32) is None  # a directory: safetensors
    decision = kq.decide("on", None, GiB, torch.float32)
    assert not decision.keep and "no quantized GGUF weights" in decision.reason


def test_auto_keeps_the_blocks_only_when_the_dequantized_copy_would_crowd_the_device():
    # The issue-#17 case: a 27B Q4_K_M is 54 GB in bfloat16, a 24 GB card has 23 GiB free.
    big = kq.decide("auto", 54 * 10**9, 23 * GiB, torch.bfloat16)
    assert big.keep and "stay quantized" in big.reason and "50.29 GiB" in big.reason
    # An 8B Q4_K_M on an H200: its 16 GB of bfloat16 fit, and run faster than the blocks.
    small = kq.decide("auto", 16 * 10**9, 139 * GiB, torch.bfloat16)
    assert not small.keep and "dequantized" in small.reason
    # The boundary: more than AUTO_SHARE of what is available keeps.
    assert not kq.decide("auto", 75, 100, torch.bfloat16).keep
    assert kq.decide("auto", 76, 100, torch.bfloat16).keep


def test_on_and_off_hold_whatever_the_sizes():
    assert kq.decide("on", 1, 100 * GiB, torch.bfloat16).keep
    assert not kq.decide("off", 100 * GiB, 1, torch.bfloat16).keep
    with pytest.raises(ValueError, match="choose auto, on or off"):
        kq.decide("yes", 1, 1, torch.bfloat16)


def test_the_flag_defaults_to_auto_and_alone_means_on():
    p = argparse.ArgumentParser()
    kq.add_argument(p, "test")
    assert p.parse_args([]).keep_quantized == "auto"
    assert p.parse_args(["--keep-quantized"]).keep_quantized == "on"
    assert p.parse_args(["--keep-quantized", "off"]).keep_quantized == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--keep-quantized", "maybe"])


def test_available_is_held_to_the_cap():
    cpu = torch.device("cpu")
    assert kq.available_bytes(cpu, None) > GiB  # this machine's memory
    assert kq.available_bytes(cpu, 123) == 123


@pytest.mark.slow
@pytest.mark.parametrize("crowded", [True, False])
def test_target_worker_keeps_the_blocks_only_under_a_cap_they_need(services, q8_target, crowded):
    """The real ``splitspec target`` with the default ``--keep-quantized`` (auto): under a cap that
    its float32 copy would crowd it keeps the Q8_0 blocks and serves; without a cap it dequantizes."""
    dequantized = kq.dequantized_bytes(q8_target, torch.float32)
    cap = ["--memory-cap-gb", f"{dequantized / 0.9 / GiB:.6f}"] if crowded else []
    services.start(
        "target", "target", "--model", str(q8_target), "--dtype", "float32", "--max-sequences", "2",
        "--max-kv-tokens", "64", "--max-tree-nodes", "8", *cap,
    )
    log = services.log("target")
    if crowded:
        assert "target weights: --keep-quantized auto:" in log and "the GGUF blocks stay quantized" in log
        assert "keep-quantized target:" in log and "linears in blocks (Q8_0" in log
    else:
        assert "--keep-quantized auto:" in log and "dequantized (faster" in log
        assert "keep-quantized target:" not in log


def test_the_draft_weighs_the_target_head_it_borrows(q8_target, tmp_path):
    """``splitspec draft``'s decision counts what it loads of a GGUF target (embedding, LM head) and
    a GGUF draft's own weights; a safetensors draft adds nothing to keep."""
    from services.draft.main import keep_decision

    draft_dir = make_tiny(tmp_path, SPEC)[1]
    head = kq.dequantized_bytes(q8_target, torch.float32, ("token_embd.weight", "output.weight"))
    args = argparse.Namespace(model=str(draft_dir), target_model=str(q8_target), keep_quantized="auto", memory_cap_gb=0.0)
    assert not keep_decision(args, torch.device("cpu"), torch.float32).keep
    args.memory_cap_gb = head / GiB  # the head alone fills the cap
    decision = keep_decision(args, torch.device("cpu"), torch.float32)
    assert decision.keep and "stay quantized" in decision.reason


@pytest.mark.parametrize("command", ["target", "draft", "serve"])
def test_every_command_help_renders_the_flag(command, capsys):
    """argparse formats help with %: the flag's help must render (it names a percentage)."""
    from splitspec.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # the help wraps its lines
    assert "--keep-quantized" in out and "75% of the memory available" in out
