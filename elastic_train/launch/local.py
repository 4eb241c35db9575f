"""``elastic-train local``: a whole elastic job on this machine, with faults on request.

Starts an embedded etcd, launches N nodes (each an ``elastic-train run`` agent with its workers, in its own
session, advertising a loopback address), follows the workers' event stream, injects the planned faults when
their step is reached, and reports how the job reacted. Every process and shared-memory segment it created is
gone when it returns — also on Ctrl-C or an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import psutil

from elastic_train.config import JobConfig
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.launch import ENV_NODE_ID
from elastic_train.launch.events import EventTail
from elastic_train.launch.faults import Fault
from elastic_train.launch.procs import signal_tree, terminate_tree, tree
from elastic_train.launch.run import worker_overrides_argv
from elastic_train.launch.summary import Summary, render_table, world_size_timeline
from elastic_train.log import get_logger
from elastic_train.train.audit import ENV_AUDIT_DIR

log = get_logger(__name__)

#: Where the workers' rank 0 appends its events (read by this launcher).
ENV_EVENTS = "ELASTIC_TRAIN_EVENTS"
#: Seconds between two looks at the event stream and the processes.
POLL_INTERVAL = 0.1
#: Seconds between two reads of the rendezvous state while a fault waits to be detected.
STATUS_INTERVAL = 0.1


@dataclass(kw_only=True, slots=True)
class LocalOptions:
    """How ``local`` runs the job (the job itself is the JobConfig)."""

    config_path: str | None
    """job.yaml passed on to every node (None: defaults)."""
    overrides: dict[str, Any]
    """Dotted-key overrides every node and worker applies."""
    nodes: int
    """Nodes started at the beginning."""
    faults: list[Fault] = field(default_factory=list)
    workdir: str
    """Logs, events, audit files (and checkpoints unless configured elsewhere) go here."""
    timeout: float = 900.0
    """Give up (and fail) after this many seconds."""
    out: TextIO = sys.stdout
    """Where live lines go."""
    actions: dict[str, Callable[[Fault, Node | None], None]] = field(default_factory=dict)
    """Extra fault kinds (name → action), e.g. storage faults in the chaos suite."""
    entry: list[str] | None = None
    """A user's own torchrun script instead of the built-in worker: ``[SCRIPT, ARGS...]`` or
    ``["-m", MODULE, ARGS...]`` (``elastic-train run --entry``); its audit directory comes from
    ``$ELASTIC_TRAIN_AUDIT_DIR``."""


@dataclass(slots=True)
class Node:
    index: int
    proc: subprocess.Popen[bytes]
    log_path: str
    stopped: bool = False
    killed: bool = False
    started_at: float = 0.0


class LocalJob:
    """One run of ``elastic-train local``; call :meth:`run` once."""

    def __init__(self, cfg: JobConfig, opts: LocalOptions) -> None:
        self.cfg = cfg
        self.opts = opts
        self.run_id = cfg.rendezvous.run_id
        os.makedirs(opts.workdir, exist_ok=True)
        self.events_path = os.path.join(opts.workdir, "events.jsonl")
        self.etcd: EmbeddedEtcd | None = None
        self.nodes: list[Node] = []
        self.known_procs: dict[int, psutil.Process] = {}
        self.step_events: list[dict[str, Any]] = []
        self.completed_step = 0
        self.current_round: int | None = None
        self.world_size: int | None = None
        self.t0 = 0.0
        self.done_event: dict[str, Any] | None = None
        self._last_scan = 0.0
        self._last_status = 0.0
        self._status_client: Any = None

    # -- actions ------------------------------------------------------------------------------------------

    def _print(self, text: str) -> None:
        self.opts.out.write(text + "\n")
        self.opts.out.flush()

    def start_node(self) -> Node:
        assert self.etcd is not None
        index = len(self.nodes)
        rdzv = self.cfg.rendezvous
        cmd = [sys.executable, "-m", "elastic_train", "--log-format", "json", "run"]
        if self.opts.config_path:
            cmd.append(os.path.abspath(self.opts.config_path))
        cmd += [
            "--nodes", f"{rdzv.min_nodes}:{rdzv.max_nodes}",
            "--endpoint", self.etcd.endpoint,
            "--run-id", self.run_id,
            "--local-addr", "127.0.0.1",
        ]  # fmt: skip
        cmd += worker_overrides_argv(self.opts.overrides)
        if self.opts.entry:
            cmd += ["--entry", *self.opts.entry]
        env = dict(os.environ)
        if self.opts.entry and self.cfg.train.audit_dir:
            env[ENV_AUDIT_DIR] = self.cfg.train.audit_dir
        # All nodes share this machine's cores: one intra-op thread pool per worker would oversubscribe them.
        workers = rdzv.max_nodes * rdzv.nproc_per_node
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        env.update(
            {
                ENV_EVENTS: self.events_path,
                ENV_NODE_ID: f"node-{index}",
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONUNBUFFERED": "1",
                "ELASTIC_TRAIN_LOG_FORMAT": "json",
            }
        )
        log_path = os.path.join(self.opts.workdir, f"node-{index}.log")
        with open(log_path, "ab") as logf:
            logf.write(f"$ {shlex.join(cmd)}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        node = Node(index=index, proc=proc, log_path=log_path, started_at=time.time())
        self.nodes.append(node)
        self._remember(proc.pid)
        return node

    def _remember(self, pid: int) -> None:
        for p in tree(pid):
            self.known_procs.setdefault(p.pid, p)

    def fire(self, fault: Fault) -> None:
        """Inject ``fault`` now and record when and where in the run it happened."""
        fault.fired_at = time.time()
        fault.fired_step = self.completed_step
        fault.fired_round = self.current_round
        node = self.nodes[fault.node] if fault.node is not None else None
        if node is not None:
            self._remember(node.proc.pid)
        action = self.opts.actions.get(fault.kind) or getattr(self, "_" + fault.kind.replace("-", "_"))
        action(fault, node)
        self._print(
            f"!! {fault.label}: injected after step {self.completed_step} (round {self.current_round})"
        )

    def _kill_node(self, fault: Fault, node: Node) -> None:
        fault.extra["pids"] = signal_tree(node.proc.pid, signal.SIGKILL)
        node.killed = True

    def _kill_worker(self, fault: Fault, node: Node) -> None:
        workers = [p for p in tree(node.proc.pid)[1:] if _is_worker(p)]
        if workers:
            workers[0].kill()
            fault.extra["pids"] = [workers[0].pid]

    def _hang_node(self, fault: Fault, node: Node) -> None:
        fault.extra["pids"] = signal_tree(node.proc.pid, signal.SIGSTOP)
        node.stopped = True

    def _resume_node(self, fault: Fault, node: Node) -> None:
        fault.extra["pids"] = signal_tree(node.proc.pid, signal.SIGCONT)
        node.stopped = False

    def _add_node(self, fault: Fault, _node: None) -> None:
        fault.extra["new_node"] = self.start_node().index

    def _restart_etcd(self, fault: Fault, _node: None) -> None:
        assert self.etcd is not None
        t = time.monotonic()
        self.etcd.restart(down_for=1.0)
        fault.extra["down_s"] = round(time.monotonic() - t, 3)
        fault.detected_at = time.time()

    # -- observation --------------------------------------------------------------------------------------

    def on_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        rnd = e.get("round")
        if kind in ("started", "resumed") and rnd is not None:
            for f in self.opts.faults:
                if f.fired_at is None or f.fired_round is None or rnd <= f.fired_round:
                    continue
                if kind == "resumed" and f.resumed_from is None:
                    f.resumed_from = e.get("from_step")
                    f.source = e.get("source")
        if kind == "resumed":
            self._print(
                f"   resumed round {rnd} at world size {e.get('world_size')} from step {e.get('from_step')}"
                f" ({e.get('source')})"
            )
        elif kind == "step":
            self.step_events.append(e)
            step = int(e["step"])
            self.completed_step = max(self.completed_step, step)
            self.current_round, self.world_size = rnd, e.get("world_size")
            for f in self.opts.faults:
                if (
                    f.fired_at is not None
                    and f.resumed_at is None
                    and f.fired_round is not None
                    and rnd is not None
                    and rnd > f.fired_round
                ):
                    f.resumed_at = float(e["time"])
                    f.resumed_world_size = e.get("world_size")
                    self._print(
                        f"   {f.label}: training again at world size {f.resumed_world_size} after "
                        f"{f.resumed_at - (f.fired_at or 0):.2f}s, {f.steps_redone} step(s) redone"
                    )
            if step % max(1, self.cfg.train.log_every) == 0 or step == self.cfg.train.steps:
                loss = e.get("loss")
                sps = e.get("samples_per_s")
                self._print(
                    f"step {step:>5} | world {e.get('world_size')} | round {rnd} | "
                    f"loss {loss if loss is None else f'{loss:.4f}'} | "
                    f"{'-' if sps is None else f'{sps:,.0f}'} samples/s"
                )
        elif kind == "done":
            self.done_event = e

    def watch_rendezvous(self) -> None:
        """Mark faults detected once etcd shows the rendezvous reacting (new round, joiner, lost member)."""
        pending = [
            f for f in self.opts.faults
            if f.fired_at is not None and f.detected_at is None and f.fired_round is not None
        ]  # fmt: skip
        now = time.monotonic()
        if not pending or now - self._last_status < STATUS_INTERVAL or self.etcd is None:
            return
        self._last_status = now
        from elastic_train.etcd.client import connect
        from elastic_train.etcd.errors import EtcdError
        from elastic_train.rendezvous.status import read_status

        try:
            if self._status_client is None:
                self._status_client = connect(self.etcd.endpoint, timeout=2.0)
            status = read_status(self._status_client, self.run_id)
        except EtcdError:
            return
        seen = time.time()
        for f in pending:
            assert f.fired_round is not None
            if status.round > f.fired_round or status.state in ("restarting", "failed"):
                f.detected_at = seen
                self._print(f"   {f.label}: rendezvous reacted after {seen - (f.fired_at or seen):.2f}s "
                            f"({status.state}, round {status.round})")  # fmt: skip

    def _all_exited(self) -> bool:
        return all(n.proc.poll() is not None or n.killed or n.stopped for n in self.nodes)

    # -- the job ------------------------------------------------------------------------------------------

    def run(self) -> Summary:
        """Run the job to the end (or the timeout) and return its summary; always cleans up."""
        summary = Summary(run_id=self.run_id, steps=self.cfg.train.steps, faults=self.opts.faults)
        tail = EventTail(self.events_path)
        try:
            self.etcd = EmbeddedEtcd(data_dir=os.path.join(self.opts.workdir, "etcd")).start()
            self._print(f"etcd {self.etcd.version} on {self.etcd.endpoint}; run id {self.run_id}")
            self.t0 = time.time()
            for _ in range(self.opts.nodes):
                self.start_node()
            self._print(
                f"started {self.opts.nodes} nodes (min {self.cfg.rendezvous.min_nodes}, "
                f"max {self.cfg.rendezvous.max_nodes}); logs in {self.opts.workdir}"
            )
            deadline = time.monotonic() + self.opts.timeout
            while True:
                for e in tail.poll():
                    self.on_event(e)
                for f in self.opts.faults:
                    if f.fired_at is None and self.completed_step >= f.step and self.step_events:
                        self.fire(f)
                self.watch_rendezvous()
                now = time.monotonic()
                if now - self._last_scan > 1.0:
                    self._last_scan = now
                    for n in self.nodes:
                        if n.proc.poll() is None and not n.stopped:
                            self._remember(n.proc.pid)
                if self._all_exited():
                    break
                if now > deadline:
                    self._print(f"!! timeout after {self.opts.timeout:.0f}s; stopping the job")
                    break
                time.sleep(POLL_INTERVAL)
            for e in tail.poll():
                self.on_event(e)
        finally:
            self.cleanup()
        summary.wall_s = time.time() - self.t0 if self.t0 else 0.0
        summary.completed_steps = self.completed_step
        summary.node_exit_codes = {f"node-{n.index}": n.proc.returncode for n in self.nodes}
        summary.succeeded = self.done_event is not None and any(n.proc.returncode == 0 for n in self.nodes)
        if self.step_events:
            summary.first_step_s = float(self.step_events[0]["time"]) - self.t0
            summary.final_loss = self.step_events[-1].get("loss")
            summary.world_size_timeline = world_size_timeline(self.step_events, self.t0)
        return summary

    def cleanup(self) -> None:
        """Stop every process this job started (stopped ones resumed first), etcd, and shared memory."""
        for n in self.nodes:
            if n.proc.poll() is None:
                self._remember(n.proc.pid)
                terminate_tree(n.proc.pid, grace=10.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=10)
        for p in self.known_procs.values():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if p.is_running():
                    p.send_signal(signal.SIGCONT)
                    p.kill()
        psutil.wait_procs(list(self.known_procs.values()), timeout=10)
        if self._status_client is not None:
            with contextlib.suppress(Exception):
                self._status_client.close()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        from elastic_train.checkpoint.memory import snapshot_files

        # Snapshots of nodes that were killed are never released by their workers.
        for path in snapshot_files(self.cfg.checkpoint.memory_dir, self.run_id):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _is_worker(p: psutil.Process) -> bool:
    """A process torchrun started as a worker (``python -m elastic_train.worker`` or ``elastic_train.standin``
    for a user's script; not the fork server)."""
    try:
        cmdline = p.cmdline()
        return "elastic_train.worker" in cmdline or "elastic_train.standin" in cmdline
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def write_summary(summary: Summary, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary.to_json(), f, indent=2)
        f.write("\n")


__all__ = ["LocalJob", "LocalOptions", "render_table", "write_summary"]
