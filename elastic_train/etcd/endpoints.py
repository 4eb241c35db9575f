"""The one parser of etcd endpoint lists (``--rdzv-endpoint``, job.yaml ``rendezvous.endpoint``,
``--endpoint`` of the CLI) and its inverse.

Kept free of gRPC so that configuration validation can use it without importing the client.
"""

from __future__ import annotations

import re

#: etcd's client port, the default of torch's ``etcd``/``etcd-v2`` backends for an endpoint without one.
DEFAULT_PORT = 2379

_HOST = re.compile(r"^[\w.:-]+$")


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """Split ``"h1:2379,h2,[::1]:2380"`` into (host, port) pairs; a missing port is :data:`DEFAULT_PORT`.

    An optional ``http://`` or ``https://`` scheme and a trailing slash are dropped (etcdctl-style URLs);
    an IPv6 address takes brackets, with or without a port, as torch's ``parse_rendezvous_endpoint`` does.

    Raises:
        ValueError: an empty list, an empty entry, a port that is not 1-65535, or a malformed host; the
            message names the entry.
    """
    out = []
    for raw in endpoints.split(","):
        ep = raw.strip()
        for scheme in ("http://", "https://"):
            if ep.startswith(scheme):
                ep = ep[len(scheme) :]
        ep = ep.rstrip("/")
        if not ep:
            raise ValueError(f"etcd endpoint list {endpoints!r} has an empty entry")
        if ep.startswith("[") and ep.endswith("]"):
            host, port_text = ep[1:-1], ""
        elif ep.startswith("["):
            host, sep, port_text = ep[1:].partition("]:")
            if not sep:
                raise ValueError(f"etcd endpoint {raw.strip()!r} is not HOST[:PORT]")
        elif ep.count(":") > 1:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: put an IPv6 address in brackets, [ADDR]:PORT")
        else:
            host, _, port_text = ep.partition(":")
            if ":" not in ep:
                port_text = ""
            elif not port_text:
                raise ValueError(f"etcd endpoint {raw.strip()!r} is not HOST[:PORT]")
        if not host or not _HOST.match(host):
            raise ValueError(f"etcd endpoint {raw.strip()!r} is not HOST[:PORT]")
        if port_text == "":
            port = DEFAULT_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ValueError(f"etcd endpoint {raw.strip()!r}: port {port_text!r} is not 1-65535")
        out.append((host, port))
    return out


def format_endpoint(host: str, port: int) -> str:
    """``HOST:PORT`` (``[ADDR]:PORT`` for IPv6), the form gRPC and etcdctl take."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_endpoints(pairs: list[tuple[str, int]]) -> str:
    """The canonical endpoint list ``HOST:PORT,HOST:PORT,...`` of parsed (host, port) pairs."""
    return ",".join(format_endpoint(host, port) for host, port in pairs)
