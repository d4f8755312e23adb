"""Step timeline of the three services, for performance work (not loaded in normal runs).

Put this folder first on PYTHONPATH and set SPLITSPEC_TRACE_DIR: every Python process started
with that environment (bench's gateway, target and draft) imports this module at start-up, times
the points of a step below with the system-wide monotonic clock, and writes
``<command>-<pid>.log`` into the folder at exit. ``analyze.py DIR`` lines the processes up.

    SPLITSPEC_TRACE_DIR=/tmp/trace PYTHONPATH=scripts/step_timeline:$PYTHONPATH \\
        splitspec bench --shape qwen3-8b --parts system --corruptions 0.05 --prompts 3
    python3 scripts/step_timeline/analyze.py /tmp/trace

Records (times in ns): ``rpc NAME t0 t1`` a gateway step call; ``tree t0 t1`` a DDTree build;
``push t0 t1`` detokenising; ``step t0 t1`` a worker answering one step request; ``host WHAT
t0 t1`` the servicer's call into its engine (thread hand-offs and the wait for its batched pass
included); ``engine WHAT t0 t1`` the engine's batched method itself (one record a pass; a staged pass from its
launch to its settle); ``prefill WHAT t0 t1``
the engine's prefill; ``part WHAT t0 t1`` a part of a draft's pass (graph-launch, to-host; the shaped
oracle's draft-pass and oracle); ``context ROWS t0 t1`` a draft's append of new feature rows (ROWS in all)
outside its graphs; ``lag loop t0 t1`` the event loop went more than 4 ms without polling its sockets
(something held it: a long callback, the GIL).
"""

import atexit
import functools
import inspect
import os
import sys
import time

if os.environ.get("SPLITSPEC_TRACE_DIR"):
    _records: list[tuple] = []
    _now = time.perf_counter_ns

    def _timed(label: tuple, fn):
        """``fn`` (a function or a coroutine function) recording ``(*label, start, end)`` per call."""
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_coroutine(*args, **kwargs):
                t0 = _now()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _records.append((*label, t0, _now()))

            return timed_coroutine

        async def awaited(result, t0: int):
            try:
                return await result
            finally:
                _records.append((*label, t0, _now()))

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = _now()
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                _records.append((*label, t0, _now()))
                raise
            if inspect.isawaitable(result):  # a plain function returning a coroutine: time its await too
                return awaited(result, t0)
            _records.append((*label, t0, _now()))
            return result

        return timed

    import services.gateway.workers as workers
    import services.worker.batching as batching
    import services.worker.hosting as hosting
    import splitspec.spec.tree as tree
    import splitspec.text.textstream as textstream
    import splitspec.transport.busypoll as busypoll
    import splitspec.transport.rpc as rpc

    _attach = hosting.EngineHost.attach

    def _attach_timed(self, engine, description):
        if hasattr(engine, "launch_pass"):  # a staged pass (the target's): its launch to its settle
            _stage_timed(self.what, engine)
        elif hasattr(engine, "propose_batch"):  # one record a pass, shared by its steps
            engine.propose_batch = _timed(("engine", self.what), engine.propose_batch)
        if hasattr(engine, "prefill"):  # prefills run on the same thread, between passes
            engine.prefill = _timed(("prefill", self.what), engine.prefill)
        drafter = getattr(engine, "engine", engine)  # the shaped oracle's DraftEngine is its .engine
        if hasattr(drafter, "_context_kv"):  # the draft's eager appends (a prompt's rows, or graphs off)
            drafter._context_kv = _context_timed(drafter._context_kv)
        if drafter is not engine:  # the shaped oracle's parts: the draft's pass, the oracle's answers
            drafter.propose_batch = _timed(("part", "draft-pass"), drafter.propose_batch)
            engine.oracle.propose_batch = _timed(("part", "oracle"), engine.oracle.propose_batch)
        graphs = getattr(drafter, "graphs", None)
        if graphs is not None:  # a batched graph's launch (its inputs staged, the replay queued)
            graphs.run_batch = _timed(("part", "graph-launch"), graphs.run_batch)
        draft_module = sys.modules.get("services.draft.engine")  # imported by a draft worker only (torch)
        if draft_module is not None and hasattr(drafter, "_context_kv"):
            draft_module._to_host = _timed(("part", "to-host"), draft_module._to_host)
        _attach(self, engine, description)

    def _context_timed(context_kv):
        @functools.wraps(context_kv)
        def timed(admitted):
            t0 = _now()
            try:
                return context_kv(admitted)
            finally:
                _records.append(("context", sum(step.rows for step, _ in admitted), t0, _now()))

        return timed

    def _stage_timed(what, engine):
        launch, settle = engine.launch_pass, engine.settle_pass

        def launch_timed(prepared, *args, **kwargs):
            prepared.timeline_t0 = _now()
            return launch(prepared, *args, **kwargs)

        def settle_timed(prepared):
            try:
                return settle(prepared)
            finally:
                _records.append(("engine", what, getattr(prepared, "timeline_t0", _now()), _now()))

        engine.launch_pass, engine.settle_pass = launch_timed, settle_timed

    hosting.EngineHost.attach = _attach_timed
    _host_step = batching.StepBatcher.submit

    async def _host_step_timed(self, item):
        t0 = _now()
        try:
            return await _host_step(self, item)
        finally:
            _records.append(("host", self.host.what, t0, _now()))

    batching.StepBatcher.submit = _host_step_timed
    _sequence_stream = rpc.sequence_stream

    async def _sequence_stream_timed(requests, context, step, *args, **kwargs):  # the servicers import it after this runs
        async for response in _sequence_stream(requests, context, _timed(("step",), step), *args, **kwargs):
            yield response

    rpc.sequence_stream = _sequence_stream_timed
    import splitspec.transport.stepwire as stepwire  # imported it already, through the gateway's workers module

    stepwire.sequence_stream = _sequence_stream_timed
    tree.build_ddtree = _timed(("tree",), tree.build_ddtree)  # before the gateway imports it by name
    textstream.TextStream.push = _timed(("push",), textstream.TextStream.push)
    _worker_step = workers.WorkerClient._step

    async def _worker_step_timed(self, request, timeout):
        t0 = _now()
        try:
            return await _worker_step(self, request, timeout)
        finally:
            _records.append(("rpc", self.step_rpc, t0, _now()))

    workers.WorkerClient._step = _worker_step_timed

    # Stalls are read off the loop's own polling: from one select's return to the next call the loop
    # ran callbacks (or waited for the GIL). A probe task waking every millisecond would keep a
    # busy-polling loop spinning all the time (every wake starts a spin), a busy core per service.
    _select = busypoll.BusyPollSelector.select
    _returned = [0]

    def _select_timed(self, timeout=None):
        t = _now()
        if _returned[0] and t - _returned[0] > 4_000_000:
            _records.append(("lag", "loop", _returned[0], t))
        try:
            return _select(self, timeout)
        finally:
            _returned[0] = _now()

    busypoll.BusyPollSelector.select = _select_timed

    @atexit.register
    def _dump() -> None:
        folder = os.environ["SPLITSPEC_TRACE_DIR"]
        os.makedirs(folder, exist_ok=True)
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "main")
        with open(os.path.join(folder, f"{command}-{os.getpid()}.log"), "w") as f:
            f.writelines(" ".join(map(str, r)) + "\n" for r in _records)
