"""``elastic-train run``: this node's torchrun launch with the ``etcd3`` rendezvous, built from job.yaml.

The agent runs in this process (torchrun's ``elastic_launch``); workers are ``python -m elastic_train.worker``
with the same config file and the same overrides, so every process of the job sees the same configuration.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from elastic_train.config import JobConfig
from elastic_train.envvars import ENV_NODE_ID, ENV_START_BARRIER
from elastic_train.etcd.endpoints import parse_endpoints
from elastic_train.log import get_logger
from elastic_train.procs import die_with_parent, scratch_path, tied
from elastic_train.rendezvous.config import RendezvousConfig

log = get_logger(__name__)


#: torchrun's own restart counter is per agent; the job-wide failure budget lives in etcd instead
#: (rendezvous.failure_budget), so the per-agent counter is set out of the way.
AGENT_MAX_RESTARTS = 1_000_000
#: Seconds between the agent's health checks of its workers (torchrun's default, stated explicitly).
MONITOR_INTERVAL = 0.1
#: Loopback interface name for gloo when the job runs on loopback addresses.
LOOPBACK_IFNAME = "lo"


def endpoint_is_loopback(endpoint: str) -> bool:
    """True when every HOST of ``HOST[:PORT][,HOST[:PORT]]`` is a loopback address or ``localhost``."""
    try:
        hosts = [host for host, _port in parse_endpoints(endpoint)]
    except ValueError:
        return False
    for host in hosts:
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return True


def interface_of(addr: str) -> str | None:
    """The name of this machine's network interface that holds ``addr`` (None: none does, or not an IP)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def default_local_addr(cfg: RendezvousConfig) -> str | None:
    """The address this node advertises: loopback for a loopback etcd, else torchrun's default (FQDN)."""
    return "127.0.0.1" if endpoint_is_loopback(cfg.endpoint) else None


def worker_overrides_argv(overrides: Mapping[str, Any]) -> list[str]:
    """``--set KEY=VALUE`` arguments for the worker; values as JSON so strings stay strings in YAML."""
    argv: list[str] = []
    for key, value in overrides.items():
        if value is not None:
            argv += ["--set", f"{key}={json.dumps(value)}"]
    return argv


def torchrun_argv(
    cfg: JobConfig,
    *,
    config_path: str | None,
    overrides: Mapping[str, Any],
    local_addr: str | None,
    entry: list[str] | None = None,
) -> list[str]:
    """The torchrun arguments (without the program name) that run this job's node.

    Args:
        cfg: the validated job config (with overrides applied).
        config_path: the job.yaml the workers read, or ``None`` for defaults.
        overrides: the dotted-key overrides the workers must apply too.
        local_addr: address this node advertises to the others (``None``: torchrun's default).
        entry: a user's own worker instead of ``elastic_train.worker``: ``[SCRIPT, ARGS...]`` or
            ``["-m", MODULE, ARGS...]``; it gets no job config, only torchrun's environment.
    """
    from elastic_train.rendezvous.params import torchrun_args

    argv = torchrun_args(cfg.rendezvous)
    argv += [f"--max-restarts={AGENT_MAX_RESTARTS}", f"--monitor-interval={MONITOR_INTERVAL}"]
    if local_addr:
        argv.append(f"--local-addr={local_addr}")
    if entry:
        return [*argv, "-m", "elastic_train.worker.standin", *entry]
    argv += ["-m", "elastic_train.worker"]
    if config_path:
        argv += ["--config", os.path.abspath(config_path)]
    return argv + worker_overrides_argv(overrides)


def prepare_environment(
    cfg: JobConfig, local_addr: str | None, environ: MutableMapping[str, str], *, own_entry: bool = False
) -> None:
    """Set what the agent and its workers inherit: node id, the job's identity, and the interface gloo binds:
    loopback for a loopback job, else the one holding ``local_addr`` (unless ``GLOO_SOCKET_IFNAME`` is set).

    The identity is what the ``etcd3`` handler compares before this node joins: every setting all nodes must
    share, or with ``own_entry`` (a user's script, which ignores the train and checkpoint sections) only what
    torchrun knows.
    """
    from elastic_train.envvars import ENV_IDENTITY
    from elastic_train.launch.identity import job_settings
    from elastic_train.rendezvous.identity import JobIdentity, torchrun_settings

    rdzv = cfg.rendezvous
    environ.setdefault(ENV_NODE_ID, socket.gethostname())
    settings = (
        torchrun_settings(rdzv.min_nodes, rdzv.max_nodes, rdzv.nproc_per_node)
        if own_entry
        else job_settings(cfg)
    )
    environ[ENV_IDENTITY] = JobIdentity(settings).to_json()
    if local_addr and endpoint_is_loopback(rdzv.endpoint):
        environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    elif local_addr and "GLOO_SOCKET_IFNAME" not in environ:
        # gloo otherwise binds the address this machine's host name resolves to, which need not be the one
        # the other nodes reach (a second network, a container's or a namespace's interface)
        ifname = interface_of(local_addr)
        if ifname is not None:
            environ["GLOO_SOCKET_IFNAME"] = ifname


def preflight(cfg: JobConfig) -> None:
    """Check what can be checked before the agent starts, so a mistake is one line now, not a crash loop.

    The checkpoint URL must name an installed filesystem (:func:`preflight_storage`), and etcd must answer
    with the job's credentials (:func:`preflight_etcd`).

    Raises:
        StorageError: unknown protocol or missing optional filesystem package.
        EtcdError: unreachable, authentication or TLS failure.
    """
    preflight_storage(cfg)
    preflight_etcd(cfg)


def preflight_storage(cfg: JobConfig) -> None:
    """The checkpoint URL names an installed filesystem (no connection, no thread: ``elastic-train run``
    checks it before it forks its fork server).

    Raises:
        StorageError: unknown protocol or missing optional filesystem package.
    """
    from elastic_train.checkpoint.storage import open_storage
    from elastic_train.errors import ElasticTrainError

    try:
        open_storage(cfg.checkpoint.url, cfg.checkpoint.storage_options)
    except ElasticTrainError:
        # A task module may register its own fsspec filesystem when imported (workers import it); give it
        # that chance before calling the URL bad.
        module = cfg.train.task.partition(":")[0] if ":" in cfg.train.task else None
        if module is None or not _import_quietly(module):
            raise
        open_storage(cfg.checkpoint.url, cfg.checkpoint.storage_options)


def preflight_etcd(cfg: JobConfig) -> None:
    """etcd answers with the job's credentials (its gRPC channel leaves threads behind).

    Raises:
        EtcdError: unreachable, authentication or TLS failure.
    """
    from elastic_train.rendezvous.connect import open_etcd

    open_etcd(cfg.rendezvous).close()


class ForkedServer:
    """A fork server forked from this process: the part of :class:`subprocess.Popen` the supervisor uses
    (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``). Any thread may poll or wait; one reaps."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone, its status unknown
                    self.returncode = -1
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class ForkServerSupervisor:
    """Runs this node's worker fork server for the agent's lifetime, restarting it if it dies.

    It imports torch while the agent meets the others in the rendezvous; a worker started before it listens
    waits for it (see :mod:`elastic_train.worker.forkserver`). Workers learn its socket and PID from the
    environment they inherit from the agent, so a restarted server is used by the next worker group.

    ``fork``: start the first server as a fork of this process, once it imported torch (which the agent
    needs anyway), instead of a fresh interpreter that imports torch again: a node's start then costs one
    import of torch, not two (1.5 CPU-s on a busy 2-core machine). Only while this process runs no other
    thread (no gRPC channel, no agent yet): a fork copies no thread but every lock another thread may hold.
    A server that dies is replaced by a fresh interpreter (the agent has threads by then).
    """

    def __init__(
        self, environ: MutableMapping[str, str], preload: Sequence[str] = (), *, fork: bool = False
    ) -> None:
        from elastic_train.worker.forkserver import ENV_PID, ENV_SOCKET

        self.environ = environ
        self.preload = list(preload)
        self.path = scratch_path("fs", ".sock")
        self._env_pid = ENV_PID
        environ[ENV_SOCKET] = self.path
        self._stopping = threading.Event()
        self.proc: subprocess.Popen[bytes] | ForkedServer = self._fork() if fork else self._start()
        self.restarts = 0
        self._thread = threading.Thread(target=self._watch, name="forkserver-supervisor", daemon=True)
        self._thread.start()

    def _fork(self) -> subprocess.Popen[bytes] | ForkedServer:
        if _threads() > 1 or self.environ is not os.environ:  # a thread (gRPC's, Python's) runs already
            return self._start()
        import torch  # noqa: F401  # what both processes need, imported once (its own thread is fork-safe:

        # the server forks every worker the same way)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server
            code = 1
            try:
                die_with_parent()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.close(devnull)
                from elastic_train.worker.forkserver import serve

                serve(self.path, self.preload)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        self.environ[self._env_pid] = str(pid)
        log.debug("forkserver_started", pid=pid, socket=self.path, forked=True)
        return ForkedServer(pid)

    def _start(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "elastic_train.worker.forkserver", "--socket", self.path]
        proc = subprocess.Popen(
            tied(command + (["--preload", ",".join(self.preload)] if self.preload else [])),
            stdin=subprocess.DEVNULL,
        )
        self.environ[self._env_pid] = str(proc.pid)
        log.debug("forkserver_started", pid=proc.pid, socket=self.path)
        return proc

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server listens (its imports done), at most ``timeout`` s; False if it did not.

        With modules to preload (Lightning takes seconds to import), a node that joins a running job waits
        for them before it enters the rendezvous: the others keep training meanwhile, instead of waiting
        for this node's worker in the restarted group.
        """
        import time

        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _watch(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            self.restarts += 1
            log.warning("forkserver_exited", code=code, restarts=self.restarts)
            try:
                self.proc = self._start()
            except OSError as exc:  # keep the agent going: stand-ins then start workers themselves
                log.error("forkserver_restart_failed", error=str(exc))
                return

    def stop(self) -> None:
        self._stopping.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: Most seconds an initial node of ``elastic-train local`` waits for the others before its first rendezvous.
START_BARRIER_WAIT = 60.0


def start_barrier(environ: Mapping[str, str], timeout: float = START_BARRIER_WAIT) -> bool:
    """Wait until the initial nodes named by :data:`~elastic_train.envvars.ENV_START_BARRIER` are all ready
    to enter the rendezvous (each leaves a file in its directory); True at once without one. Past
    ``timeout`` (a node that failed to start) the node goes on alone and says so.
    """
    import time

    spec = environ.get(ENV_START_BARRIER)
    if not spec:
        return True
    directory, _, count = spec.rpartition(":")
    try:
        expected = int(count)
        open(os.path.join(directory, str(os.getpid())), "w").close()
    except (ValueError, OSError) as exc:
        log.warning("start_barrier_unusable", barrier=spec, error=str(exc))
        return False
    deadline = time.monotonic() + timeout
    while len(os.listdir(directory)) < expected:
        if time.monotonic() > deadline:
            log.warning("start_barrier_timeout", expected=expected, ready=len(os.listdir(directory)))
            return False
        time.sleep(0.02)
    return True


def _threads() -> int:
    """Threads of this process, native ones included (1 where ``/proc`` cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1 if threading.active_count() == 1 else threading.active_count()


def _import_quietly(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # the workers report a broken task module themselves, with its own error
        return False
    return True


def launch(argv: list[str], before_rendezvous: Callable[[], object] | None = None) -> int:
    """Run torchrun's agent in this process; turn its failures into one line and an exit code.

    ``before_rendezvous`` is called once torchrun is imported, just before the agent enters the rendezvous.
    A signal that stops the node (SIGTERM from Kubernetes, Ctrl-C) ends it with one line and the shell's
    code for the signal, after torchrun's agent stopped the workers (it does not close the run: the others
    go on without this node).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun_run

    if before_rendezvous is not None:
        before_rendezvous()
    try:
        torchrun_run(parse_args(argv))
    except ChildFailedError as exc:
        failures = exc.failures
        first = min(failures.values(), key=lambda f: f.timestamp) if failures else None
        detail = f" (first: local rank {first.local_rank}, exit code {first.exitcode})" if first else ""
        sys.stderr.write(f"elastic-train: error: worker group failed{detail}\n")
        return 1
    except RendezvousError as exc:
        sys.stderr.write(f"elastic-train: error: rendezvous: {exc}\n")
        return 1
    except SignalException as exc:
        # SIGTERM (a preemption, a drain, a deleted pod): the etcd3 handler marked a clean leave before
        # torchrun stopped the workers (rendezvous/leave.py). Exit by the signal's status (not 0: on
        # Kubernetes a pod that exits 0 counts its index as succeeded).
        from elastic_train.rendezvous import leave

        name = signal.Signals(exc.sigval).name if exc.sigval in signal.Signals else str(exc.sigval)
        left = "; this node left the run cleanly" if leave.announced() else ""
        sys.stderr.write(f"elastic-train: node stopped by {name}{left}\n")
        return 128 + int(exc.sigval)
    return 0
