"""The layout is the architecture (README, Layout): a module's path in the checkout is its import
path, the same as in an installed wheel; the layers import downwards only; no import circles.

The wheel is built from this checkout as ``pip install .`` builds it; every module is then
imported twice in fresh interpreters, once with the checkout first on the path and once from the
unpacked wheel alone, and must come from the same relative file both times.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("splitspec", "services", "native")


def checkout_modules() -> dict[str, Path]:
    """Module name -> file, for every Python file of the three packages (generated protos included)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return modules


def imports_of(path: Path) -> set[str]:
    """Absolute imports of project modules in ``path``, wherever they sit (function-level and
    ``TYPE_CHECKING`` ones too: a layer that needs another's names depends on it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_files(modules: list[str], path: list[str], cwd: Path) -> dict[str, str]:
    """Import each module in a fresh interpreter whose path starts with ``path``; name -> __file__."""
    script = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = {path!r}\n"
        f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {modules!r}}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """The wheel of the checkout's files (tracked, and new ones not ignored), built in a copy (no stale build/)."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = out.glob("splitspec-*.whl")
    unpacked = out / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    return unpacked


@pytest.mark.slow
def test_every_module_imports_from_the_checkout_as_it_does_installed(wheel_dir, tmp_path):
    checkout = checkout_modules()
    installed = {
        ".".join(p.relative_to(wheel_dir).with_suffix("").parts).removesuffix(".__init__")
        for package in PACKAGES for p in (wheel_dir / package).rglob("*.py")
    }
    assert installed == set(checkout), f"only in the wheel: {sorted(installed - set(checkout))}; only in the checkout: {sorted(set(checkout) - installed)}"
    names = sorted(n for n in checkout if not n.endswith("__main__"))
    from_checkout = import_files(names, [str(ROOT)], ROOT)
    from_wheel = import_files(names, [str(wheel_dir)], tmp_path)
    for name in names:
        assert Path(from_checkout[name]) == checkout[name], name
        assert Path(from_wheel[name]).relative_to(wheel_dir) == checkout[name].relative_to(ROOT), name


def test_the_wheel_ships_the_cuda_sources(wheel_dir):
    # native.gguf_mma builds its extension at first use on a GPU from the installed package's files:
    # each source it lists and each header they include must be in the wheel.
    from native import gguf_mma

    needed = {path.name for path in gguf_mma.SOURCES}
    needed |= {name for path in gguf_mma.SOURCES for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert "gguf_mma.cuh" in needed
    missing = sorted(name for name in needed if not (wheel_dir / "native" / name).is_file())
    assert not missing, f"not in the wheel: {missing}"


def _depends(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_layers_import_downwards_only():
    """native knows nothing of the project; the shared library (splitspec) knows no service except
    in the command line and the benchmark, which start services; the transport knows no model; the
    services know each other only through protos; the gateway runs without torch."""
    rules = [  # (modules, may not import, why)
        ("native", ("splitspec", "services"), "kernels know no models or services"),
        ("splitspec", ("services",), "the shared library knows no service (only cli/ and bench/ start them)"),
        ("splitspec.transport", ("splitspec.models", "splitspec.text", "splitspec.spec", "native"), "transport knows no model"),
        ("splitspec.text", ("splitspec.transport", "native", "splitspec.spec"), "text handling is model-format only"),
        ("splitspec.spec", ("splitspec.models", "splitspec.transport", "native"), "the algorithms are pure functions"),
        ("services.gateway", ("services.target", "services.draft", "services.worker", "native", "torch"), "the gateway talks to workers only through protos"),
        ("services.target", ("services.draft", "services.gateway"), "workers know nothing of each other"),
        ("services.draft", ("services.target", "services.gateway"), "workers know nothing of each other"),
    ]
    exempt = ("splitspec.cli", "splitspec.bench")
    problems = []
    for name, path in checkout_modules().items():
        for scope, forbidden, why in rules:
            if not _depends(name, scope) or (scope == "splitspec" and name.startswith(exempt)):
                continue
            for imported in imports_of(path) | ({"torch"} if "import torch" in path.read_text() else set()):
                if any(_depends(imported, f) for f in forbidden):
                    problems.append(f"{name} imports {imported}: {why}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_import_circles():
    modules = checkout_modules()
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    # A package's own __init__ importing a child is not a circle of modules; drop parent -> child edges.
    graph = {name: {m for m in deps if not m.startswith(name + ".")} for name, deps in graph.items()}
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_gateway_runs_without_torch():
    script = "import sys, services.gateway.main, services.gateway.server; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
