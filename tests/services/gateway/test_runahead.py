import asyncio

import pytest

from services.gateway.runahead import RunAhead


class Steps:
    """An async iterator of token lists that records how far it got and whether it was closed."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.n, self.fail_after = n, fail_after
        self.produced = 0
        self.closed = False

    async def __call__(self):
        try:
            for i in range(self.n):
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("step failed")
                await asyncio.sleep(0)
                self.produced += 1
                yield [2 * i, 2 * i + 1]
        finally:
            self.closed = True


async def settle():
    for _ in range(50):
        await asyncio.sleep(0)


def test_every_token_in_order_and_ready_steps_joined():
    async def main():
        source = Steps(5)
        reads = []
        async with RunAhead(source(), depth=8) as steps:
            await settle()  # every step finishes before the first read
            async for tokens in steps:
                reads.append(tokens)
        return reads

    assert asyncio.run(main()) == [list(range(10))]


def test_runs_at_most_depth_steps_ahead_of_the_reader():
    async def main():
        source = Steps(10)
        async with RunAhead(source(), depth=3) as steps:
            first = await steps.__anext__()
            await settle()
            ahead = source.produced
            rest = [t async for tokens in steps for t in tokens]
        return first, ahead, rest

    first, ahead, rest = asyncio.run(main())
    assert first == [0, 1]
    assert ahead == 1 + 3 + 1  # the step read, `depth` waiting, one more waiting for room
    assert first + rest == list(range(20))


def test_an_error_comes_after_the_tokens_before_it():
    async def main():
        source = Steps(5, fail_after=2)
        got = []
        async with RunAhead(source(), depth=8) as steps:
            await settle()
            with pytest.raises(RuntimeError, match="step failed"):
                async for tokens in steps:
                    got += tokens
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_leaving_early_stops_the_steps_before_returning():
    async def main():
        source = Steps(1000)
        async with RunAhead(source(), depth=2) as steps:
            async for tokens in steps:
                break
        return source

    source = asyncio.run(main())
    assert source.closed and source.produced < 10
