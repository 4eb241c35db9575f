"""Is a member's agent process gone although its lease has not expired? Ask its store port.

Every agent hosts a TCPStore for the whole of its life and advertises the port (its node key, the round
record). A TCP connection to it that the member's host refuses means the agent process is gone (kill -9, a
crash): the round need not wait a lease TTL for it. A port that accepts, or does not answer in time (a
stopped process's kernel still accepts; a partitioned host does not answer), counts as alive: the lease
decides. Used by the node closing a round (:mod:`elastic_train.rendezvous.join`) and by the hot path while
the agents of a round exchange ranks (:mod:`elastic_train.rendezvous.exchange`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any, Literal

#: Seconds a probe waits for an answer. A refused connection comes back within one round trip between the
#: hosts, and one that times out costs this much (the closing node probes while it holds its view's lock):
#: 0.1 s covers the 100 ms round trips of hosts in other zones and bounds that cost.
PROBE_TIMEOUT = 0.1

Answer = Literal["refused", "accepted", "unknown"]


def probe(addr: str, port: int, timeout: float = PROBE_TIMEOUT) -> Answer:
    """``refused`` when ``addr:port`` refuses a TCP connection, ``accepted`` when it accepts one, else
    ``unknown`` (no port, no answer within ``timeout``)."""
    if port <= 0 or port >= 65536:
        return "unknown"
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "unknown"
    return "accepted"


def probe_node(node: Mapping[str, Any] | None, timeout: float = PROBE_TIMEOUT) -> Answer:
    """:func:`probe` of a node's advertised store (``{"addr", "store_port"}``, read from etcd: untrusted)."""
    addr = node.get("addr") if node is not None else None
    port = node.get("store_port") if node is not None else None
    if not isinstance(addr, str) or isinstance(port, bool) or not isinstance(port, int):
        return "unknown"
    return probe(addr, port, timeout)
