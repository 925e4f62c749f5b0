"""The router's dispatch ledger: which of its own requests a replica's load report still counts."""

from kvfleet.index_keys import ReplicaLoad
from kvfleet.router.inflight import MAX_FINISHED, InflightLedger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def report(running: int, at: float) -> ReplicaLoad:
    return ReplicaLoad(running, 0, 10, 10, at)


def test_a_request_finished_after_the_report_is_settled():
    clock = Clock()
    ledger = InflightLedger(clock)
    started = ledger.dispatched("a")
    assert ledger.inflight["a"] == 1
    ledger.on_reports([("a", report(1, at=100.5))])  # heartbeat while the request runs
    clock.t = 101.0
    ledger.finished("a", started)
    assert ledger.inflight["a"] == 0 and ledger.settled("a") == 1
    ledger.on_reports([("a", report(1, at=100.5))])  # same report again: nothing recounted
    assert ledger.settled("a") == 1
    ledger.on_reports([("a", report(0, at=101.5))])  # the next heartbeat no longer counts it
    assert ledger.settled("a") == 0


def test_requests_outside_the_report_are_not_settled():
    clock = Clock()
    ledger = InflightLedger(clock)
    ledger.on_reports([("a", report(0, at=100.0))])
    clock.t = 100.1
    before = ledger.dispatched("a")  # after the report: the report never counted it
    clock.t = 100.2
    ledger.finished("a", before)
    assert ledger.settled("a") == 0
    # A newer report taken while a second request ran counts that one only.
    clock.t = 100.3
    second = ledger.dispatched("a")
    ledger.on_reports([("a", report(1, at=100.4))])
    clock.t = 100.6
    ledger.finished("a", second)
    assert ledger.settled("a") == 1


def test_a_report_from_a_clock_ahead_of_the_finish_is_not_corrected():
    clock = Clock()
    ledger = InflightLedger(clock)
    started = ledger.dispatched("a")
    ledger.on_reports([("a", report(1, at=105.0))])  # worker clock 5 s ahead
    clock.t = 101.0
    ledger.finished("a", started)
    assert ledger.settled("a") == 0 and ledger.inflight["a"] == 0


def test_replicas_that_leave_or_lose_their_report_are_forgotten():
    clock = Clock()
    ledger = InflightLedger(clock)
    a, b = ledger.dispatched("a"), ledger.dispatched("b")
    ledger.on_reports([("a", report(1, at=100.5)), ("b", report(1, at=100.5))])
    clock.t = 101.0
    ledger.finished("a", a)
    ledger.finished("b", b)
    assert ledger.settled("a") == ledger.settled("b") == 1
    ledger.on_reports([("a", None)])  # the index went away (no report) and "b" left
    assert ledger.settled("a") == ledger.settled("b") == 0
    assert ledger._finished == {}  # nothing kept for either


def test_finishes_kept_per_replica_are_bounded_while_the_report_is_stuck():
    clock = Clock()
    ledger = InflightLedger(clock)
    ledger.on_reports([("a", report(3, at=100.0))])
    for i in range(MAX_FINISHED + 50):
        clock.t = 100.0 + i * 1e-3
        ledger.finished("a", ledger.dispatched("a"))
    assert len(ledger._finished["a"]) == MAX_FINISHED
    assert ledger.inflight["a"] == 0
