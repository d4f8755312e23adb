"""What the target's captured passes are made of as CUDA graphs, and what launching them costs.

The 27B AR step's ``CUDAGraph.replay`` held the host 0.5-1.1 ms for its 1,282 kernels and the GPU
waited 0.2-0.4 ms of it before the graph's first kernel (BENCHMARKS.md [P15]), where graphs of
trivial kernels launched in 4-10 µs whatever their size (``gpu_graph_launch.py``). This script
captures the engine's AR and verify passes (random weights of ``--shape``, benchmark-only) with
their ``cudaGraph_t`` kept, and prints for each:

- its nodes by type and its edges by type: default, or programmatic (a dependent launch:
  ``native/gguf_mma.cu`` launches each matmul so that it may start while the kernel before ends);
  the nodes with more than one edge in or out (a graph captured on one stream has none);
- the host time of a launch (``--reps``, median, the device idle before each) and of launch + run:
  torch's ``replay``; the same executable graph by ``cuGraphLaunch``; and the graph rebuilt with
  every programmatic edge made a default one (the same kernels, which then wait for the whole
  kernel before them);
- the same replays inside ``--reps`` of the engine's own steps: the host time of each replay, and
  the step's wall time (upload, walk and commit included);
- for comparison, graphs of as many trivial torch kernels and trivial Triton kernels.

On an H200 a launch held the host 6-66 µs (15-51 µs inside the engine's steps): the [P15] figure
was the profiled process's (BENCHMARKS.md [G1]).

Usage: python3 scripts/gpu_graph_nodes.py [--shape random:qwen35-27b-q4km] [--budget 22] [--reps 30]   (GPU only)
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time

import numpy as np
import torch
import triton
import triton.language as tl
from gpu_graph_launch import timed as launch_times  # this folder is on the path of a script run from it

import services.worker.cuda_graphs as cuda_graphs
from services.target.engine import TargetEngine, TargetLimits
from splitspec.bench.components import random_tree
from splitspec.bench.random_weights import random_target
from splitspec.spec.sampling import SamplingParams

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait", 7: "event record",
              10: "mem alloc", 11: "mem free", 12: "batch mem op", 13: "conditional"}
EDGE_TYPES = {0: "default", 1: "programmatic"}

_cuda = ctypes.CDLL("libcuda.so.1")


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


def check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def nodes_of(graph: int) -> list[int]:
    n = ctypes.c_size_t(0)
    check(_cuda.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    check(_cuda.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n)), "cuGraphGetNodes")
    return list(nodes)


def edges_of(graph: int):
    """``(from, to, EdgeData)`` arrays of every edge."""
    n = ctypes.c_size_t(0)
    check(_cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges_v2")
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (EdgeData * n.value)()
    check(_cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "cuGraphGetEdges_v2")
    return src, dst, data


def describe(graph: int) -> None:
    types = collections.Counter()
    for node in nodes_of(graph):
        t = ctypes.c_int(0)
        check(_cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        types[NODE_TYPES.get(t.value, str(t.value))] += 1
    src, dst, data = edges_of(graph)
    kinds = collections.Counter(f"{EDGE_TYPES.get(d.type, d.type)} (port {d.from_port})" for d in data)
    out_degree, in_degree = collections.Counter(src), collections.Counter(dst)
    print(f"  nodes: {dict(types)}; edges: {dict(kinds)}; nodes with >1 edge out: {sum(v > 1 for v in out_degree.values())}, "
          f"in: {sum(v > 1 for v in in_degree.values())}")


def defaulted(graph: int) -> int:
    """An executable graph of ``graph`` (changed in place) with its programmatic edges made default."""
    src, dst, data = edges_of(graph)
    picked = [i for i, d in enumerate(data) if d.type != 0]
    if picked:
        n = len(picked)
        f, t = (ctypes.c_void_p * n)(*[src[i] for i in picked]), (ctypes.c_void_p * n)(*[dst[i] for i in picked])
        d = (EdgeData * n)(*[data[i] for i in picked])
        check(_cuda.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), f, t, d, ctypes.c_size_t(n)), "cuGraphRemoveDependencies_v2")
        check(_cuda.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), f, t, None, ctypes.c_size_t(n)), "cuGraphAddDependencies_v2")
    exe = ctypes.c_void_p()
    check(_cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)), "cuGraphInstantiateWithFlags")
    return exe.value


def launcher(exe: int):
    stream = torch.cuda.current_stream().cuda_stream
    return lambda: check(_cuda.cuGraphLaunch(ctypes.c_void_p(exe), ctypes.c_void_p(stream)), "cuGraphLaunch")


def timed(launch, reps: int) -> str:
    for _ in range(3):
        launch()
    host, wall = launch_times(launch, reps)
    return f"launch holds the host {host:7.1f} us; launch + run {wall / 1e3:7.3f} ms"


class KeptGraph(torch.cuda.CUDAGraph):
    """A graph whose cudaGraph_t outlives its instantiation (this script reads and edits it)."""

    def __new__(cls, keep_graph: bool = True):
        return super().__new__(cls, keep_graph=True)

    def __init__(self, keep_graph: bool = True) -> None:  # the binding's constructor takes the call's arguments
        super().__init__(keep_graph=True)


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 1.0001, mask=mask)


def trivial_graph(kernels: int, triton_kernels: bool) -> torch.cuda.CUDAGraph:
    x = torch.zeros(1 << 12, device="cuda")

    def body():
        for _ in range(kernels):
            if triton_kernels:
                _bump[(4,)](x, x.numel(), BLOCK=1024)
            else:
                x.mul_(1.0001)

    body()
    graph, _ = cuda_graphs.capture(lambda: body(), x.device)
    graph.keep_alive = x  # the graph reads it
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="random:qwen35-27b-q4km")
    parser.add_argument("--budget", type=int, default=22)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    cuda_graphs.torch.cuda.CUDAGraph = KeptGraph  # the engine's captures keep their cudaGraph_t
    model, config = random_target(args.shape, device, torch.bfloat16)
    rng = np.random.default_rng(0)
    engine = TargetEngine(model, TargetLimits(max_sequences=1, max_tree_nodes=args.budget, max_kv_tokens=args.prompt + 1024),
                          fixed_shapes=True, capture=True, hot_passes=1, hot_padding=0)
    engine.prefill("p", rng.integers(0, config.vocab_size, args.prompt).tolist(), SamplingParams(), reserve_tokens=args.prompt + 960)
    tokens, parents = random_tree(rng, config.vocab_size, args.budget)
    engine.verify("p", [], [])
    engine.verify("p", tokens, parents)
    torch.cuda.synchronize()
    kernels = 0
    for key, p in engine.runner._passes.items():
        if p.graph is None or key[5]:
            continue
        graph = p.graph
        print(f"== the {args.shape} pass of {key[0]} rows ({key[2]} a sequence), {key[3]} keys")
        describe(graph.raw_cuda_graph())
        kernels = max(kernels, len(nodes_of(graph.raw_cuda_graph())))
        print(f"  torch's replay:              {timed(graph.replay, args.reps)}")
        print(f"  cuGraphLaunch of that exec:  {timed(launcher(graph.raw_cuda_graph_exec()), args.reps)}")
        print(f"  programmatic edges default:  {timed(launcher(defaulted(graph.raw_cuda_graph())), args.reps)}")
    # The same replays inside the engine's steps (after their inputs' upload, between walks and commits).
    durations: list[float] = []
    plain_replay = KeptGraph.replay

    def timed_replay(self) -> None:
        t0 = time.perf_counter()
        plain_replay(self)
        durations.append(time.perf_counter() - t0)

    KeptGraph.replay = timed_replay
    for label, step in (("AR step", ([], [])), (f"verify b{args.budget}", (tokens, parents))):
        durations.clear()
        walls = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            engine.verify("p", *step)
            walls.append(time.perf_counter() - t0)
        print(f"== in the engine's {label}: replay holds the host {statistics.median(durations) * 1e6:7.1f} us "
              f"(max {max(durations) * 1e6:.1f}); the step {statistics.median(walls) * 1e3:.3f} ms")
    KeptGraph.replay = plain_replay
    for triton_kernels in (False, True):
        graph = trivial_graph(kernels, triton_kernels)
        print(f"== {kernels} trivial {'Triton' if triton_kernels else 'torch'} kernels")
        describe(graph.raw_cuda_graph())
        print(f"  torch's replay:              {timed(graph.replay, args.reps)}")


if __name__ == "__main__":
    main()
