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
with status 2, having written nothing the job would notice.

The handler talks to its workers through the node's directory (:mod:`elastic_train.node`): it writes the
assignment of each worker group it starts (the round), reads the workers' outcomes (a non-retryable
failure closes the run as failed instead of restarting the worker group), their step beats (the fence)
and their figures for the metrics an opt-in port serves (:mod:`elastic_train.rendezvous.observe`), and serves
the publish gate.

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
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
)

from elastic_train.envvars import ENV_NODE_DIR
from elastic_train.errors import ConfigError
from elastic_train.etcd.client import Etcd
from elastic_train.log import bind_context, get_logger
from elastic_train.node import AgentChannel, Assignment, Outcome
from elastic_train.procs import scratch_dir
from elastic_train.rendezvous.config import ProtocolSettings
from elastic_train.rendezvous.decide import exit_report, torchrun_report
from elastic_train.rendezvous.errors import JobFailed, RendezvousClosed, RunFinished, RunRefused
from elastic_train.rendezvous.exchange import RoundAbandoned, RoundStores, await_members
from elastic_train.rendezvous.fence import Fence
from elastic_train.rendezvous.hot import TICK, HotPath
from elastic_train.rendezvous.identity import JobIdentity, identity_from_environ, torchrun_settings
from elastic_train.rendezvous.leave import LeaveOnSignal, announce
from elastic_train.rendezvous.observe import RunObserver
from elastic_train.rendezvous.probation import Probation
from elastic_train.rendezvous.protocol import Participant
from elastic_train.rendezvous.records import RoundResult
from elastic_train.rendezvous.slownodes import EvictOrder, SlowNodes
from elastic_train.rendezvous.standby import Standby
from elastic_train.torchcompat import TorchrunAgent, torchrun_failures, torchrun_nproc_per_node

log = get_logger(__name__)

#: Rounds in a row a node's torchrun path abandons (a member gone before the rank exchange) before its agent
#: ends as torchrun's own exchange would end it (each such round found a member dead or asking for a newer
#: round; the next one forms without it).
ABANDONED_LIMIT = 10

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
        self._stores: RoundStores | None = None
        self._participant: Participant | None = None
        self._fence: Fence | None = None
        self._closed_by_us = False
        if settings.identity is None:
            settings.identity = local_identity(settings)
        self._node = AgentChannel(scratch_dir("node"))
        os.environ[ENV_NODE_DIR] = self._node.directory
        self._observer: RunObserver | None = None
        if metrics_port is not None:
            self._observer = RunObserver(lambda: self._participant, self._node, settings)
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
        self._slow = SlowNodes(
            lambda: self._participant,
            self._node,
            settings,
            self._on_evicted,
            lambda: self._hot is not None and self._hot.engaged(),
        )
        self._node_id: str | None = None
        self._eviction: EvictOrder | None = None
        self._evictions = 0
        self._evict_lock = threading.Lock()

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
        """This node in the run, made on first use with what hangs on it: the agent's store, the fence,
        and with hot recovery the standby starts and the hot path."""
        if self._participant is None:
            server = dist.TCPStore(
                self._addr,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=self._store_timeout,
            )
            participant = Participant(
                self._etcd,
                self._settings,
                addr=self._addr,
                store_port=server.port,
                node_id=self._node_id,
                script_clock=self._node.script_clock,
            )
            self._node_id = participant.node_id  # kept when it rejoins after an eviction
            stores = RoundStores(server, self._addr, self._store_timeout, participant.node_id)
            fence = Fence(participant, self._node)
            fence.start_gate()
            if self._settings.hot:
                standby = Standby(
                    participant, self._node, server, self._addr, fence, self._settings.join_timeout
                )
                self._standby = standby
                self._hot = HotPath(participant, self._node, fence, standby, stores, self._join_lock)
            self._stores, self._fence, self._participant = stores, fence, participant
            self._slow.start()
        return self._participant

    def next_rendezvous(self) -> RendezvousInfo:
        """The next round including this node.

        Raises:
            RunFinished: the run finished without this node (status 0, one line).
            RunRefused: this node must not take part, or the run failed (status 2, one line).
            FailureBudgetExhausted: the run's failure budget is spent (status 1, one line).
        """
        try:
            self._end_if_workers_finished()
            self._end_if_workers_gave_up()
            self._serve_probation()
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

    def _end_if_workers_finished(self) -> None:
        """Leave with the run when every worker of the last group finished it (the final checkpoint
        committed) while torchrun was stopping them for a change (this node fenced as its workers wrote
        the final checkpoint): the node waits in the round's exit barrier, where the other agents wait for
        it once their workers exit, then ends with status 0 (:class:`RunFinished`)."""
        step = self._node.finished()
        if self._participant is None or step is None:
            return
        run_id = self._settings.run_id
        line = f"run {run_id}: this node's workers finished at step {step}; leaving with the others"
        log.info("workers_finished_before_restart", run_id=run_id, step=step)
        agent = TorchrunAgent.find()
        if agent is not None:
            agent.exit_barrier()
        _say(f"elastic-train: {line}")
        raise RunFinished(line)

    def _end_if_workers_gave_up(self) -> None:
        """Close the run as failed when a worker of the last group failed with a non-retryable error; else
        give the next join this node's report of how its workers exited (the start-up failure rule)."""
        outcomes = self._node.take_outcomes()
        failed = [o for o in outcomes if o.state == "failed"]
        if self._participant is None:
            return
        self._participant.failure_report = self._exit_report(outcomes)
        if not failed:
            return
        message = failed[0].message or "a worker failed with an error no restart can fix"
        log.error("worker_failed_for_good", run_id=self._settings.run_id, rank=failed[0].rank, error=message)
        self._participant.close("failed", message)
        self._closed_by_us = True
        raise JobFailed(f"run {self._settings.run_id} failed: {message}")

    def _exit_report(self, outcomes: list[Outcome]) -> dict[str, Any] | None:
        """How this node's workers of the last group exited, for its next join (``decide.
        identical_startup_failure``), or None: they did not all fail alike, the hot path had given up on
        them (they exited because it did), or torchrun stopped them itself.

        What the workers said through the node's directory (the exception's type and where it was raised,
        the stand-in's exit code and last stderr line) comes first; for a script that says nothing, under
        plain torchrun, torchrun's own record of the exit codes and error files.
        """
        if self._hot is not None and self._hot.fallback is not None:
            return None
        report = exit_report(outcomes) if any(o.state == "exited" for o in outcomes) else None
        if report is None and not outcomes:
            exits = torchrun_failures()
            report = torchrun_report(exits) if exits else None
        if report is None:
            return None
        # a step committed in the round (the Trained mark), or counted by the workers' step beat (a script
        # of its own that beats): they failed after the round's first step
        mark = self._node.trained()
        trained = mark is not None and mark.round == self.participant.round
        trained = trained or any(b.steps > 0 for b in self._node.beats().values())
        return {
            "exit_code": report.code,
            "error": report.line,
            "signature": report.signature,
            "trained": trained,
            "ran_s": report.ran_s,
        }

    def _next_rendezvous(self) -> RendezvousInfo:
        # A round the hot path's thread joined after it gave up (the fence fired during its join) is this
        # path's: joining again, or starting on standby, would leave its other members forming a group with
        # workers that never come. The lock waits for such a join still in flight.
        participant = self.participant
        with self._join_lock:
            handoff = self._hot.take_handoff() if self._hot is not None else None
        if handoff is None and self._standby is not None and self._hot is not None:
            current = self._standby.eligible()  # a node joining a running job builds first
            if current is not None:
                self._hot.started(RoundResult(current, 0, 1, [participant.node_id], {}))
                if self._hot.local_workers > 0:  # under torchrun's agent: workers to hand a round to
                    return self._standby.begin(current, self._hot.local_workers)
        with self._join_lock:
            result, info = self._join_round(handoff)
        if self._hot is not None:
            self._hot.started(result)  # forgets the last group's re-formation first
        store_info = info.bootstrap_store_info
        assert store_info is not None
        self._node.assign(
            Assignment(
                round=result.round,
                node_rank=result.rank,
                nodes=result.world_size,
                master_addr=str(store_info.master_addr),
                master_port=int(store_info.master_port),
                reform=self._hot is not None,
            )
        )
        return info

    def _join_round(self, handoff: RoundResult | None = None) -> tuple[RoundResult, RendezvousInfo]:
        agent = TorchrunAgent.find()
        abandoned = 0
        while True:
            result, handoff = handoff or self.participant.join(), None
            try:
                assert self._stores is not None
                store, info = self._stores.bootstrap(result)
            except (RuntimeError, dist.DistStoreError) as exc:  # rank 0 vanished between close and connect
                log.warning("rendezvous_store_unreachable", round=result.round, error=str(exc))
                continue
            if agent is not None:
                # torchrun's rank exchange, next, blocks in the store on every member of the round for the
                # store's whole timeout and then ends this agent: a member that died after it joined (its
                # lease still alive when the round closed) would end every agent of the job. Wait for the
                # members' parts here, watching them, and form the next round when one is gone.
                try:
                    await_members(agent, self.participant, result, store, _pause)
                except (RoundAbandoned, RuntimeError) as exc:
                    abandoned += 1
                    log.warning("rendezvous_round_abandoned", round=result.round, reason=str(exc))
                    if abandoned > ABANDONED_LIMIT:  # torchrun ends this agent, as its own exchange would
                        raise RuntimeError(
                            f"{abandoned} rounds in a row lost a member before they formed ({exc})"
                        ) from exc
                    continue
            assert self._fence is not None
            self._fence.arm(self.participant.losses_at_round)
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

    def is_closed(self) -> bool:
        return self.participant.is_closed()

    def set_closed(self) -> None:
        if self._participant is not None and self._participant.refused:
            return
        outcomes = self._node.outcomes()
        failed = [o for o in outcomes if o.state == "failed"]
        steps = [o.step for o in outcomes if o.state == "finished" and o.step is not None]
        if failed:
            self.participant.close("failed", failed[0].message or "a worker failed")
        else:
            self.participant.close("finished", step=max(steps) if steps else None)
        self._closed_by_us = True

    def num_nodes_waiting(self) -> int:
        if self._node.finished() is not None:
            # every worker's training ended, the final checkpoint committed: whatever happens to the
            # membership now (this node's lease lost as they exit), they exit into torchrun's exit barrier,
            # where the other agents wait for this one
            return 0
        if self._eviction is not None:
            return 1  # evicted as slow: torchrun stops the workers and asks for the next round
        if self._participant is None:
            return 0
        self._leave_on_signal.arm()  # torchrun (re-)installs its SIGTERM handler when it starts workers
        hot = self._hot is not None and self._hot.engaged()
        if self._hot is not None:  # the others start joiners on standby only while every member says so
            self._participant.advertise_inproc(hot)
        if self._standby is not None and self._standby.waiting:
            return 0  # standby workers build, then the node joins at the running job's step boundary
        if self._fence is not None:
            reason = self._fence.check(lease_loss_handled=hot)
            if reason is not None:
                if self._hot is not None:  # one path stops the workers: torchrun's
                    self._hot.give_up(f"this node was fenced ({reason})")
                return 1  # torchrun stops the workers and re-joins (see elastic_train.rendezvous.fence)
        if hot:
            return 0  # the workers re-form in-process; the hot path's thread runs the round
        return self._participant.num_waiting()

    # -- slow nodes (elastic_train.rendezvous.slownodes) -----------------------------------------------------
    def _on_evicted(self, order: EvictOrder) -> None:
        """This node was evicted as slow (the slow-node thread): leave the round cleanly (the others re-form
        in-process without it, no failure budget spent); torchrun then stops the workers at its next look
        (:meth:`num_nodes_waiting`) and :meth:`next_rendezvous` serves the probation."""
        with self._evict_lock:
            if self._eviction is not None:
                return
            self._eviction = order
        p = self._participant
        if p is not None:
            announce(p, f"evicted as a slow node (score {order.score:g} at step {order.step})", final=False)
        if self._hot is not None:
            self._hot.give_up("this node was evicted as a slow node")

    def _serve_probation(self) -> None:
        """After an eviction: the node's probation (:mod:`elastic_train.rendezvous.probation`), then it
        rejoins on trial as a newcomer (its workers built on standby); or it leaves the job (status 0, one
        line).

        Raises:
            RunFinished: the node leaves, or the run finished meanwhile.
        """
        order = self._eviction
        if order is None:
            return
        self._evictions += 1
        self._retire()
        Probation(self._etcd, self._settings, order, self._evictions, self._slow, _say).serve()
        self._eviction = None

    def _retire(self) -> None:
        """Drop this node's participant and what hangs on it (it left the run): the next use makes new ones,
        under the same node id."""
        if self._hot is not None:
            self._hot.close()
        if self._fence is not None:
            self._fence.close()
        if self._participant is not None:
            self._participant.leave()
        self._hot = self._standby = self._fence = self._stores = self._participant = None

    def _leave(self, reason: str) -> None:
        """SIGTERM: leave the run cleanly (:mod:`elastic_train.rendezvous.leave`); torchrun then stops the
        workers and the agent exits by the signal."""
        if self._participant is not None and not self._participant.refused:
            announce(self._participant, reason)

    def shutdown(self) -> bool:
        self._slow.close()
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
            shutil.rmtree(self._node.directory, ignore_errors=True)
        return True


def _pause() -> None:
    """Between two looks at the members of a round before torchrun's rank exchange."""
    time.sleep(TICK)


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
    return JobIdentity(torchrun_settings(settings.min_nodes, settings.max_nodes, torchrun_nproc_per_node()))
