"""``splitspec draft``: load a DFlash or DFlash2 draft (plus the target's embedding and LM head) and serve it."""

from __future__ import annotations

import argparse
import logging
import time

from splitspec.models import keep_quantized
from splitspec.spec.tree import DEFAULT_TOP_K
from splitspec.transport import busypoll, rpc
from splitspec.transport.received import TensorFieldReader
from splitspec.transport.security import ServerSecurity, add_server_arguments
from splitspec.transport.stepwire import add_step_socket_argument, step_server_from_args

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The draft worker's flags; ``model=False`` leaves out ``--model`` for an engine that is not a
    DFlash checkpoint (the benchmark's OracleDrafter)."""
    if model:
        p.add_argument("--model", required=True, help="DFlash draft: a z-lab directory (config.json + model.safetensors), its GGUF conversion, or hf://...; or a DFlash2 directory (DFlash2DraftModel)")
    p.add_argument("--target-model", required=True, help="the target model (GGUF, directory or hf://...): its embedding and LM head are read from it")
    p.add_argument("--listen", default="127.0.0.1:50053", help="address to serve on (host:port or unix:PATH)")
    p.add_argument("--device", default="cpu", help="cpu, cuda:N or auto (cuda:0 when torch sees a GPU, else cpu)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16")
    keep_quantized.add_argument(
        p, "a GGUF target's token embedding and LM head, and a GGUF draft's linear weights, stay in their GGUF blocks "
        "(types with a matmul kernel for the linears and head, any block type for the embedding, whose lookup "
        "dequantizes only the rows it reads) instead of being dequantized to --dtype; other weights dequantize as usual",
    )
    p.add_argument("--max-sequences", type=int, default=256, help="live draft contexts at most")
    p.add_argument(
        "--graph-sequences", type=int, default=-1,
        help="context slots of --graph-context positions, preallocated on first use: a sequence in a slot "
        "proposes by one CUDA graph replay, and sequences in slots that step together by one batched replay "
        "(their number padded to a power of two up to 8, then a multiple of 4, then of 16); graphs serve every later sequence (on a CPU the same fixed "
        "shapes run eagerly); a sequence that finds every slot taken, or outgrows its slot, runs eagerly until a slot frees "
        "and it fits (splitspec_worker_graph_slots_used); -1 = 32 on CUDA (about 84 MB a slot for an 8B target's draft at 4096 positions), 0 on CPU",
    )
    p.add_argument("--graph-context", type=int, default=4096, help="context positions of each slot (--graph-sequences)")
    p.add_argument(
        "--warm-up-top-k", type=int, default=-1,
        help="before serving, capture the batched CUDA graphs of 2 to --graph-sequences sequences at key spans 256, 512 and "
        "1024, appending and not, for steps asking this top-K (the gateway's --top-k), so that no step waits "
        "for their capture (0.1-0.4 s each, seconds while Triton compiles); 0 = capture each at its first use; "
        f"-1 = {DEFAULT_TOP_K}, the gateway's default --top-k (only where graphs are captured: on CUDA)",
    )
    p.add_argument(
        "--memory-cap-gb", type=float, default=0.0,
        help="device memory this worker may use, GiB (0 = no cap). On CUDA torch's allocator is held to it from before "
        "the weights load; on a CPU it is the budget of the memory plan only. The plan (weights with the target's "
        "embedding and LM head, context slots, workspace; logged at start) must fit the cap less 1/24 of it (at most "
        "1 GiB): a configuration that does not is refused, naming what to lower",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the fixed shapes without capturing graphs (debugging)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default while loading, then 1 with a GPU --device)")
    p.add_argument("--sequence-ttl", type=float, default=600.0, help="release contexts idle this many seconds")
    p.add_argument("--metrics-port", type=int, default=9453, help="Prometheus /metrics port on the --listen host (0 = off)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight calls may finish after SIGTERM")
    add_step_socket_argument(p)
    busypoll.add_busy_poll_argument(p)
    add_server_arguments(p)


def load_engine(args: argparse.Namespace):
    """The engine of the draft named by the flags; returns (engine, target config, dtype name, device name)."""
    from splitspec.models.devices import resolve_device, resolve_dtype
    from splitspec.models.loader import check_draft_fits, load_dflash_draft, load_target_head, read_target_config
    from splitspec.models.quantized import head_summary, kept_summary

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    target_config = read_target_config(args.target_model)
    keep = keep_decision(args, device, dtype)
    logger.info("draft weights with the target's embedding and LM head: %s", keep.reason)
    model, config = load_dflash_draft(args.model, device, dtype, num_target_layers=target_config.num_layers, keep_quantized=keep.keep)
    check_draft_fits(config, target_config, str(args.model), str(args.target_model))
    embed, head, target_config = load_target_head(args.target_model, device, dtype, keep_quantized=keep.keep)
    logger.info(
        "loaded draft %s: %d layers, block %d, taps %s, on %s in %.1f s",
        args.model, config.num_layers, config.block_size, list(config.target_layer_ids), device, time.perf_counter() - t0,
    )
    if keep.keep:
        logger.info("keep-quantized draft: %s; the target's %s", kept_summary(model), head_summary(embed, head))
    return draft_engine(args, model, embed, head, device), target_config, str(dtype).removeprefix("torch."), str(device)


def keep_decision(args: argparse.Namespace, device, dtype) -> keep_quantized.KeepDecision:
    """``--keep-quantized`` for what the draft worker loads: a GGUF draft's weights and a GGUF
    target's embedding and LM head (the tensors the draft borrows)."""
    from services.worker.memory_plan import cap_bytes
    from splitspec.models.hub import resolve_model

    parts = [keep_quantized.dequantized_bytes(resolve_model(args.model), dtype),
             keep_quantized.dequantized_bytes(resolve_model(args.target_model), dtype, ("token_embd.weight", "output.weight"))]
    known = [b for b in parts if b is not None]
    dequantized = sum(known) if known else None
    return keep_quantized.decide(args.keep_quantized, dequantized, keep_quantized.available_bytes(device, cap_bytes(args.memory_cap_gb)), dtype)


def draft_engine(args: argparse.Namespace, model, embed, head, device):
    """The DraftEngine serving ``model`` with the target's ``embed`` and LM ``head``, with the fast
    path's context slots that ``--graph-sequences`` asks for."""
    from services.draft.engine import DraftEngine
    from services.draft.graphs import BlockGraphs

    graphs = None
    sequences = args.graph_sequences if args.graph_sequences >= 0 else (32 if device.type == "cuda" else 0)
    if sequences:
        capture = device.type == "cuda" and not args.no_cuda_graphs
        graphs = BlockGraphs(model, embed, head, args.graph_context, sequences, capture)
        logger.info("fast path: %d sequences of %d context positions, %s", sequences, args.graph_context, "CUDA graphs" if capture else "fixed shapes run eagerly")
    return DraftEngine(model, embed, head, max_sequences=args.max_sequences, graphs=graphs)


async def run(args: argparse.Namespace, build=load_engine) -> None:
    """Serve the draft worker; ``build(args)`` makes its engine once the socket listens (the
    benchmark passes its own: splitspec/bench/workers.py)."""
    import torch

    from services.draft.server import SERVICE, DraftServicer
    from services.metrics import WorkerMetrics, model_name
    from services.worker import memory_plan
    from services.worker.hosting import model_geometry, serve_worker, settle_threads
    from splitspec.models.devices import backend_name, resolve_device
    from splitspec.v1 import draft_pb2, draft_pb2_grpc

    if args.threads:
        torch.set_num_threads(args.threads)
    busypoll.configure(args.busy_poll, resolve_device(args.device).type == "cuda", "draft")
    cap = memory_plan.cap_bytes(args.memory_cap_gb)
    metrics = WorkerMetrics("draft", model_name(args.target_model))
    metrics.serve(args.metrics_port, args.listen)
    servicer = DraftServicer(metrics)
    server, health = rpc.create_server(
        "draft", [lambda s: draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, s)], [SERVICE],
        args.listen, ServerSecurity.from_args(args),
    )

    def load() -> None:
        t0 = time.perf_counter()
        memory_plan.apply_cap(resolve_device(args.device), cap)
        try:
            engine, target_config, dtype, device = build(args)
        except torch.OutOfMemoryError as exc:
            if cap is None:
                raise
            raise memory_plan.out_of_memory("draft", cap, exc) from exc
        if getattr(engine, "model", None) is not None:  # not the benchmark's OracleDrafter, which holds no model
            graphs = engine.graphs
            plan = memory_plan.draft_plan(
                engine.model, engine.embed, engine.lm_head, graphs.sequences if graphs else 0,
                graphs.context if graphs else args.graph_context, engine.max_sequences, cap,
            )
            logger.info("%s", plan.describe())
            plan.check()  # before the context slots' pool, which the first sequence allocates
            top_k = args.warm_up_top_k if args.warm_up_top_k >= 0 else DEFAULT_TOP_K
            if graphs is not None and graphs.capture and top_k > 0:
                torch.cuda.empty_cache()  # as each capture does: what is reserved afterwards is the slots' and the graphs'
                t1, held = time.perf_counter(), torch.cuda.memory_reserved(graphs.device)
                passes = graphs.warm_up(top_k)
                logger.info(
                    "warmed up %d batched block graphs (top-%d) in %.1f s, %.0f MiB more device memory reserved (the context slots with it)",
                    passes, top_k, time.perf_counter() - t1, (torch.cuda.memory_reserved(graphs.device) - held) / 2**20,
                )
        settle_threads(args.threads, resolve_device(device).type, "draft")  # on the engine thread, where passes run
        geometry = model_geometry(target_config, dtype, device, str(args.target_model))
        servicer.host.attach(engine, (geometry, str(args.model)))
        metrics.describe(device=device, backend=backend_name(torch.device(device)), dtype=dtype, draft=model_name(args.model))
        metrics.loaded(time.perf_counter() - t0)
        metrics.watch(live_sequences=lambda: len(engine.sequences))
        if hasattr(engine, "max_sequences"):
            metrics.watch(max_sequences=lambda: engine.max_sequences)
        if getattr(engine, "graphs", None) is not None:
            metrics.watch(
                graph_slots_used=lambda: engine.graphs.seated, graph_slots_capacity=lambda: engine.graphs.sequences,
                graph_capture_failures=lambda: len(engine.graphs.uncaptured),
            )
        logger.info("draft worker serving on %s", args.listen)

    logger.info("draft worker listening on %s, loading %s", args.listen, args.model)
    step_server = step_server_from_args(
        args, "draft", f"/{SERVICE}/Propose", TensorFieldReader(draft_pb2.ProposeRequest, "features"), servicer.propose_on_socket,
    )
    servicer.step_server = step_server
    await serve_worker("draft", server, health, SERVICE, servicer.host, load, args.shutdown_grace, args.sequence_ttl, step_server)
