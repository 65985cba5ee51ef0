"""Where a weight transfer's group meets: the sender's rendezvous address, its node's IP as other
nodes reach it (never the loopback address of whoever reads it), unless configured."""

from __future__ import annotations

import socket


def node_ip_address() -> str:
    """This node's address as other nodes reach it: Ray's node IP inside a Ray process, else the
    address of the interface that routes outwards (no packet is sent), else the loopback address."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def transfer_host(configured: str | None, node_ip: str | None = None) -> str:
    """The rendezvous host of a sender: ``configured`` if given, else its node's IP."""
    if configured:
        return configured
    return node_ip if node_ip is not None else node_ip_address()
