import subprocess
import sys

import pytest

from splitspec.transport import allocator

# Serialise a tap-feature message of ROWS rows (40 KiB each, an 8B target's 5 taps in bf16) 20
# times; print whether the thresholds were set and the page faults the loop took.
CHURN = """
import resource, sys
from splitspec.transport.allocator import keep_message_buffers
from splitspec.v1 import common_pb2
applied = keep_message_buffers() if sys.argv[1] == "tuned" else False
rows = int(sys.argv[2])
message = common_pb2.Tensor(dtype="bfloat16", shape=[rows, 20480], data=bytes(rows * 40960))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    message.SerializeToString()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(mode: str, rows: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode, str(rows)], capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="not applicable: glibc only")
def test_freed_message_buffers_stay_mapped():
    applied, tuned = churn("tuned", 6)  # a decode step's features, 245 KB
    _, default = churn("default", 6)
    assert applied
    assert default > 20 * 30  # each serialisation faults the buffer's 60 pages in again
    assert tuned < 400  # the first serialisation's pages, then none


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="not applicable: glibc only")
def test_a_prompts_features_stay_mapped_too():
    """21 MB, a 512-token prompt: under the mmap threshold, so the heap keeps its pages after the
    first copies (a threshold under the message's size maps 5120 fresh pages every time)."""
    _, tuned = churn("tuned", 512)
    _, default = churn("default", 512)
    assert default > 20 * 4000
    assert tuned < 3 * 5120


def test_glibc_environment_variables_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert allocator.keep_message_buffers() is False
