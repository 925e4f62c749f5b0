"""router/http_streams.merge: several prompts' streams into one, and closing it early."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.router.http_streams import MERGE_BUFFER, merge


async def _numbers(tag: int, n: int, closed: list[int]):
    try:
        for i in range(n):
            yield tag, i
            await asyncio.sleep(0)
    finally:
        closed.append(tag)


def test_every_item_of_every_stream_arrives() -> None:
    async def scenario() -> list:
        closed: list[int] = []
        out = [item async for item in merge([_numbers(t, 5, closed) for t in range(3)])]
        assert sorted(closed) == [0, 1, 2]
        return out

    out = asyncio.run(scenario())
    assert sorted(out) == [(t, i) for t in range(3) for i in range(5)]


@pytest.mark.parametrize("read", [1, 3])
def test_closing_with_a_full_buffer_returns_and_closes_every_stream(read: int) -> None:
    # Issue 24 item 2: pumps cancelled while the buffer was full waited on it again in their
    # `finally`, so closing never returned (the HTTP handler and its connection slot leaked).
    async def scenario() -> list[int]:
        closed: list[int] = []
        merged = merge([_numbers(t, 10 * MERGE_BUFFER, closed) for t in range(4)])
        for _ in range(read):
            await merged.__anext__()
        await asyncio.sleep(0.05)  # the pumps fill the buffer and wait on it
        async with asyncio.timeout(10):  # a hang fails the test instead of stalling the suite
            await merged.aclose()
        return closed

    assert sorted(asyncio.run(scenario())) == [0, 1, 2, 3]


def test_the_first_error_is_raised_and_the_other_streams_are_closed() -> None:
    async def failing():
        yield "x"
        raise ValueError("boom")

    async def scenario() -> list[int]:
        closed: list[int] = []
        with pytest.raises(ValueError, match="boom"):
            async with asyncio.timeout(10):
                async for _ in merge([failing(), _numbers(1, 10 * MERGE_BUFFER, closed)]):
                    await asyncio.sleep(0.001)
        return closed

    assert asyncio.run(scenario()) == [1]
