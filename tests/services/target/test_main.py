"""``splitspec target``'s flags that need no running worker."""

from __future__ import annotations

import pytest

from services.target.main import draft_taps
from splitspec.models.loader import read_draft_config


def test_draft_taps_are_layer_ids_or_a_drafts_own(tiny_pair, tiny_qwen35_pair):
    assert draft_taps("", 4) == () and draft_taps(" 1, 3", 4) == (1, 3)
    for pair, layers in ((tiny_pair, 4), (tiny_qwen35_pair, 4)):
        wanted = tuple(read_draft_config(pair.draft, layers).target_layer_ids)
        assert wanted and draft_taps(str(pair.draft), layers) == wanted
    with pytest.raises(ValueError, match=r"layers \[4\] are outside the target's 4"):
        draft_taps("1,4", 4)
    with pytest.raises(Exception, match="no-such-draft"):
        draft_taps("no-such-draft", 4)
