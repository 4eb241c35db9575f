"""``etcd3``: torchrun's RendezvousHandler on the etcd v3 protocol (:mod:`elastic_train.rendezvous.protocol`).

What torchrun's agent does with it (torch 2.13, ``agent/server/api.py``):

- ``next_rendezvous()`` at start and on every worker-group restart; the returned store serves the agent's
  rank assignment and exit barrier; ``bootstrap_store_info`` becomes the workers' MASTER_ADDR/MASTER_PORT.
  With hot recovery on, a node joining a running job gets a provisional round of its own instead, and its
  workers join the job once they are built (:mod:`elastic_train.rendezvous.standby`).
- ``num_nodes_waiting()`` every monitor tick while workers are healthy; > 0 restarts the worker group. We
  answer from the watch cache: it turns positive when a member's lease expires (kill -9, SIGSTOP), a member
  re-joins (its workers failed) or a newcomer waits.
- ``num_nodes_waiting()`` is also where a node cut off from the run fences itself
  (:mod:`elastic_train.rendezvous.fence`): its lease is gone, or etcd is silent while its workers are
  blocked, so it answers 1 and torchrun stops the workers and re-joins.
- ``shutdown()`` when the agent leaves other than by a signal: the run is closed (late agents leave cleanly)
  and the lease revoked so peers see the departure at once.
- SIGTERM (a preemption, a drain, a deleted pod): before torchrun's own handler stops the workers, the node
  says in etcd that it leaves (:mod:`elastic_train.rendezvous.leave`): a clean leave, not a failure.

Before its first round a node checks the run's identity (:mod:`elastic_train.rendezvous.identity`): the
settings the launcher left in ``ELASTIC_TRAIN_JOB_IDENTITY``, or for plain torchrun the node range and
processes per node. A node turned away (other settings, a finished or failed run) prints one line and exits
with status 2, having written nothing the job would notice. Workers report their outcome through
:mod:`elastic_train.rendezvous.outcome`: a non-retryable failure closes the run as failed instead of
restarting the worker group.

Store: every agent hosts a small TCPStore from its first rendezvous and advertises its port in its node key;
the round's rank 0 store, wrapped in a per-round PrefixStore, is the agent store. Workers do not share it
(``use_agent_store`` is False): rank 0 picks a fresh MASTER_PORT each round, so no gloo/c10d bootstrap state
survives from one worker group to the next.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from elastic_train.envvars import ENV_OUTCOME_DIR, ENV_ROUND
from elastic_train.errors import ConfigError
from elastic_train.etcd.client import Etcd
from elastic_train.log import bind_context, get_logger
from elastic_train.metrics.agent import count_fence
from elastic_train.procs import scratch_dir
from elastic_train.rendezvous.errors import JobFailed, RendezvousClosed, RunFinished, RunRefused
from elastic_train.rendezvous.fence import Fence
from elastic_train.rendezvous.hot import HotPath
from elastic_train.rendezvous.identity import JobIdentity, identity_from_environ, torchrun_settings
from elastic_train.rendezvous.leave import LeaveOnSignal, announce
from elastic_train.rendezvous.observe import RunObserver
from elastic_train.rendezvous.outcome import (
    clear_outcomes,
    exit_ran_s,
    exit_report,
    read_outcomes,
    script_clock,
    trained,
)
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings, RoundResult
from elastic_train.rendezvous.standby import Standby

log = get_logger(__name__)

BACKEND_NAME = "etcd3"

#: Seconds an agent waits for the round's rank-0 store (connect + bootstrap keys) before re-joining.
STORE_TIMEOUT = 30.0


class Etcd3RendezvousHandler(RendezvousHandler):
    """torchrun rendezvous on etcd v3 (lease liveness, watch-driven membership, CAS rounds).

    Args:
        etcd: a connected :class:`~elastic_train.etcd.client.Etcd`.
        settings: run id, node range, lease TTL, settle window, join timeout, failure budget.
        local_addr: address peers and workers reach this node at (``--local-addr``; else the FQDN).
        store_timeout: the store timeout in seconds (rdzv-conf ``read_timeout``).
        metrics_port: serve Prometheus metrics on this port (:mod:`.observe`; 0: a free one; None: none).

    Raises:
        ConfigError: the metrics port cannot be served.
    """

    def __init__(
        self,
        etcd: Etcd,
        settings: ProtocolSettings,
        local_addr: str | None = None,
        store_timeout: float = STORE_TIMEOUT,
        metrics_port: int | None = None,
    ) -> None:
        self._etcd = etcd
        self._store_timeout = timedelta(seconds=store_timeout)
        self._settings = settings
        self._addr = local_addr or socket.getfqdn()
        self._server: dist.TCPStore | None = None
        self._clients: dict[tuple[str, int], dist.TCPStore] = {}
        self._participant: Participant | None = None
        self._fence: Fence | None = None
        self._closed_by_us = False
        if settings.identity is None:
            settings.identity = local_identity(settings)
        self._outcomes = scratch_dir("outcome")
        os.environ[ENV_OUTCOME_DIR] = self._outcomes
        self._observer: RunObserver | None = None
        if metrics_port is not None:
            self._observer = RunObserver(lambda: self._participant, self._outcomes, settings)
            try:
                self._observer.start(metrics_port, local_addr)
            except OSError as exc:
                raise ConfigError(
                    f"metrics_port {metrics_port} cannot be served: {exc.strerror or exc} (another agent on "
                    "this machine? give each its own port, or 0 for a free one)"
                ) from exc
        self._join_lock = threading.Lock()
        self._leave_on_signal = LeaveOnSignal(self._leave)
        self._hot: HotPath | None = None
        self._standby: Standby | None = None
        if settings.hot:
            self._hot = HotPath(lambda: self.participant, self._bootstrap, self._join_lock)
            self._standby = Standby(
                self._hot,
                lambda: self.participant,
                lambda: self._server,
                self._addr,
                lambda: self._fence.arm() if self._fence is not None else None,
                settings.join_timeout,
            )

    # -- RendezvousHandler --------------------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def participant(self) -> Participant:
        if self._participant is None:
            self._server = dist.TCPStore(
                self._addr,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=self._store_timeout,
            )
            self._participant = Participant(
                self._etcd, self._settings, addr=self._addr, store_port=self._server.port
            )
            self._participant.script_clock = lambda: script_clock(self._outcomes)
            self._fence = Fence(self._participant, self._outcomes)
            self._fence.start_gate()
            if self._hot is not None:
                self._hot.blocked = self._fence.workers_blocked
        return self._participant

    def next_rendezvous(self) -> RendezvousInfo:
        """The next round including this node.

        Raises:
            RunFinished: the run finished without this node (status 0, one line).
            RunRefused: this node must not take part, or the run failed (status 2, one line).
            FailureBudgetExhausted: the run's failure budget is spent (status 1, one line).
        """
        try:
            self._end_if_workers_gave_up()
            return self._next_rendezvous()
        except RunRefused as exc:
            _say(f"elastic-train: error: {exc.message}")
            raise
        except RendezvousClosed as exc:
            # torch's agent returns None on a graceful-exit error and its launcher then dereferences it
            # (torch 2.13): leave as a SystemExit, which both let through after stopping the workers and
            # shutting this handler down.
            _say(f"elastic-train: {exc}")
            raise RunFinished(str(exc)) from None

    def _end_if_workers_gave_up(self) -> None:
        """Close the run as failed when a worker of the last group failed with a non-retryable error; else
        give the next join this node's report of how its workers exited (the start-up failure rule)."""
        outcomes = read_outcomes(self._outcomes)
        failed = [o for o in outcomes if o["state"] == "failed"]
        report = exit_report(outcomes)
        clear_outcomes(self._outcomes)
        if self._participant is None:
            return
        self._participant.failure_report = (
            {
                "exit_code": report[0],
                "error": report[1],
                "trained": trained(self._outcomes),
                "ran_s": exit_ran_s(outcomes),
            }
            if report
            else None
        )
        if not failed:
            return
        message = str(failed[0].get("message") or "a worker failed with an error no restart can fix")
        log.error(
            "worker_failed_for_good", run_id=self._settings.run_id, rank=failed[0].get("rank"), error=message
        )
        self._participant.close("failed", message)
        self._closed_by_us = True
        raise JobFailed(f"run {self._settings.run_id} failed: {message}")

    def _next_rendezvous(self) -> RendezvousInfo:
        # A round the hot path's thread joined after it gave up (the fence fired during its join) is this
        # path's: joining again, or starting on standby, would leave its other members forming a group with
        # workers that never come. The lock waits for such a join still in flight.
        with self._join_lock:
            handoff = self._hot.take_handoff() if self._hot is not None else None
        if handoff is None and self._standby is not None:  # a node joining a running job builds first
            standby = self._standby.start()
            if standby is not None:
                return standby
        with self._join_lock:
            result, info = self._join_round(handoff)
        if self._hot is not None:
            self._hot.started(result)
        return info

    def _join_round(self, handoff: RoundResult | None = None) -> tuple[RoundResult, RendezvousInfo]:
        while True:
            result, handoff = handoff or self.participant.join(), None
            try:
                store, info = self._bootstrap(result)
            except (RuntimeError, dist.DistStoreError) as exc:  # rank 0 vanished between close and connect
                log.warning("rendezvous_store_unreachable", round=result.round, error=str(exc))
                continue
            os.environ[ENV_ROUND] = str(result.round)
            assert self._fence is not None
            self._fence.arm()
            bind_context(round=result.round, node=self.participant.node_id)
            log.info(
                "rendezvous_complete",
                round=result.round,
                rank=result.rank,
                world_size=result.world_size,
                master_addr=info.master_addr,
                master_port=info.master_port,
            )
            return result, RendezvousInfo(store, result.rank, result.world_size, info)

    def _bootstrap(self, result: RoundResult) -> tuple[Any, RendezvousStoreInfo]:
        rank0 = result.members[0]
        if rank0 == self.participant.node_id:
            assert self._server is not None
            base: dist.Store = self._server
        else:
            node = result.nodes.get(rank0) or {}
            host, port = str(node.get("addr")), int(node.get("store_port") or 0)
            base = self._clients.get((host, port)) or dist.TCPStore(
                host, port, is_master=False, timeout=self._store_timeout
            )
            self._clients[(host, port)] = base
        store = dist.PrefixStore(f"elastic_train/round/{result.round}/", base)
        info = RendezvousStoreInfo.build(result.rank, store, local_addr=self._addr)
        return store, info

    def is_closed(self) -> bool:
        return self.participant.is_closed()

    def set_closed(self) -> None:
        if self._participant is not None and self._participant.refused:
            return
        outcomes = read_outcomes(self._outcomes)
        failed = [o for o in outcomes if o["state"] == "failed"]
        steps = [o["step"] for o in outcomes if o["state"] == "finished" and isinstance(o.get("step"), int)]
        if failed:
            self.participant.close("failed", str(failed[0].get("message") or "a worker failed"))
        else:
            self.participant.close("finished", step=max(steps) if steps else None)
        self._closed_by_us = True

    def num_nodes_waiting(self) -> int:
        if self._participant is None:
            return 0
        self._leave_on_signal.arm()  # torchrun (re-)installs its SIGTERM handler when it starts workers
        hot = self._hot is not None and self._hot.engaged()
        if self._standby is not None and self._standby.monitor(hot):
            return 0  # standby workers build, then the node joins at the running job's step boundary
        if self._fence is not None:
            reason = self._fence.check(lease_loss_handled=hot)
            if reason is not None:
                count_fence(reason)
                if self._hot is not None:  # one path stops the workers: torchrun's
                    self._hot.give_up(f"this node was fenced ({reason})")
                return 1  # torchrun stops the workers and re-joins (see elastic_train.rendezvous.fence)
        if hot:
            return 0  # the workers re-form in-process; the hot path's thread runs the round
        return self._participant.num_waiting()

    def _leave(self, reason: str) -> None:
        """SIGTERM: leave the run cleanly (:mod:`elastic_train.rendezvous.leave`); torchrun then stops the
        workers and the agent exits by the signal."""
        if self._participant is not None and not self._participant.refused:
            announce(self._participant, reason)

    def shutdown(self) -> bool:
        if self._observer is not None:
            self._observer.close()
        if self._hot is not None:
            self._hot.close()
        try:
            if self._participant is not None:
                try:
                    if not self._participant.refused:  # a refused node must not close another job's run
                        self.set_closed()
                finally:
                    self._participant.leave()
        finally:
            if self._fence is not None:
                self._fence.close()
            shutil.rmtree(self._outcomes, ignore_errors=True)
        return True


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def local_identity(settings: ProtocolSettings) -> JobIdentity:
    """This node's identity: the job settings ``elastic-train run`` left in the environment, or what torchrun
    knows (node range and, read from torchrun's launch config, processes per node).

    Raises:
        ConfigError: the environment holds a malformed identity.
    """
    try:
        ident = identity_from_environ(os.environ)
    except ValueError as exc:
        raise ConfigError(f"job identity in the environment: {exc}") from exc
    if ident is not None:
        return ident
    return JobIdentity(torchrun_settings(settings.min_nodes, settings.max_nodes, _torchrun_nproc_per_node()))


def _torchrun_nproc_per_node() -> int | None:
    """``nproc_per_node`` of the torchrun launch creating this handler, or ``None`` outside one.

    torch passes a handler only the rendezvous parameters; the worker count per node lives in the
    ``LaunchConfig`` of ``launch_agent``, the caller that creates the handler.
    """
    from torch.distributed.launcher.api import LaunchConfig

    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("config")
        if isinstance(config, LaunchConfig):
            return int(config.nproc_per_node)
        frame = frame.f_back  # type: ignore[assignment]
    return None
