"""Test helpers: Debian tools some tests drive (prometheus, promtool, docker-compose), free ports,
and metadata-only GGUF files.

A missing tool is a clear skip, with the package to install.

In CI (CI=true) a missing tool fails the test instead: .ci/run installs them, so a skip there
would hide a broken install.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable

import gguf
import numpy as np
import pytest


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: install the Debian package `{package}` (apt-get install -y {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run should have installed it")
        pytest.skip(message)
    return path


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on the loopback interface right now, and not one this process handed out
    before: a port closed again is free to the kernel, which may hand it out twice (two services
    of one test, given the same port, would clash)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def write_gguf(path, add_metadata: Callable[[gguf.GGUFWriter], None], arch: str = "qwen3") -> str:
    """A GGUF file holding the metadata ``add_metadata`` writes and one dummy tensor."""
    writer = gguf.GGUFWriter(path, arch)
    add_metadata(writer)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
