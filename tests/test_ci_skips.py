"""Under ``CI=true`` a skipped test fails (tests/conftest.py), unless its reason says the case is
``not applicable:`` by construction: a missing dependency must break CI, not hide in a skip count."""

import subprocess
import sys
from pathlib import Path

import pytest

CASES = '''
import pytest
pytest.importorskip("splitspec_no_such_module")
def test_never_runs(): pass
'''
RUNTIME = '''
import pytest
def test_missing_dependency(): pytest.skip("pip install something")
def test_by_construction(): pytest.skip("not applicable: a case that cannot hold")
'''


@pytest.mark.parametrize("ci", ["true", ""])
def test_skips_fail_only_in_ci(tmp_path, ci):
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_module_skip.py").write_text(CASES)
    (tmp_path / "test_runtime_skip.py").write_text(RUNTIME)
    env = {"PATH": "/usr/bin:/bin", "CI": ci}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    last = done.stdout.strip().splitlines()[-1]
    if ci:  # the module-level skip becomes a collection error, the runtime one a failure
        assert "1 failed, 1 skipped, 1 error" in last and done.returncode != 0, done.stdout[-2000:]
        assert "skipped under CI=true" in done.stdout and "splitspec_no_such_module" in done.stdout
    else:
        assert "3 skipped" in last and done.returncode == 0, done.stdout[-2000:]
