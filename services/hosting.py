"""What both workers' servicers share: an engine driven from one thread, attached once loaded."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from splitspec.errors import Unavailable


class EngineHost:
    """Runs an engine's methods on a single thread, so device work is serialised while the event
    loop stays free for health checks and Info. Until ``attach`` every call answers UNAVAILABLE."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.engine: Any = None
        self.description: Any = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{what}-engine")

    def attach(self, engine: Any, description: Any) -> None:
        self.engine, self.description = engine, description

    def require(self) -> Any:
        if self.engine is None:
            raise Unavailable(f"the {self.what} worker is still loading its model")
        return self.engine

    async def call(self, method: str, *args, **kwargs) -> Any:
        """``engine.<method>(*args, **kwargs)`` on the engine thread."""
        fn = partial(getattr(self.require(), method), *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def expire_periodically(self, ttl_s: float) -> None:
        from splitspec.rpc import expire_periodically

        await expire_periodically(self.executor, lambda ttl: self.require().expire_idle(ttl), ttl_s, self.what)
