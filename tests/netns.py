"""Network namespaces for full-partition tests: etcd and each node in a namespace of its own, on one bridge.

:class:`Topology` creates a ``switch`` namespace holding a bridge, one namespace per host (``etcd``,
``node0`` …), and for each host a veth pair from the host's namespace to the bridge, with an address of a
private /24 that exists only inside these namespaces. :meth:`Topology.cut` downs a host's link on the switch
side (its packets are dropped silently, as when a switch port or a zone's uplink fails); :meth:`Topology.heal`
brings it up again. Everything is deleted by :meth:`Topology.close` (deleting a namespace deletes its
interfaces), also when the test fails. Nothing is added to the namespace the test runs in.

:func:`namespaces_refused` says why a machine cannot run this (no ``ip``, no privilege), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def namespaces_refused() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"etprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"ip netns add is refused here: {exc.stderr.strip() or exc}"
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return None


class Topology:
    """See the module docstring.

    Args:
        hosts: names of the hosts (``etcd``, ``node0`` …), each getting a namespace and an address.
    """

    def __init__(self, hosts: list[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.switch = f"et{self.tag}sw"
        self.ns = {h: f"et{self.tag}{h}" for h in hosts}
        self.addr = {h: f"{self.subnet}.{10 + i}" for i, h in enumerate(hosts)}
        self.dev = {h: f"e{self.tag}h{i}" for i, h in enumerate(hosts)}  # inside the host's namespace
        self._port = {h: f"e{self.tag}s{i}" for i, h in enumerate(hosts)}  # its peer on the bridge
        self._made: list[str] = []

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in [self.switch, *self.ns.values()]:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host, ns in self.ns.items():
            dev, port = self.dev[host], self._port[host]
            _ip("-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")

    def run_in(self, host: str) -> list[str]:
        """The argv prefix that runs a command in ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns[host]]

    def cut(self, host: str) -> None:
        """Down ``host``'s port on the bridge: its traffic is dropped, nobody sees a reset."""
        _ip("-n", self.switch, "link", "set", self._port[host], "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port[host], "up")

    def close(self) -> None:
        """Delete every namespace this topology made (and so its interfaces); idempotent."""
        for ns in reversed(self._made):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns)
        self._made.clear()


def environ_without_proxies() -> dict[str, str]:
    """The test's environment minus HTTP proxies (a proxy would be asked for the namespaces' addresses)."""
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
