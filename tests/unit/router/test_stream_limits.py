"""The bounds on slow readers' streams (kvfleet.stream_limits) and the router's flags for them."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvfleet.errors import status_of
from kvfleet.router.flags import parse_args
from kvfleet.stream_limits import Outbox, SlowReader, StreamLimits, write_within


@pytest.mark.parametrize("kw", [{"max_unread": 0}, {"max_unread": 1.5}, {"stall_s": 0},
                                {"stall_s": float("inf")}, {"stall_s": float("nan")}])
def test_limits_must_be_positive(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        StreamLimits(**kw)


async def test_an_outbox_past_its_bound_drops_its_backlog_and_overflows_once():
    overflows = []
    box: Outbox[int] = Outbox(3, lambda: overflows.append(1), "request r")
    for i in range(3):
        box.put(i)
    assert await box.get() == 0  # under the bound: plain FIFO
    box.put(3)
    box.put(4)  # the fourth unread message
    box.put(5)  # ignored from now on
    assert overflows == [1] and box.overflowed
    for _ in range(2):  # every later get raises
        with pytest.raises(SlowReader, match="request r: more than 3 messages unread") as exc:
            await box.get()
    assert status_of(exc.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_write_held_past_the_stall_time_raises_slow_reader():
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(SlowReader, match="SSE stream: the reader took nothing for 0.05 s"):
        await write_within(never, StreamLimits(stall_s=0.05), "SSE stream")
    assert never.cancelled()
    await write_within(asyncio.sleep(0), StreamLimits(stall_s=0.05), "quick")  # in time: no error


def test_router_flags_set_the_stream_limits():
    base = ["--redis-url", "redis://x", "--model-name", "m", "--model-dir", "d"]
    assert parse_args(base).stream_limits == StreamLimits()
    cfg = parse_args([*base, "--stream-max-unread", "8", "--stream-stall-s", "2.5"])
    assert cfg.stream_limits == StreamLimits(8, 2.5)
    with pytest.raises(SystemExit):
        parse_args([*base, "--stream-stall-s", "0"])


def test_router_flag_bounds_http_connections():
    base = ["--redis-url", "redis://x", "--model-name", "m", "--model-dir", "d"]
    assert parse_args([*base, "--http-max-connections", "10"]).http_max_connections == 10
    with pytest.raises(SystemExit):
        parse_args([*base, "--http-max-connections", "0"])
