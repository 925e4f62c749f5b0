"""What a replica registers as its address: the host it binds, or for a wildcard bind this
node's address, which other hosts can dial."""

from __future__ import annotations

import socket

import ray

from kvfleet.grpc_util import advertised_host


def test_a_named_host_is_advertised_as_is():
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("10.1.2.3") == "10.1.2.3"


def test_a_wildcard_bind_advertises_this_nodes_address():
    expected = (ray.util.get_node_ip_address() if ray.is_initialized()
                else socket.gethostbyname(socket.gethostname()))
    for wildcard in ("0.0.0.0", "::", ""):
        got = advertised_host(wildcard)
        assert got == expected
        assert got not in ("0.0.0.0", "::", "")
