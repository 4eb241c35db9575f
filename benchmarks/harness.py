"""Benchmark harness: real torchrun agents on loopback, an embedded etcd, faults injected by PID.

A :class:`Job` starts an embedded etcd (with the v2 API on, for torch's ``etcd``/``etcd-v2`` backends), then
torchrun agents ("nodes") running :mod:`bench_worker`, each agent in its own session. It reads the workers'
progress lines, kills (SIGKILL) or freezes (SIGSTOP) a whole node (agent + workers, tree snapshotted before
the signal), adds nodes, and times "first training step at world size W after time T". Every process it
started is killed by PID when the job closes, whatever happened.

The pure parts (:func:`first_step_at`, :class:`ProgressReader`, the summaries) are unit-tested; the rest
needs processes and is exercised by ``benchmarks/rendezvous.py --quick``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastic_train import procs
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.net import free_port
from elastic_train.train.jsonl import parse_json_lines

#: The configuration every ratio is taken against.
OURS = "etcd3"
#: The worker every agent runs.
WORKER = str(Path(__file__).with_name("bench_worker.py"))
#: torchrun's own default for ``--monitor-interval`` in torch 2.13 (seconds); used for every backend.
MONITOR_INTERVAL = 0.1
#: Restarts allowed per agent: far more than any scenario needs, on every backend.
MAX_RESTARTS = 100
#: Tuned torchrun settings (DESIGN.md "honest baseline"): 1 s last call, 1 s x 3 keep-alive.
TUNED_CONF = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
#: Stops DynamicRendezvousHandler sharing the rank-0 agent's TCPStore with workers (stale keys: DESIGN.md).
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """One rendezvous configuration to benchmark."""

    name: str
    """Label in tables and JSON (``etcd3``, ``c10d-tuned`` …)."""
    backend: str
    """torchrun ``--rdzv-backend`` value."""
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    """torchrun ``--rdzv-conf`` keys."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for the agents."""
    ours: bool = False
    """True for elastic_train's handlers, False for torch's baselines."""
    description: str = ""
    """One line for the report."""
    launcher: str = "torchrun"
    """``torchrun`` (plain torchrun command) or ``elastic-train`` (``elastic-train run --entry``: the etcd3
    rendezvous plus the per-node worker fork server, i.e. the product as users run it)."""

    @property
    def endpoint_kind(self) -> str:
        """``tcpstore`` for c10d (an agent hosts a TCPStore), ``etcd`` for everything else."""
        return "tcpstore" if self.backend == "c10d" else "etcd"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "rdzv_conf": dict(self.rdzv_conf),
            "env": dict(self.env),
            "ours": self.ours,
            "description": self.description,
            "launcher": self.launcher,
        }


CONFIGS: dict[str, BackendConfig] = {
    c.name: c
    for c in (
        BackendConfig(
            name="etcd3",
            backend="etcd3",
            ours=True,
            launcher="elastic-train",
            description="ours as shipped: elastic-train run (etcd v3 handler + worker fork server), defaults",
        ),
        BackendConfig(
            name="etcd3-torchrun",
            backend="etcd3",
            ours=True,
            description="ours: etcd v3 handler under plain torchrun (fresh interpreter per worker), defaults",
        ),
        BackendConfig(
            name="etcd3-dynamic",
            backend="etcd3-dynamic",
            ours=True,
            description="ours: torch DynamicRendezvousHandler on our etcd v3 backend, defaults",
        ),
        BackendConfig(name="c10d", backend="c10d", description="torch c10d, torchrun defaults"),
        BackendConfig(
            name="c10d-tuned",
            backend="c10d",
            rdzv_conf=TUNED_CONF,
            env=NO_SHARED_STORE,
            description="torch c10d, last call 1 s, keep-alive 1 s x 3, no shared store",
        ),
        BackendConfig(name="etcd-v2", backend="etcd-v2", description="torch etcd-v2, torchrun defaults"),
        BackendConfig(
            name="etcd-v2-tuned",
            backend="etcd-v2",
            rdzv_conf=TUNED_CONF,
            env=NO_SHARED_STORE,
            description="torch etcd-v2, last call 1 s, keep-alive 1 s x 3, no shared store",
        ),
        BackendConfig(name="etcd", backend="etcd", description="torch legacy etcd handler, defaults"),
        BackendConfig(
            name="etcd-tuned",
            backend="etcd",
            rdzv_conf={"last_call_timeout": "1"},
            description="torch legacy etcd handler, last call 1 s",
        ),
    )
}


# ---------------------------------------------------------------------------------------------------------
# Progress records (pure)


class ProgressReader:
    """Reads the workers' progress files incrementally (complete lines only) and keeps every record."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.records: list[dict[str, Any]] = []
        self._offsets: dict[str, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Read what was appended since the last call; returns the new records."""
        new: list[dict[str, Any]] = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return new
        for name in names:
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(self.directory, name)
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            new.extend(parse_json_lines(data[:end].splitlines()))
        self.records.extend(new)
        return new


def first_step_at(records: Iterable[Mapping[str, Any]], world_size: int, after: float) -> float | None:
    """Time of the earliest ``step`` record at ``world_size`` with time >= ``after`` (None if none)."""
    times = [
        float(r["time"])
        for r in records
        if r.get("event") == "step" and r.get("world_size") == world_size and float(r["time"]) >= after
    ]
    return min(times) if times else None


# ---------------------------------------------------------------------------------------------------------
# Outcomes


@dataclass(slots=True)
class Outcome:
    """Result of waiting for a world size: seconds, or why not."""

    status: str
    """``ok``, ``timeout`` (nothing within the cap: failed or stalled) or ``failed`` (every agent exited)."""
    seconds: float | None = None
    """Seconds from the event to the first step at the target world size (``ok`` only)."""
    cap: float | None = None
    """The cap the wait ran under."""
    detail: str = ""
    """Why, for a result that is not ``ok``: agent exit codes and the last lines of their logs."""

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "seconds": self.seconds, "cap": self.cap, "detail": self.detail}


# ---------------------------------------------------------------------------------------------------------
# Processes


@dataclass(slots=True)
class Node:
    """One torchrun agent and everything it started."""

    label: str
    proc: subprocess.Popen[bytes]
    log_path: str
    started: float
    known: dict[int, psutil.Process] = field(default_factory=dict)
    state: str = "running"
    """``running``, ``killed`` or ``stopped``."""

    def snapshot(self) -> list[psutil.Process]:
        """The agent's current process tree; every process ever seen is remembered for the final cleanup."""
        current = procs.tree(self.proc.pid)
        for p in current:
            self.known.setdefault(p.pid, p)
        return current

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                kept = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(ln[:240] for ln in kept[-lines:])


class Job:
    """One elastic job: embedded etcd, N torchrun agents on loopback, all cleaned up by PID on close.

    Args:
        config: the rendezvous configuration.
        nnodes: torchrun ``--nnodes`` (``MIN:MAX``).
        step_interval: seconds between worker steps.
        workdir: where logs and progress files go (a temporary directory by default, removed on close
            unless ``keep``).
        keep: keep ``workdir`` after close (for debugging).
        etcd_binary: etcd binary (default: the bundled one).
    """

    def __init__(
        self,
        config: BackendConfig,
        *,
        nnodes: str = "2:4",
        step_interval: float = 0.1,
        workdir: str | None = None,
        keep: bool = False,
        etcd_binary: str | None = None,
    ) -> None:
        self.etcd = EmbeddedEtcd(binary=etcd_binary, enable_v2=True)  # first: it raises if there is no etcd
        self.config = config
        self.nnodes = nnodes
        self.step_interval = step_interval
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"bench-{config.name}-")
        self.keep = keep
        self.progress_dir = os.path.join(self.workdir, "progress")
        os.makedirs(self.progress_dir, exist_ok=True)
        self.run_id = f"bench-{uuid.uuid4().hex[:10]}"
        self.store_port = free_port()
        self.nodes: dict[str, Node] = {}
        self.reader = ProgressReader(self.progress_dir)
        self._next_label = 0

    # -- life cycle -------------------------------------------------------------------------------------

    def __enter__(self) -> Job:
        try:
            self.etcd.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process this job started (whole trees, plus anything ever seen in them) and etcd."""
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.snapshot()
            procs.kill_tree(node.proc.pid)
            for p in node.known.values():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    p.kill()
            psutil.wait_procs(list(node.known.values()), timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        self.etcd.stop()
        if self._own_dir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- nodes ------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self.config.endpoint_kind == "tcpstore":
            return f"127.0.0.1:{self.store_port}"
        return self.etcd.endpoint

    def command(self) -> list[str]:
        """The command line every agent of this job runs."""
        if self.config.launcher == "elastic-train":
            return [
                sys.executable, "-m", "elastic_train", "--log-format", "json", "run",
                f"--nodes={self.nnodes}", f"--endpoint={self.endpoint}", f"--run-id={self.run_id}",
                "--local-addr=127.0.0.1", "--entry", WORKER,
            ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            f"--rdzv-backend={self.config.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            "--local-addr=127.0.0.1",
            f"--max-restarts={MAX_RESTARTS}",
            f"--monitor-interval={MONITOR_INTERVAL}",
        ]  # fmt: skip
        if self.config.rdzv_conf:
            conf = ",".join(f"{k}={v}" for k, v in self.config.rdzv_conf.items())
            cmd.append(f"--rdzv-conf={conf}")
        cmd.append(WORKER)
        return cmd

    def env(self, label: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "GLOO_SOCKET_IFNAME": "lo",
                "MASTER_ADDR": "127.0.0.1",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "BENCH_PROGRESS_DIR": self.progress_dir,
                "BENCH_STEP_INTERVAL": str(self.step_interval),
                "BENCH_NODE": label,
                "BENCH_STATE_FILE": os.path.join(self.workdir, "step"),
            }
        )
        env.update(self.config.env)
        return env

    def add_node(self) -> Node:
        """Start one more agent (label ``0``, ``1`` … in start order)."""
        label = str(self._next_label)
        self._next_label += 1
        log_path = os.path.join(self.workdir, f"agent-{label}.log")
        with open(log_path, "ab") as logf:
            started = time.time()
            proc = subprocess.Popen(
                procs.tied(self.command()),  # nothing outlives a crashed harness
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(label),
                start_new_session=True,
            )
        node = Node(label=label, proc=proc, log_path=log_path, started=started)
        self.nodes[label] = node
        return node

    def add_nodes(self, n: int) -> float:
        """Start ``n`` agents back to back; returns the time the first one was launched."""
        t0 = time.time()
        for _ in range(n):
            self.add_node()
        return t0

    def kill_node(self, label: str) -> float:
        """SIGKILL a node's whole tree (snapshotted first); returns the time of the signal."""
        node = self.nodes[label]
        tree = node.snapshot()
        t = time.time()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                p.kill()
        psutil.wait_procs(tree, timeout=10)
        node.state = "killed"
        return t

    def stop_node(self, label: str) -> float:
        """SIGSTOP a node's whole tree (children first); returns the time of the signal."""
        node = self.nodes[label]
        node.snapshot()
        t = time.time()
        procs.signal_tree(node.proc.pid, signal.SIGSTOP)
        node.state = "stopped"
        return t

    def running(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == "running"]

    def store_host(self) -> str | None:
        """Label of the node whose tree listens on the c10d store port (None for etcd-based backends)."""
        if self.config.endpoint_kind != "tcpstore":
            return None
        for node in self.running():
            for p in node.snapshot():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    for c in p.net_connections(kind="tcp"):
                        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.store_port:
                            return node.label
        return None

    def pick_victim(self) -> str:
        """The most recently started running node that does not host the c10d store.

        Killing the store host ends a c10d job by design (a single point of failure, not a recovery
        figure), so the kill and hang scenarios pick a member that every backend can survive losing.
        """
        host = self.store_host()
        candidates = [n.label for n in self.running() if n.label != host]
        return candidates[-1]

    # -- waiting ----------------------------------------------------------------------------------------

    def wait_world(self, world_size: int, after: float, cap: float, poll: float = 0.05) -> Outcome:
        """Wait for a step at ``world_size`` at or after ``after``, at most ``cap`` seconds from ``after``."""
        deadline = after + cap
        last_snapshot = 0.0
        while True:
            self.reader.poll()
            if time.monotonic() - last_snapshot > 0.5:
                self._snapshot_all()
                last_snapshot = time.monotonic()
            hit = first_step_at(self.reader.records, world_size, after)
            if hit is not None:
                return Outcome("ok", seconds=round(hit - after, 3), cap=cap)
            if not any(n.alive() for n in self.running()):
                return Outcome("failed", cap=cap, detail=self.diagnosis())
            if time.time() >= deadline:
                return Outcome("timeout", cap=cap, detail=self.diagnosis())
            time.sleep(poll)

    def wait_steps(self, world_size: int, steps: int, after: float, cap: float) -> bool:
        """Wait until ``steps`` rank-0 steps at ``world_size`` happened after ``after`` (steady training)."""
        deadline = time.time() + cap
        while time.time() < deadline:
            self.reader.poll()
            n = sum(
                1
                for r in self.reader.records
                if r.get("event") == "step"
                and r.get("rank") == 0
                and r.get("world_size") == world_size
                and float(r["time"]) >= after
            )
            if n >= steps:
                return True
            time.sleep(0.05)
        return False

    def diagnosis(self) -> str:
        """Agent exit codes and log tails, for a result that is not ``ok``."""
        parts = []
        for node in self.nodes.values():
            code = node.proc.poll()
            status = node.state if code is None else f"exit {code}"
            tail = node.log_tail(2) if node.state == "running" else ""
            parts.append(f"node {node.label} {status}" + (f": {tail}" if tail else ""))
        return "; ".join(parts)

    def _snapshot_all(self) -> None:
        for node in self.running():
            with contextlib.suppress(Exception):
                node.snapshot()


def phases(records: Iterable[Mapping[str, Any]], world_size: int, after: float) -> dict[str, float | None]:
    """Where a recovery's time went, in seconds from ``after`` at ``world_size``.

    ``workers_started``: the first new worker process started (detection + rendezvous + spawn);
    ``all_started``: the last rank's worker started; ``imported``: the last rank finished importing torch;
    ``pg_ready``: the first rank had its process group and DDP model; ``first_step``: the first step.
    """
    firsts: dict[tuple[str, Any], float] = {}
    for r in records:
        event = r.get("event")
        if r.get("world_size") != world_size or float(r["time"]) < after:
            continue
        key = (str(event), r.get("rank"))
        firsts[key] = min(firsts.get(key, float("inf")), float(r["time"]))

    def pick(event: str, last: bool) -> float | None:
        times = [t for (e, _), t in firsts.items() if e == event]
        if not times:
            return None
        return round((max(times) if last else min(times)) - after, 3)

    return {
        "workers_started": pick("start", last=False),
        "all_started": pick("start", last=True),
        "imported": pick("imported", last=True),
        "pg_ready": pick("pg", last=False),
        "first_step": pick("step", last=False),
    }


# ---------------------------------------------------------------------------------------------------------
# Statistics over repeats (pure). A sample is an Outcome as JSON; anything not "ok" is censored: the true
# figure is above its cap (or unknown for "not_run").


def summarize(samples: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats, with failed/stalled samples counted as "> cap".

    Returns:
        ``{"n", "ok", "median", "median_censored", "min", "max", "max_censored", "cap"}``; ``median`` is a
        lower bound (the cap) when ``median_censored``; ``median`` is None when nothing was measured.
    """
    measured = [s for s in samples if s.get("status") != "not_run"]
    caps = [float(s["cap"]) for s in measured if s.get("cap") is not None]
    cap = max(caps) if caps else None
    values = sorted(
        float(s["seconds"]) if s.get("status") == "ok" and s.get("seconds") is not None else float("inf")
        for s in measured
    )
    out: dict[str, Any] = {
        "n": len(values),
        "ok": sum(1 for v in values if v != float("inf")),
        "median": None,
        "median_censored": False,
        "min": None,
        "max": None,
        "max_censored": False,
        "cap": cap,
    }
    if not values:
        return out
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    finite = [v for v in values if v != float("inf")]
    out["median_censored"] = median == float("inf")
    out["median"] = cap if out["median_censored"] else round(median, 3)
    out["min"] = round(finite[0], 3) if finite else cap
    out["max_censored"] = values[-1] == float("inf")
    out["max"] = cap if out["max_censored"] else round(values[-1], 3)
    return out


def speedup(baseline: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any] | None:
    """How many times faster ``ours`` is than ``baseline`` (two :func:`summarize` results), by median.

    Returns:
        ``{"ratio": float, "lower_bound": bool}`` (``lower_bound`` when the baseline never got there within
        its cap, so the true ratio is at least this), or None when either side has no usable median.
    """
    b, o = baseline.get("median"), ours.get("median")
    if b is None or o is None or ours.get("median_censored") or o <= 0:
        return None
    return {"ratio": round(float(b) / float(o), 2), "lower_bound": bool(baseline.get("median_censored"))}


_VENV_DIR = re.compile(r"(?<![\w.])/(?:[\w.-]+/)*(?=\.venv/)")


def without_dirs(text: str) -> str:
    """A recorded log line without the directories above the machine's virtual environment."""
    return _VENV_DIR.sub("", text)


def format_summary(s: Mapping[str, Any]) -> str:
    """``"3.21 s [2.90, 3.40] (3/3)"``, ``"> 90 s (0/3)"`` or ``"not measured"``."""
    if not s or s.get("median") is None:
        return "not measured"
    med = f"> {s['median']:.0f} s" if s.get("median_censored") else f"{s['median']:.2f} s"
    if s.get("n", 0) > 1 and s.get("ok", 0) > 0:
        hi = f">{s['max']:.0f}" if s.get("max_censored") else f"{s['max']:.2f}"
        med += f" [{s['min']:.2f}, {hi}]"
    return f"{med} ({s.get('ok', 0)}/{s.get('n', 0)})"


def format_ratio(r: Mapping[str, Any] | None) -> str:
    """``"4.2x"``, ``">= 9.1x"`` or ``"-"``."""
    if not r:
        return "-"
    return (">= " if r.get("lower_bound") else "") + f"{r['ratio']:.1f}x"


# ---------------------------------------------------------------------------------------------------------
# Machine description


def machine_info(etcd_binary: str | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM, load, torch/python/etcd versions: the "where" of every figure."""
    import platform

    import torch

    from elastic_train.etcd.server import etcd_version, find_etcd_binary

    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        etcd = etcd_version(etcd_binary or find_etcd_binary())
    except Exception:
        etcd = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "etcd": etcd,
        "platform": platform.platform(),
    }
