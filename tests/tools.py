"""Test helpers: Debian tools some tests drive (prometheus, promtool, docker-compose), free ports,
and metadata-only GGUF files.

A missing tool is a clear skip, with the package to install.

In CI (CI=true) a missing tool fails the test instead: .ci/run installs them, so a skip there
would hide a broken install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import gguf
import numpy as np
import pytest

from splitspec.transport.ports import free_port  # noqa: F401 - the tests import it from here


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: install the Debian package `{package}` (apt-get install -y {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run should have installed it")
        pytest.skip(message)
    return path


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
