"""Build hook: generate the protobuf/gRPC modules from protos/ at install time.

protoc writes ``protos/splitspec/v1/*.proto`` to ``splitspec/v1/*_pb2*.py`` so that the proto package
``splitspec.v1`` is also the Python package ``splitspec.v1``. The generated files are gitignored and
never edited by hand. They are written into the source tree before setuptools collects packages,
so regular installs carry them in the wheel and editable installs find them in place.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", "-Iprotos", f"-I{include}", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))
    (ROOT / "splitspec" / "v1" / "__init__.py").write_text('"""Generated from protos/ at install time."""\n')


def packages() -> list[str]:
    """The three import packages at the repository root, each installed under its own name, so that a
    module's path in a checkout is its import path (README, Layout)."""
    return sorted(set(find_packages(include=["splitspec", "splitspec.*", "services", "services.*", "native", "native.*"]) + ["splitspec.v1"]))


generate_protos()
setup(packages=packages())
