"""Test helpers: Debian tools some tests drive (prometheus, promtool, docker-compose), free ports.

A missing tool is a clear skip, with the package to install.

In CI (CI=true) a missing tool fails the test instead: .ci/run installs them, so a skip there
would hide a broken install.
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: install the Debian package `{package}` (apt-get install -y {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run should have installed it")
        pytest.skip(message)
    return path


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
