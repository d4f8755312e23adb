"""The draft's top-K-of-log-softmax kernels against the plain-torch reference, under Triton's
interpreter on the CPU (tests/conftest.py turns it on; the same source runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from native import top_k  # noqa: E402
from services.draft.graphs import top_k_of  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "k"), [(10000, 8), (4096, 1), (300, 64), (9000, 20)])
def test_top_k_log_softmax_matches_the_reference(dtype, vocab, k):
    # 10000 and 9000: several chunks with a short last one; 300: fewer columns than a chunk.
    torch.manual_seed(vocab + k)
    logits = (torch.randn(5, vocab) * 4).to(dtype)
    ids, logprobs = top_k.top_k_log_softmax(logits, k)
    ref_ids, ref_logprobs = top_k.top_k_log_softmax_reference(logits, k)
    assert ids.dtype == torch.int32 and logprobs.dtype == torch.float32 and ids.shape == (5, k)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5), (logprobs - ref_logprobs).abs().max()
    # Highest first, and each id's own log-prob: ids are exact wherever values do not tie.
    assert (logprobs[:, 1:] <= logprobs[:, :-1]).all()
    full = torch.log_softmax(logits.float(), -1)  # [5, vocab]
    assert torch.allclose(logprobs, full.gather(1, ids.long()), atol=1e-5)
    untied = (full[:, None, :] == ref_logprobs[:, :, None]).sum(-1) == 1  # [5, k]: no other column has the value
    assert untied.float().mean() > 0.3
    assert torch.equal(ids[untied], ref_ids[untied])


def test_ties_go_to_the_lower_column():
    logits = torch.zeros(2, 9000)
    logits[0, [8500, 7, 4200]] = 3.0  # one tie across three chunks
    logits[1, 4100:4110] = 1.0
    ids, logprobs = top_k.top_k_log_softmax(logits, 4)
    assert ids[0].tolist() == [7, 4200, 8500, 0]
    assert ids[1].tolist() == [4100, 4101, 4102, 4103]
    assert torch.allclose(logprobs, top_k.top_k_log_softmax_reference(logits, 4)[1])


def test_the_draft_takes_the_kernel_where_it_runs(monkeypatch):
    torch.manual_seed(3)
    hidden, head = torch.randn(16, 32), torch.randn(5000, 32)
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("SPLITSPEC_NATIVE_CPU", native)
        results.append(top_k_of(hidden, head, 8))
    (ids, logprobs), (ref_ids, ref_logprobs) = results
    assert ids.dtype == ref_ids.dtype == torch.int32 and ids.shape == (15, 8)
    assert torch.equal(ids, ref_ids) and torch.allclose(logprobs, ref_logprobs, atol=1e-5)
    assert not top_k.supported(torch.randn(3, 50), 64)  # more candidates asked than columns: the reference
