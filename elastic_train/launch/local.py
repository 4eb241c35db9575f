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
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import psutil

from elastic_train.config import JobConfig
from elastic_train.envvars import ENV_AUDIT_DIR, ENV_EVENTS, ENV_NODE_ID, ENV_START_BARRIER
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster
from elastic_train.launch.faults import (
    CLUSTER_KINDS,
    COLLISION_KINDS,
    KINDS,
    SILENT_KINDS,
    Fault,
    FaultRecord,
    due,
)
from elastic_train.launch.netlink import SilentLink
from elastic_train.launch.run import worker_overrides_argv
from elastic_train.launch.summary import Summary, render_table, world_size_timeline
from elastic_train.log import get_logger
from elastic_train.procs import signal_tree, start_ms, terminate_tree, tied, tree, wait_gone

if TYPE_CHECKING:
    from elastic_train.etcd.client import Etcd

log = get_logger(__name__)

#: Seconds between two looks at the event stream and the processes.
POLL_INTERVAL = 0.1
#: Seconds between two reads of the rendezvous state while a fault waits to be detected.
STATUS_INTERVAL = 0.1
#: Seconds a killed etcd leader stays down before it is started again (``kill-etcd-leader``).
LEADER_DOWN_SECONDS = 3.0
#: Seconds two of three etcd members stay stopped (``etcd-quorum-loss``).
QUORUM_LOSS_SECONDS = 4.0
#: A ``partition-etcd`` fault heals once the others trained this many seconds without the node ...
PARTITION_AFTER_RESUME = 2.0
#: ... or after this many seconds at most (default of ``LocalOptions.partition_s``).
PARTITION_SECONDS = 12.0
#: Period of a ``slow-node`` fault's stop/continue cycle: the workers run ``period / factor`` of each, and
#: a step longer than it is slowed by about the factor. The processes under the agent are looked up again
#: at every period: one started in between (a restarted worker, the agent's one-second health probe) is
#: slowed from its first period, as on a node whose hardware is slow (:mod:`elastic_train.launch.slowdown`).
SLOW_PERIOD = 0.1


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
    actions: dict[str, Action] = field(default_factory=dict)
    """Extra fault kinds (name → action), e.g. storage faults in the chaos suite."""
    etcd_members: int = 1
    """Members of the job's etcd: 1, or 3/5 for a cluster (the nodes get the endpoint list)."""
    partition_s: float = PARTITION_SECONDS
    """Most seconds a ``partition-etcd`` fault lasts (it heals sooner, once the others trained without the
    node for :data:`PARTITION_AFTER_RESUME` seconds)."""
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
    links: list[SilentLink] = field(default_factory=list)
    """The node's own links to the etcd members (jobs with a ``partition-etcd`` fault only)."""
    owner: tuple[int, int] | None = None
    """The node process's (PID, start time in ms): the owner its workers name their memory snapshots by."""


Action = Callable[[FaultRecord, Node | None], None]
"""Injects a fault (the node it names, if any) and records kind-specific facts in ``record.extra``."""


def _on_node(action: Callable[[FaultRecord, Node], None]) -> Action:
    """An action of a kind that names a node (:data:`~elastic_train.launch.faults.KINDS`)."""

    def act(record: FaultRecord, node: Node | None) -> None:
        assert node is not None, f"{record.label}: names no node"
        action(record, node)

    return act


class LocalJob:
    """One run of ``elastic-train local``; call :meth:`run` once."""

    def __init__(self, cfg: JobConfig, opts: LocalOptions) -> None:
        self.cfg = cfg
        self.opts = opts
        self.run_id = cfg.rendezvous.run_id
        os.makedirs(opts.workdir, exist_ok=True)
        self.events_path = os.path.join(opts.workdir, "events.jsonl")
        self.etcd: EmbeddedEtcd | EtcdCluster | None = None
        self._later: list[tuple[float, Callable[[], None]]] = []
        self.nodes: list[Node] = []
        self.known_procs: dict[int, psutil.Process] = {}
        self.step_events: list[dict[str, Any]] = []
        self.completed_step = 0
        self.current_round: int | None = None
        self.world_size: int | None = None
        self.t0 = 0.0
        self.done_event: dict[str, Any] | None = None
        #: Step of another run's checkpoint (``--resume-from``) this job started from; ``None``: from scratch.
        self.resumed_from_step: int | None = None
        #: The run's rendezvous state read just before etcd stopped (why it failed, if it did).
        self.final_status: Any = None
        self._last_scan = 0.0
        self._last_status = 0.0
        self._status_client: Etcd | None = None
        #: Set when the job ends: ``slow-node`` cycles continue their workers and stop.
        self._ending = threading.Event()
        self._slowing: list[threading.Thread] = []
        #: The slow-node drivers of each node (by index): stopped while their node hangs.
        self._drivers: dict[int, list[subprocess.Popen[str]]] = {}
        #: Nodes started by collision faults (same run id, other settings), with their fault.
        self.intruders: list[tuple[FaultRecord, Node]] = []
        #: What happened to each planned fault, in plan order.
        self.records = [FaultRecord(fault=f) for f in opts.faults]
        #: How each kind of fault is injected (``opts.actions`` add kinds or replace built-in ones).
        self.actions: dict[str, Action] = {
            "kill-node": _on_node(self._kill_node),
            "kill-worker": _on_node(self._kill_worker),
            "preempt-node": _on_node(self._preempt_node),
            "hang-node": _on_node(self._hang_node),
            "resume-node": _on_node(self._resume_node),
            "add-node": self._add_node,
            "restart-etcd": self._restart_etcd,
            "kill-etcd-leader": self._kill_etcd_leader,
            "etcd-quorum-loss": self._etcd_quorum_loss,
            "collide-checkpoint": self._collide_checkpoint,
            "collide-nodes": self._collide_nodes,
            "partition-etcd": _on_node(self._partition_etcd),
            "slow-node": _on_node(self._slow_node),
            **opts.actions,
        }
        assert set(KINDS) <= set(self.actions), f"no action for {set(KINDS) - set(self.actions)}"

    # -- actions ------------------------------------------------------------------------------------------

    def _print(self, text: str) -> None:
        self.opts.out.write(text + "\n")
        self.opts.out.flush()

    def start_node(self, *, initial: bool = False) -> Node:
        """Start the next node; ``initial``: one of the nodes the job starts with, which enter their first
        rendezvous together (:data:`~elastic_train.envvars.ENV_START_BARRIER`)."""
        env = {}
        if initial:
            barrier = os.path.join(self.opts.workdir, "start-barrier")
            os.makedirs(barrier, exist_ok=True)
            env[ENV_START_BARRIER] = f"{barrier}:{self.opts.nodes}"
        node = self._spawn(len(self.nodes), f"node-{len(self.nodes)}", {}, env)
        self.nodes.append(node)
        return node

    def _spawn(
        self, index: int, name: str, extra: dict[str, Any], extra_env: dict[str, str] | None = None
    ) -> Node:
        """Start one ``elastic-train run`` agent (``extra``: overrides applied after the job's own;
        ``extra_env``: its environment's additions)."""
        assert self.etcd is not None
        rdzv = self.cfg.rendezvous
        links: list[SilentLink] = []
        endpoint = self.etcd.endpoint
        if any(f.kind == "partition-etcd" for f in self.opts.faults):  # each node reaches etcd its own way
            links = [SilentLink(member).start() for member in endpoint.split(",")]
            endpoint = ",".join(link.endpoint for link in links)
        cmd = [sys.executable, "-m", "elastic_train", "--log-format", "json", "run"]
        if self.opts.config_path:
            cmd.append(os.path.abspath(self.opts.config_path))
        cmd += [
            "--nodes", f"{rdzv.min_nodes}:{rdzv.max_nodes}",
            "--endpoint", endpoint,
            "--run-id", self.run_id,
            "--local-addr", "127.0.0.1",
        ]  # fmt: skip
        cmd += worker_overrides_argv(self.opts.overrides) + worker_overrides_argv(extra)
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
                ENV_NODE_ID: name,
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONUNBUFFERED": "1",
                "ELASTIC_TRAIN_LOG_FORMAT": "json",
                **(extra_env or {}),
            }
        )
        log_path = os.path.join(self.opts.workdir, f"{name}.log")
        with open(log_path, "ab") as logf:
            logf.write(f"$ {shlex.join(cmd)}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        try:
            owner: tuple[int, int] | None = (proc.pid, start_ms(proc.pid))
        except psutil.NoSuchProcess:  # gone already: it allocated nothing
            owner = None
        node = Node(
            index=index, proc=proc, log_path=log_path, started_at=time.time(), links=links, owner=owner
        )
        self._remember(proc.pid)
        return node

    def _remember(self, pid: int) -> None:
        for p in tree(pid):
            self.known_procs.setdefault(p.pid, p)

    def fire(self, record: FaultRecord) -> None:
        """Inject ``record``'s fault now and record when and where in the run it happened."""
        fault = record.fault
        record.fired_at = time.time()
        record.fired_step = self.completed_step
        record.fired_round = self.current_round
        node = self.nodes[fault.node] if fault.node is not None else None
        if node is not None:
            self._remember(node.proc.pid)
        self.actions[fault.kind](record, node)
        self._print(
            f"!! {fault.label}: injected after step {self.completed_step} (round {self.current_round})"
        )

    def _kill_node(self, record: FaultRecord, node: Node) -> None:
        record.extra["pids"] = signal_tree(node.proc.pid, signal.SIGKILL, walked=lambda: _signalled(record))
        node.killed = True

    def _preempt_node(self, record: FaultRecord, node: Node) -> None:
        """SIGTERM to the agent alone (what the kubelet sends a pod's main process): it leaves the run and
        stops its workers itself."""
        _signalled(record)
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGTERM)
        record.extra["pids"] = [node.proc.pid]

    def _kill_worker(self, record: FaultRecord, node: Node) -> None:
        workers = [p for p in tree(node.proc.pid)[1:] if _is_worker(p)]
        if workers:
            workers[0].kill()
            record.extra["pids"] = [workers[0].pid]

    def _hang_node(self, record: FaultRecord, node: Node) -> None:
        """SIGSTOP the agent and everything under it; a slowdown of the node is stopped first, so that it
        continues none of them while the node hangs."""
        self._signal_drivers(node, signal.SIGSTOP)
        record.extra["pids"] = signal_tree(node.proc.pid, signal.SIGSTOP, walked=lambda: _signalled(record))
        node.stopped = True

    def _resume_node(self, record: FaultRecord, node: Node) -> None:
        record.extra["pids"] = signal_tree(node.proc.pid, signal.SIGCONT)
        node.stopped = False
        self._signal_drivers(node, signal.SIGCONT)

    def _signal_drivers(self, node: Node, sig: int) -> None:
        for driver in self._drivers.get(node.index, []):
            if driver.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    driver.send_signal(sig)

    def _partition_etcd(self, record: FaultRecord, node: Node) -> None:
        """Silence the node's links to etcd until the others trained without it for a while (at most
        ``partition_s`` seconds); record when its workers were gone (``workers_gone_s``) and when the cut
        healed (``healed_s``), both from the cut."""
        workers = [p for p in tree(node.proc.pid)[1:] if _is_worker(p)]
        record.extra["pids"] = [p.pid for p in workers]
        for link in node.links:
            link.silence()
        cut = time.monotonic()

        def watch() -> None:
            # exited, or a zombie its agent has not reaped yet (an agent cut off from etcd reaps once the
            # cut heals): the workers' end, not their agent's next look
            if wait_gone([p.pid for p in workers], self.opts.partition_s):
                record.extra["workers_gone_s"] = round(time.monotonic() - cut, 3)

        threading.Thread(target=watch, name="partition-watch", daemon=True).start()

        def heal() -> None:
            trained_without = 0.0 if record.resumed_at is None else time.time() - record.resumed_at
            if trained_without < PARTITION_AFTER_RESUME and time.monotonic() - cut < self.opts.partition_s:
                self._after(0.1, heal)
                return
            for link in node.links:
                link.heal()
            record.extra["healed_s"] = round(time.monotonic() - cut, 3)

        self._after(0.1, heal)

    def _slow_node(self, record: FaultRecord, node: Node) -> None:
        """Slow the node's workers by ``factor`` (SIGSTOP for ``1 - 1/factor`` of every :data:`SLOW_PERIOD`,
        SIGCONT for the rest; every process under the agent: workers, their stand-ins, the fork server) for
        ``for`` seconds or until the job ends, by a driver process of its own
        (:mod:`elastic_train.launch.slowdown`); the agent is left alone (it keeps its lease: a slow node is
        not a lost one). Records ``factor``, ``for_s`` and, once it ends, the driver's report: the
        processes' PIDs, ``stopped_s`` (the time they were held) and ``ended_s``."""
        factor = record.fault.option("factor") or 2.0
        span = record.fault.option("for")
        record.extra.update(factor=factor, for_s=span, period_s=SLOW_PERIOD, pids=[])
        cmd = [
            sys.executable, "-m", "elastic_train.launch.slowdown", str(node.proc.pid),
            "--factor", str(factor), "--period", str(SLOW_PERIOD), *(["--for", str(span)] if span else []),
        ]  # fmt: skip

        def watch() -> None:
            # started by this thread, which outlives it: the kernel's parent-death signal (asked for by the
            # tied launcher) follows the thread that forked, not the process
            driver = subprocess.Popen(tied(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._drivers.setdefault(node.index, []).append(driver)
            if node.stopped:  # hung before its driver started
                driver.send_signal(signal.SIGSTOP)
            while driver.poll() is None and not self._ending.wait(0.1):
                pass
            if driver.poll() is None:
                driver.terminate()  # it continues what it holds, then reports
                driver.send_signal(signal.SIGCONT)  # (one stopped while its node hangs)
            try:
                out, err = driver.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                driver.kill()
                out, err = driver.communicate()
            lines = out.strip().splitlines()
            if driver.returncode == 0 and lines:
                record.extra.update(json.loads(lines[-1]))
            else:
                record.extra["error"] = (err.strip().splitlines() or [f"exit {driver.returncode}"])[-1]

        thread = threading.Thread(target=watch, name=f"slow-node-{node.index}", daemon=True)
        self._slowing.append(thread)
        thread.start()

    def _add_node(self, record: FaultRecord, _node: Node | None) -> None:
        record.extra["new_node"] = self.start_node().index

    def _cluster(self, record: FaultRecord) -> EtcdCluster:
        if not isinstance(self.etcd, EtcdCluster):
            raise RuntimeError(f"{record.kind} needs a multi-member etcd (etcd_members >= 3)")
        return self.etcd

    @staticmethod
    def _cluster_whole(cluster: EtcdCluster) -> None:
        """Start members an earlier etcd fault left down and resume stopped ones (without waiting: the
        job's loop must go on observing)."""
        for i, m in enumerate(cluster.members):
            if m.proc is None or m.proc.poll() is not None:
                cluster.start_member(i, wait=False)
            else:
                cluster.resume(i)

    def _kill_etcd_leader(self, record: FaultRecord, _node: Node | None) -> None:
        cluster = self._cluster(record)
        self._cluster_whole(cluster)
        leader = cluster.leader(timeout=30.0)
        t = time.monotonic()
        cluster.kill(leader)
        record.extra["member"] = leader

        def elected() -> None:  # off the loop: an election takes a second or two
            with contextlib.suppress(EtcdError):
                new = cluster.leader(timeout=30.0)
                record.detected_at = time.time()
                record.extra.update(new_leader=new, election_s=round(time.monotonic() - t, 3))

        threading.Thread(target=elected, name="etcd-election", daemon=True).start()

        def restart() -> None:
            m = cluster.members[leader]
            if m.proc is None or m.proc.poll() is not None:  # not already brought back by a later fault
                cluster.start_member(leader, wait=False)

        self._after(LEADER_DOWN_SECONDS, restart)

    def _etcd_quorum_loss(self, record: FaultRecord, _node: Node | None) -> None:
        cluster = self._cluster(record)
        self._cluster_whole(cluster)
        leader = cluster.leader(timeout=30.0)
        # The two followers: the leader, cut off from them, steps down and no member can serve until they
        # return. (A stopped leader would, once resumed, find its leases' deadlines passed while it slept.)
        stopped = [i for i in range(len(cluster.members)) if i != leader][:2]
        for i in stopped:
            cluster.pause(i)
        record.extra.update(members=stopped, seconds=QUORUM_LOSS_SECONDS)

        def resume() -> None:
            for i in stopped:
                cluster.resume(i)
            record.detected_at = time.time()

        self._after(QUORUM_LOSS_SECONDS, resume)

    def _after(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` from the job's loop ``seconds`` from now (dropped if the job ends first)."""
        self._later.append((time.monotonic() + seconds, action))

    def _run_due(self) -> None:
        now = time.monotonic()
        due_now = [a for t, a in self._later if t <= now]
        self._later = [(t, a) for t, a in self._later if t > now]
        for action in due_now:
            action()

    def _collide_checkpoint(self, record: FaultRecord, _node: Node | None) -> None:
        url = os.path.abspath(os.path.join(self.opts.workdir, "collision-checkpoints"))
        self._intrude(record, {"checkpoint.url": url})

    def _collide_nodes(self, record: FaultRecord, _node: Node | None) -> None:
        rdzv = self.cfg.rendezvous
        self._intrude(
            record, {"rendezvous.min_nodes": rdzv.min_nodes, "rendezvous.max_nodes": rdzv.max_nodes + 1}
        )

    def _intrude(self, record: FaultRecord, extra: dict[str, Any]) -> None:
        """Start a node with the job's run id and ``extra`` settings; :meth:`_settle_intruders` records how
        it was turned away."""
        node = self._spawn(len(self.intruders), f"intruder-{len(self.intruders)}", extra)
        self.intruders.append((record, node))
        record.extra["settings"] = {k: v for k, v in extra.items()}

    def _settle_intruders(self, wait: float) -> None:
        """Record each intruder's exit code and last line once it exited (waiting up to ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        for record, node in self.intruders:
            if "exit_code" in record.extra:
                continue
            code = node.proc.poll()
            while code is None and time.monotonic() < deadline:
                time.sleep(0.1)
                code = node.proc.poll()
            if code is None:
                continue
            record.extra["exit_code"] = code
            record.extra["seconds"] = round(time.time() - node.started_at, 2)
            record.extra["line"] = _last_plain_line(node.log_path)
            self._print(
                f"   {record.label}: exit {code} after {record.extra['seconds']}s: {record.extra['line']}"
            )

    def _restart_etcd(self, record: FaultRecord, _node: Node | None) -> None:
        assert isinstance(self.etcd, EmbeddedEtcd), "restart-etcd restarts a single-member etcd"
        t = time.monotonic()
        self.etcd.restart(down_for=1.0)
        record.extra["down_s"] = round(time.monotonic() - t, 3)
        record.detected_at = time.time()

    # -- observation --------------------------------------------------------------------------------------

    def on_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        rnd = e.get("round")
        if kind in ("started", "resumed") and rnd is not None:
            for f in self.records:
                if f.fired_at is None or f.fired_round is None or rnd <= f.fired_round:
                    continue
                if kind == "resumed" and f.resumed_from is None:
                    f.resumed_from = e.get("from_step")
                    f.source = e.get("source")
        if kind == "resumed" and e.get("source") == "resume_from" and isinstance(e.get("from_step"), int):
            step = int(e["from_step"])
            self.resumed_from_step = (
                step if self.resumed_from_step is None else min(self.resumed_from_step, step)
            )
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
            for f in self.records:
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
            f for f in self.records
            if f.fired_at is not None and f.detected_at is None and f.fired_round is not None
            and f.kind not in CLUSTER_KINDS  # they record their own end; etcd may not answer meanwhile
            and f.kind not in COLLISION_KINDS
        ]  # fmt: skip
        now = time.monotonic()
        if not pending or now - self._last_status < STATUS_INTERVAL or self.etcd is None:
            return
        if any(f.kind in CLUSTER_KINDS and f.fired_at and f.detected_at is None for f in self.records):
            return  # etcd is being broken on purpose: asking it now would stall this loop
        self._last_status = now
        from elastic_train.etcd.client import connect
        from elastic_train.etcd.errors import EtcdError
        from elastic_train.rendezvous.status import read_status

        try:
            if self._status_client is None:
                self._status_client = connect(self.etcd.endpoint, timeout=1.0)
            status = read_status(self._status_client, self.run_id)
        except EtcdError:
            return
        seen = time.time()
        for f in pending:
            assert f.fired_round is not None
            if f.kind in SILENT_KINDS:  # a slow node: detected once the run flags it (straggler/<node>)
                self._slow_flagged(f, status.stragglers, seen)
            elif status.round > f.fired_round or status.state in ("restarting", "failed"):
                f.detected_at = seen
                self._print(f"   {f.label}: rendezvous reacted after {seen - (f.fired_at or seen):.2f}s "
                            f"({status.state}, round {status.round})")  # fmt: skip

    def _slow_flagged(self, f: FaultRecord, stragglers: list[Any], seen: float) -> None:
        """Mark a ``slow-node`` fault detected once the run flags its node (node ids carry the agent's
        PID: ``host-PID-suffix``)."""
        assert f.fault.node is not None
        mark = f"-{self.nodes[f.fault.node].proc.pid}-"
        hit = next((s for s in stragglers if mark in s.node), None)
        if hit is not None:
            f.detected_at = seen
            f.extra["flagged_score"] = hit.score
            self._print(f"   {f.label}: flagged as slow after {seen - (f.fired_at or seen):.2f}s "
                        f"(score {hit.score:.2f}, {hit.state})")  # fmt: skip

    def _read_final_status(self) -> Any:
        """The run's lifecycle state in etcd (``None`` if etcd cannot say)."""
        from elastic_train.etcd.client import connect
        from elastic_train.etcd.errors import EtcdError
        from elastic_train.rendezvous.status import read_status

        if self.etcd is None:
            return None
        try:
            if self._status_client is None:
                self._status_client = connect(self.etcd.endpoint, timeout=2.0)
            return read_status(self._status_client, self.run_id)
        except EtcdError:
            return None

    def _all_exited(self) -> bool:
        return all(n.proc.poll() is not None or n.killed or n.stopped for n in self.nodes)

    # -- the job ------------------------------------------------------------------------------------------

    def run(self) -> Summary:
        """Run the job to the end (or the timeout) and return its summary; always cleans up."""
        from elastic_train.train.jsonl import JsonLinesTail

        summary = Summary(run_id=self.run_id, steps=self.cfg.train.steps, faults=self.records)
        tail = JsonLinesTail(self.events_path)
        try:
            data_dir = os.path.join(self.opts.workdir, "etcd")
            if self.opts.etcd_members > 1:
                self.etcd = EtcdCluster(self.opts.etcd_members, data_dir=data_dir).start()
            else:
                self.etcd = EmbeddedEtcd(data_dir=data_dir).start()
            self._print(f"etcd {self.etcd.version} on {self.etcd.endpoint}; run id {self.run_id}")
            self.t0 = time.time()
            for _ in range(self.opts.nodes):
                self.start_node(initial=True)
            self._print(
                f"started {self.opts.nodes} nodes (min {self.cfg.rendezvous.min_nodes}, "
                f"max {self.cfg.rendezvous.max_nodes}); logs in {self.opts.workdir}"
            )
            deadline = time.monotonic() + self.opts.timeout
            while True:
                for e in tail.poll():
                    self.on_event(e)
                # a fault due after the job finished tests nothing (and would hit its final checkpoint or its
                # exit barrier): it stays unfired
                if self.step_events and self.done_event is None:
                    for record in due(self.records, self.completed_step):
                        self.fire(record)
                self._run_due()
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
            self.final_status = self._read_final_status()
            self._settle_intruders(wait=15.0)
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
        self._ending.set()
        for thread in self._slowing:
            thread.join(timeout=5)
        for n in [*self.nodes, *(node for _, node in self.intruders)]:
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
        for n in [*self.nodes, *(node for _, node in self.intruders)]:
            for link in n.links:
                link.stop()
        if self._status_client is not None:
            with contextlib.suppress(Exception):
                self._status_client.close()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        # Snapshots of nodes that were killed are never released by their workers.
        owners = [n.owner for n in [*self.nodes, *(node for _, node in self.intruders)] if n.owner]
        release_snapshots(self.cfg.checkpoint.memory_dir, owners)


def release_snapshots(directory: str, owners: Iterable[tuple[int, int]]) -> list[str]:
    """Delete the memory snapshots in ``directory`` owned by the processes ``owners`` ((PID, start time in
    ms): this job's nodes); returns their paths.

    By owner, not by run id: another job on this machine may train under the same run id (a default one is
    the second it started, and tests fix theirs), and deleting its live snapshots loses its state: its
    workers go on writing to the unlinked files, and its next restore finds nothing and starts at step 0.
    """
    from elastic_train.checkpoint.shmfiles import owned_by

    removed = []
    for pid, started in owners:
        for path in owned_by(directory, pid, started):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def _last_plain_line(path: str) -> str:
    """The last line of a node log that is not a JSON log record (what the node said to a person)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("{")]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _signalled(record: FaultRecord) -> None:
    """The fault's clock starts when its signals go out, not before the walk of the node's process tree."""
    now = time.time()
    record.extra["tree_walk_s"] = round(now - (record.fired_at or now), 3)
    record.fired_at = now


def _is_worker(p: psutil.Process) -> bool:
    """A process torchrun started as a worker (``python -m elastic_train.worker`` or
    ``elastic_train.worker.standin`` for a user's script; not the fork server)."""
    try:
        cmdline = p.cmdline()
        return "elastic_train.worker" in cmdline or "elastic_train.worker.standin" in cmdline
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def write_summary(summary: Summary, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary.to_json(), f, indent=2)
        f.write("\n")


__all__ = ["LocalJob", "LocalOptions", "render_table", "write_summary"]
