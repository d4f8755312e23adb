"""The target engine's tests: the two target families of the tiny pairs."""

import pytest
import torch

from splitspec.models.loader import load_target


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def model(request, tiny_pair, tiny_qwen35_pair):
    """The dense and the hybrid tiny target in float64, where a pass's orders of work (batched or
    alone, staged or serial) agree to ~1e-12. A module that needs another dtype defines its own."""
    path = tiny_pair.target if request.param == "qwen3" else tiny_qwen35_pair.target
    model, _ = load_target(path, dtype=torch.float64)
    return model
