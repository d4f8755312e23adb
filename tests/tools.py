"""Debian tools some tests drive (prometheus, promtool, docker-compose): found, or a clear skip.

In CI (CI=true) a missing tool fails the test instead: .ci/run installs them, so a skip there
would hide a broken install.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: install the Debian package `{package}` (apt-get install -y {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run should have installed it")
        pytest.skip(message)
    return path
