"""Async helpers of the HTTP front: merge several request streams, stop when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncGenerator, Awaitable, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")
_END = object()
# Items merge() holds for its consumer: past it the pumps wait, so a consumer that stops
# leaves the backlog in each stream's own bounded buffer (router/worker_link.py), which
# cancels that stream past its bound.
MERGE_BUFFER = 64


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the response was ready."""


async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Items of every stream as they come; the first exception from any stream is raised
    (the others are closed). Closing the merged stream closes every stream. One stream is
    iterated in place (no task, no queue: the common case costs nothing extra); several hold
    at most ``MERGE_BUFFER`` items between them."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue(MERGE_BUFFER)

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((item, None))
            end: tuple = (_END, None)
        except asyncio.CancelledError:
            raise  # the consumer is closing: nobody reads an end marker, never wait on it
        except Exception as exc:  # noqa: BLE001 — relayed to the consumer, which raises it
            end = (None, exc)
        await queue.put(end)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        open_streams = len(tasks)
        while open_streams:
            item, exc = await queue.get()
            if exc is not None:
                raise exc  # its stream ended with it (no end marker follows)
            if item is _END:
                open_streams -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]],
                             awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (``receive``: the ASGI receive
    of a request whose body was read); then cancel it and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
