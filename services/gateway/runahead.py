"""Let a sequence's speculation steps run ahead of its client.

Writing a response on a gRPC stream completes only when the transport has taken it, and the
text is detokenised first; done in line, both sit between one step's Verify and the next step's
Propose. ``RunAhead`` drives the steps in a task of their own and hands the client whatever
tokens are ready, so the next step's device work overlaps the client write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.gateway.speculation import Committed


class RunAhead:
    """Iterates ``steps`` (lists of new tokens) in its own task, ``depth`` finished steps at most
    waiting for the reader while the next one runs; each read returns every token that is ready,
    in order (with their ``logprobs``, when the steps are ``Committed`` lists that carry them). Use as an async context manager: leaving it cancels the step still running and
    waits for it, so nothing touches the sequence after. The price of a stop string is the steps
    run past it (``depth`` + 1 at most), so the default keeps one: enough to overlap a write."""

    def __init__(self, steps: AsyncIterator[list[int]], depth: int = 1) -> None:
        self._steps = steps
        self._ready: list[list[int]] = []  # steps done and not yet read
        self._end: BaseException | None = None  # StopAsyncIteration, or what the steps raised
        self._changed = asyncio.Event()
        self._room = asyncio.Semaphore(depth)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> RunAhead:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        try:
            async for tokens in self._steps:
                await self._room.acquire()
                self._ready.append(tokens)
                self._changed.set()
            self._end = StopAsyncIteration()
        except Exception as exc:  # the reader raises it after the tokens before it
            self._end = exc
        self._changed.set()

    def __aiter__(self) -> RunAhead:
        return self

    async def __anext__(self) -> list[int]:
        while not self._ready and self._end is None:
            self._changed.clear()
            await self._changed.wait()
        if not self._ready:
            raise self._end
        tokens = [t for step in self._ready for t in step]
        if any(getattr(step, "logprobs", None) is not None for step in self._ready):  # they travel with their tokens
            tokens = Committed(tokens, [lp for step in self._ready for lp in step.logprobs])
        for _ in self._ready:
            self._room.release()
        self._ready.clear()
        return tokens
