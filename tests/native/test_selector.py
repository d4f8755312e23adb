"""A DFlash2 selector's pair-score kernel against its plain-torch reference
(``CandidateSelector.pair_scores``), under Triton's interpreter on the CPU (tests/conftest.py turns it on)."""

from __future__ import annotations

import pytest
import torch

from splitspec.models.dflash2 import CandidateSelector

pytest.importorskip("triton", reason="triton is not installed")

from native import selector  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lead", "k", "rank"), [((), 16, 64), ((3,), 5, 300), ((2,), 20, 32)], ids=["one-block", "odd-k-and-rank", "k-past-16"])
def test_the_kernel_matches_the_reference(dtype, lead, k, rank, monkeypatch):
    torch.manual_seed(0)
    hidden_size, vocab, depths = 48, 300, 7
    sel = CandidateSelector(hidden_size, rank, vocab)
    for p in sel.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    sel.to(dtype)
    hidden = torch.randn(*lead, depths, hidden_size, dtype=dtype)
    candidates = torch.stack([torch.randperm(vocab)[:k] for _ in range(hidden[..., 0].numel())]).reshape(*lead, depths, k).int()
    unary = torch.randn(*lead, depths, k).log_softmax(-1)
    anchor = torch.randint(0, vocab, lead)
    outs = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        with torch.inference_mode():  # the kernel has no backward: autograd would run the reference
            outs.append(sel.pair_scores(hidden, unary, candidates, anchor))
    assert selector.supported(sel.hidden_projection(hidden).detach(), sel.predecessor_codebook, sel.successor_codebook, unary, candidates)
    got, want = outs
    assert got.dtype == torch.float32 and got.shape == (*lead, depths, k, k)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    # Depth 1 follows the anchor in every row: its rows are all alike, up to the dot's float32
    # rounding (the interpreter's numpy matmul sums some rows in another order on some CPUs: on an
    # AMD EPYC's OpenBLAS, identical rows of a 16 x 64 by 64 x 16 product differ in their last bits).
    first = got[..., 0, :1, :].expand_as(got[..., 0, :, :])
    assert torch.allclose(first, got[..., 0, :, :], atol=1e-6, rtol=1e-6), (first - got[..., 0, :, :]).abs().max()
