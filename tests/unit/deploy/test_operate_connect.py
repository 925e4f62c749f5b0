"""``kvfleet status|scale|upgrade`` against an address where no Ray listens fails at once with
ConnectionError naming it, instead of Ray's minutes of reconnect attempts."""

from __future__ import annotations

import socket

import pytest

from kvfleet.deploy import operate


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_refuses_a_dead_address_without_asking_ray(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(operate, "init_ray", calls.append)
    target = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ConnectionError, match=f"cannot reach Ray at {target}"):
        operate.connect(target)
    assert calls == []


def test_connect_hands_a_listening_address_to_ray(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(operate, "init_ray", calls.append)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        operate.connect(target)
    assert calls == [target]
    operate.connect("ray://head:10001")  # other forms are Ray's to judge
    assert calls[-1] == "ray://head:10001"
