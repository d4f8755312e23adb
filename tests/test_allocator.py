import subprocess
import sys

import pytest

from splitspec import allocator

# Serialise a step's worth of tap features (245 KB) 200 times; print the page faults it took.
CHURN = """
import resource, sys
from splitspec.allocator import keep_message_buffers
from splitspec.v1 import common_pb2
applied = keep_message_buffers() if sys.argv[1] == "tuned" else False
message = common_pb2.Tensor(dtype="bfloat16", shape=[6, 20480], data=bytes(245760))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    message.SerializeToString()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(mode: str, env: dict | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True, env=env).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_message_buffers_stay_mapped():
    applied, tuned = churn("tuned")
    _, default = churn("default")
    assert applied
    assert default > 200 * 30  # each serialisation faults the buffer's 60 pages in again
    assert tuned < 1000


def test_glibc_environment_variables_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert allocator.keep_message_buffers() is False
