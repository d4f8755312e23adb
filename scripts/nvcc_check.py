"""Compile the CUDA sources of ``native/`` on a machine without a GPU, and print each kernel's
registers, spills and shared memory (``ptxas -v``): a check of a kernel change before any device
time is spent on it. It needs ``nvcc`` (a CUDA toolkit's compiler; no driver, no GPU) and a torch
whose wheel ships its CUDA headers (CPU wheels do).

A CPU wheel of torch lacks the CUDA libraries' headers that ``ATen/cuda/CUDAContext.h`` includes
(cuBLAS, cuSPARSE, cuSOLVER) and one header generated at torch's build; this script writes stand-ins
that declare only the handle and status types those headers name, into a temporary folder. The
object files are thrown away: this checks that the sources compile and how the kernels use
registers, nothing more. Flags as ``native.gguf_mma``'s build passes them (``-O3``; ``-D`` switches
with ``--define``).

Usage: python3 scripts/nvcc_check.py [--arch sm_90] [--sources gguf_q4k.cu,...] [--define MMA_PDL=0]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What ATen/cuda's headers include from the CUDA libraries and torch's build, and the types they name.
STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\ntypedef int cusolverStatus_t;",
    "cusolver_common.h": "",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def write_stubs(folder: Path) -> None:
    for name, body in STUBS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#pragma once\n{body}\n")


def torch_include() -> Path:
    import torch.utils.cpp_extension as ext

    return Path(ext.include_paths()[0])


def kernel_usage(ptxas: str) -> list[str]:
    """One line a kernel from ``ptxas -v``'s report: its demangled-enough name, registers, spills, shared memory."""
    lines, name, spills = [], None, ""
    for line in ptxas.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name, spills = m[1], ""
        elif (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) and name:
            spills = f"spills {m[1]}/{m[2]} B"
        elif (m := re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)) and name:  # no smem: not printed
            lines.append(f"{m[1]:>4} registers  {spills:<20} smem {m[2] or 0:>6} B  {short(name)}")
            name = None
    return lines


def short(mangled: str) -> str:
    """The kernel's name as ``c++filt`` gives it, when that tool is here."""
    if shutil.which("c++filt") is None:
        return mangled
    return subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()[:140]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", help="GPU architecture to compile for (default: sm_90, H100/H200)")
    p.add_argument("--sources", default="gguf_mma.cu,gguf_q4k.cu,gguf_q6k.cu", help="files of native/ to compile")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE", help="a -D switch (repeatable)")
    args = p.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: install a CUDA toolkit's compiler (no GPU needed)", file=sys.stderr)
        return 2
    include = torch_include()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "stubs"
        write_stubs(stubs)
        for source in args.sources.split(","):
            cmd = [
                nvcc, "-std=c++17", f"-arch={args.arch}", "-O3", "-Xptxas", "-v", "--expt-relaxed-constexpr",
                "-c", str(ROOT / "native" / source), "-o", str(Path(tmp) / "out.o"),
                f"-I{stubs}", f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", f"-I{sysconfig.get_paths()['include']}",
                "-DTORCH_EXTENSION_NAME=nvcc_check", *(f"-D{d}" for d in args.define),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            print(f"== {source}: {'compiled' if proc.returncode == 0 else f'FAILED (nvcc exit {proc.returncode})'}")
            if proc.returncode:
                failed += 1
                print("\n".join(line for line in proc.stderr.splitlines() if "error" in line)[:4000])
                continue
            print("\n".join(kernel_usage(proc.stderr)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
