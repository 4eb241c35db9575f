"""Hot recovery, the worker's side: keep the process when the group's membership changes, re-form in-process.

One seam, used by the built-in worker and by :func:`elastic_train.elastic.run` alike: a training body is
called with the current :class:`~elastic_train.train.group.World`; when it fails because the group broke (a
collective error: a peer died) or the node's agent announced a membership change (the body stops at its
next step boundary, :meth:`~elastic_train.train.link.ProcessLink.boundary`), the :class:`Reformer` destroys
the group, tells the agent, waits for the next round's assignment (:mod:`elastic_train.node`), forms the new
group and calls the body again. The body rebuilds what depends on the group (DDP wrapper, checkpoint manager,
sampler shares) and restores: every member agrees on the newest step anyone holds and a failed step is redone.

A worker started on standby (its node joins a running job, :mod:`elastic_train.rendezvous.standby`) forms no
group of the job's before ``run()``: the model, optimizer and data are built by then, so it reports ready,
waits for the agent to admit it to the next round (the running job trains meanwhile), forms that round's
group and calls the body, which restores from a holder of the state.

What cannot be handled in-process goes the restart path (the exception propagates, the worker exits, torchrun
restarts the group): an exception of the user's code, a CUDA error that leaves the context unusable, a group
that does not re-form in time, an agent that gave up on the in-process path (a hung peer whose collective
cannot be aborted). Which error is which is :func:`classify_failure`.

On NCCL the same path works because the communicator is aborted, not the process: with hot recovery on,
torch's watchdog runs in ``CleanUpOnly`` mode (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, set before the first
NCCL group forms, :func:`~elastic_train.train.group.nccl_error_handling`): on a peer's failure or a
collective timeout it aborts the communicator and the error is raised on the training thread instead of
taking the process down; :func:`~elastic_train.train.group.shutdown` aborts what is left of the group, and
the next group forms on the same device (``device_id``: eager init).
The CUDA context, the model and the optimizer state stay on the device.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from elastic_train.log import get_logger
from elastic_train.train import group
from elastic_train.train.env import WorkerEnv
from elastic_train.train.errors import ReformAbandoned
from elastic_train.train.group import ENV_NCCL_ERROR_HANDLING, NCCL_CLEAN_UP_ONLY
from elastic_train.train.link import GroupChanged, ProcessLink, process_link, worker_env

log = get_logger(__name__)

T = TypeVar("T")

#: Seconds a worker waits for its agent to hand it the next round before it gives up (the restart path).
ASSIGNMENT_TIMEOUT = 120.0
#: Seconds between two looks of a gloo worker's watcher at its agent's request to cut the group's connections.
CUT_POLL = 0.05
#: Text of the errors gloo and c10d raise when a peer of a collective is gone.
_GROUP_ERROR_MARKERS = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "ProcessGroupGloo",
    "Socket Timeout",
)
#: Text of CUDA errors after which the context cannot be trusted (a sticky error: every later call on it
#: fails, or memory may hold garbage): torch's ``CUDA error: <cudaGetErrorString>`` (c10/cuda), NCCL's
#: ``unhandled cuda error`` / ``ncclUnhandledCudaError`` and its ``Cuda failure`` lines. Checked before the
#: markers below: a remote error whose log mentions a CUDA failure is a CUDA failure.
_CUDA_POISON_MARKERS = (
    "CUDA error",  # c10::cuda: "CUDA error: an illegal memory access was encountered", "... launch failure"
    "ncclUnhandledCudaError",  # getNcclErrorDetailStr
    "unhandled cuda error",  # ncclGetErrorString(ncclUnhandledCudaError)
    "Cuda failure",  # NCCL's own "Cuda failure 700 'an illegal memory access was encountered'"
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "ECC error",  # cudaErrorECCUncorrectable: "uncorrectable ECC error encountered"
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "device-side assert",
)
#: Text of NCCL errors that mean the group broke, not the device: a peer exited or its network failed
#: (``ncclRemoteError``, older NCCL's ``ncclSystemError`` "unexpected exit of a remote peer"), the
#: communicator was aborted (by the watchdog in ``CleanUpOnly`` mode, or by :func:`group.shutdown`), or the
#: watchdog timed a collective out (a peer that stopped). From ProcessGroupNCCL.cpp and NCCLUtils.cpp.
_NCCL_GROUP_MARKERS = (
    "ncclRemoteError",
    "remote process exited or there was a network error",  # ncclGetErrorString(ncclRemoteError)
    "ncclSystemError",
    "unhandled system error",  # ncclGetErrorString(ncclSystemError)
    "communicator was aborted",  # "NCCL communicator was aborted on rank N."
    "Watchdog caught collective operation timeout",
    "NCCL timeout in",  # C10D_CHECK_TIMEOUT of a non-blocking NCCL call
    "Process group watchdog thread terminated",  # the watchdog's exception, relayed
)


class RunEnded(SystemExit):
    """The run ended before this standby worker was admitted: it exits with status 0 (its agent says why)."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message


@dataclass(frozen=True, slots=True)
class Failure:
    """What a training error means for the group (:func:`classify_failure`)."""

    reform: bool
    """True: the group broke, re-form in-process; False: only a new process recovers (the restart path)."""
    reason: str
    """One line saying why (logged, and handed to the agent)."""


def classify_failure(exc: BaseException) -> Failure | None:
    """What ``exc`` (or an exception in its cause/context chain) means for the group, from its text.

    A broken group (gloo: a peer's connection failed; NCCL: a peer gone, a remote error, an aborted
    communicator, a watchdog timeout) re-forms in-process. A CUDA error that poisons the context (an illegal
    address, a launch failure, ECC, NCCL's "unhandled cuda error") needs a new process, whatever else the text
    says. Anything else (the user's code, an NCCL usage error) is None: not a group failure.
    """
    if isinstance(exc, GroupChanged):
        return Failure(True, "membership change announced")
    found: Failure | None = None
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause)
        line = _first_line(text) or type(cause).__name__
        if any(m in text for m in _CUDA_POISON_MARKERS):
            return Failure(False, f"CUDA context unusable: {line}")
        if found is None and isinstance(cause, RuntimeError):
            if "NCCL" in text or "nccl" in text:
                if any(m in text for m in _NCCL_GROUP_MARKERS):
                    found = Failure(True, line)
            elif any(m in text for m in _GROUP_ERROR_MARKERS):
                found = Failure(True, line)
        cause = cause.__cause__ or cause.__context__
    return found


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0][:300] if stripped else ""


def request_next_round(exc: BaseException) -> None:
    """Ask this worker's agent for the next round now when ``exc`` is a failure (or an announced change) of
    the group this process re-forms in-process; nothing otherwise.

    For the way out of the training function: what closes there (the checkpointer waits for the memory
    snapshot in flight, 0.03-0.05 s after a failure) then overlaps the agent's join of the next round
    instead of preceding it. :meth:`Reformer.reform` writes the same request again (the agent reads the
    latest per worker).
    """
    link = process_link()
    if not link.registered or link.channel is None or link.round is None:
        return
    failure = classify_failure(exc)
    if failure is not None and failure.reform:
        link.channel.request(link.round, failure.reason)


def group_failure(exc: BaseException) -> str | None:
    """Why ``exc`` means the process group broke (a reason to re-form in-process), or None when it does not
    (a user error, a CUDA error that poisons the context: those take the restart path; the latter says why
    in one ``cuda_context_lost`` event)."""
    failure = classify_failure(exc)
    if failure is None:
        return None
    if not failure.reform:
        log.error("cuda_context_lost", reason=failure.reason, action="restart: a new process, a new context")
        return None
    return failure.reason


class Reformer:
    """Re-forms this worker's process group in-process through its agent's channel.

    Args:
        link: this process's end of the node contract (its channel, its assignment).
        env: this worker's place in the current group.
        backend: process-group backend to re-form with.
    """

    def __init__(self, link: ProcessLink, env: WorkerEnv, backend: str = "auto") -> None:
        assert link.channel is not None
        self.link = link
        self.channel = link.channel
        self.env = env
        self.backend = backend
        self.reformations = 0
        #: Seconds this worker may wait for its admission when its agent started it on standby, else None.
        self.standby: float | None = link.standby_s
        self._watcher: threading.Thread | None = None

    @classmethod
    def of(cls, link: ProcessLink, env: WorkerEnv, backend: str = "auto") -> Reformer | None:
        """The reformer of a worker whose agent re-forms in-process, or None (hot recovery off, or not
        under an ``etcd3`` agent)."""
        if not link.reform or not env.round_is_global:
            return None
        return cls(link, env, backend)

    @property
    def registered(self) -> bool:
        """True once the agent was told this worker re-forms in-process (:meth:`register`)."""
        return self.link.registered

    def register(self, world: group.World) -> None:
        """Tell the agent this worker re-forms in-process.

        An NCCL group does only when torch's watchdog aborts a failed communicator and raises on the training
        thread (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, :func:`.group.nccl_error_handling`); in another mode
        an NCCL error ends the process (1, 3) or is never raised (0), and membership changes restart.
        """
        if world.backend == "nccl":
            mode = os.environ.get(ENV_NCCL_ERROR_HANDLING)
            if mode != NCCL_CLEAN_UP_ONLY:
                log.info(
                    "hot_recovery_off",
                    reason=f"{ENV_NCCL_ERROR_HANDLING}={mode}: an NCCL error does not reach the training "
                    f"thread with its communicator aborted (needs {NCCL_CLEAN_UP_ONLY}); changes restart",
                )
                return
        elif world.backend != "gloo":
            log.info("hot_recovery_off", reason=f"backend {world.backend}: membership changes restart")
            return
        gloo = world.backend == "gloo"
        if gloo and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_cuts, name="group-cut-watch", daemon=True)
            self._watcher.start()
        self.link.register(world.round, cut=gloo)

    def _watch_cuts(self) -> None:
        """Cut the gloo group's connections when the agent asks (a thread): the training thread is blocked in
        a collective with a peer that stopped (SIGSTOP, a hung machine), which gloo cannot abort and which
        never fails on its own. With its sockets shut down the collective raises, and the group re-forms
        in-process without that peer. The agent asks each node's workers, since a rank fails only on a
        connection it waits on."""
        done = -1
        while True:
            time.sleep(CUT_POLL)
            current = self.env.round
            if current != done and self.channel.cut_asked(current):
                done = current
                log.warning("group_links_cut", round=current, links=group.cut_links(current))

    def reform(self, reason: str, *, broken: bool = True) -> WorkerEnv:
        """Destroy the current group, ask for the next round, form its group; returns the new environment.

        ``broken``: the group failed (its connections are cut first, so that every peer still blocked in the
        failed collective fails too); False for a change announced at a step boundary.

        Raises:
            ReformAbandoned: the agent gave up on the in-process path or no round came in time.
        """
        started = time.perf_counter()
        # the agent joins the next round while this process takes the old group down
        self.channel.request(self.env.round, reason)
        group.shutdown(broken=broken)
        return self._form_next(reason, started, ASSIGNMENT_TIMEOUT)

    def admit(self) -> WorkerEnv:
        """A standby worker's entry into the running job: report ready (everything is built), wait for the
        round the agent joins for this node, form its group; returns the new environment.

        Raises:
            RunEnded: the run ended before this node was admitted (exit status 0).
            ReformAbandoned: the agent gave up on the admission, or none came in time.
        """
        started = time.perf_counter()
        self.channel.standby(self.env.round)
        if dist_initialized():  # a provisional group of this node's workers (the script's init() formed it):
            group.shutdown()  # taken down while the agent joins the round
        try:
            return self._form_next("admitted from standby", started, self.standby or ASSIGNMENT_TIMEOUT)
        finally:
            self.standby = None

    def _form_next(self, reason: str, started: float, timeout: float) -> WorkerEnv:
        old = self.env.round
        down = time.perf_counter() - started
        assignment = self.channel.wait_assignment(after=old, timeout=timeout)
        if assignment is None:
            ended = self.channel.ended()
            if ended is not None:
                raise RunEnded(ended)
            why = self.channel.fallback() or f"no new round within {timeout:.0f} s"
            raise ReformAbandoned(f"the group of round {old} could not re-form in-process: {why}")
        if not assignment.ranks:
            raise ReformAbandoned(f"the agent's assignment of round {assignment.round} names no ranks")
        waited = time.perf_counter() - started
        rank = assignment.rank(self.channel.local_rank)
        # what torchrun would have set for a worker of the new round, for code that reads it
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(assignment.world_size),
                "GROUP_RANK": str(assignment.node_rank),
                "ROLE_RANK": str(rank),
                "GROUP_WORLD_SIZE": str(assignment.nodes),
                "ROLE_WORLD_SIZE": str(assignment.world_size),
                "MASTER_ADDR": assignment.master_addr,
                "MASTER_PORT": str(assignment.master_port),
            }
        )
        self.link.adopt(assignment)
        self.env = WorkerEnv.from_environ(os.environ, assignment)
        world = group.init(self.backend, env=self.env)
        formation = dict(group.last_formation)
        self.reformations += 1
        self.register(world)
        log.info(
            "group_reformed",
            from_round=old,
            round=assignment.round,
            rank=rank,
            world_size=assignment.world_size,
            reason=reason,
            teardown_s=round(down, 3),  # the old group destroyed (its garbage collected first)
            wait_s=round(waited, 3),  # ... and the agent's assignment of the next round read
            store_s=round(formation.get("store_s", 0.0), 3),  # the new group's store open / reached
            pg_s=round(formation.get("pg_s", 0.0), 3),  # the process group formed (gloo's full mesh)
            seconds=round(time.perf_counter() - started, 3),
        )
        return self.env


def dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def change_pending() -> bool:
    """True when the agent announced that this worker's group re-forms at its next step boundary (a test's
    gate that holds a step stops holding then); False outside an agent that re-forms in-process."""
    return process_link().change_pending()


def run(body: Callable[[group.World], T], env: WorkerEnv, backend: str = "auto") -> T:
    """Call ``body(world)`` in the group formed from ``env``; re-form in-process and call it again each time
    the group breaks or re-forms, when the agent re-forms in-process (else this is ``body(init(...))``).

    Call it once the model, optimizer and data exist (it logs ``model_built``): a worker started on standby
    is admitted to the running job only now, so whatever is built before costs the job nothing.

    ``body`` must leave nothing of the old group behind when it raises (drop its DDP wrapper, close its
    checkpoint manager): the group is destroyed before the new one forms.

    Raises:
        ReformAbandoned: the group could not re-form in-process (the restart path takes over).
        RunEnded: a standby worker's run ended before it was admitted (exit status 0).
        Whatever ``body`` raises that is not a broken group.
    """
    reformer = Reformer.of(process_link(), env, backend)
    standby = reformer is not None and reformer.standby is not None
    log.info("model_built", standby=standby, pid=os.getpid())
    if reformer is None:
        return body(group.init(backend, env=env))
    if reformer.standby is not None:
        # The body's Checkpointer imports the checkpoint package on first use (0.1-0.3 s of imports): here,
        # before admission, that costs the running job nothing; after it, the join waits for it.
        import elastic_train.checkpoint  # noqa: F401

        # What the script built before admission (all of torch's modules, the model ...) is kept out of the
        # collection that takes its provisional group down (a full one walks it all: ~0.2 s, paid between
        # "ready" and forming the job's group).
        gc.freeze()
        reformer.admit()
        world = group.current_world()
    else:
        world = group.init(backend, env=env)
        reformer.register(world)
    try:
        while True:
            # What exists now (torch's modules, the model, the optimizer ...) outlives every group: keep it
            # out of the collections that drop a broken group's DDP wrapper before the group is destroyed.
            # A full collection walks it all: 1.2 s on a busy 2-core machine, 0.2 ms after the freeze.
            gc.freeze()
            try:
                return body(world)
            except Exception as exc:
                reason = group_failure(exc)
                if reason is None or not reformer.registered:  # the agent restarts unregistered workers
                    raise
                broken = not isinstance(exc, GroupChanged)
                log.warning("group_broken", round=world.round, reason=reason)
            reformer.reform(reason, broken=broken)
            world = group.current_world()
    finally:
        reformer.link.registered = False  # outside run() a step boundary never stops for a change


def elastic_run(train: Callable[[group.World], T], backend: str = "auto") -> T:
    """Run ``train(world)`` in the group torchrun's environment describes, and again in each group this
    process re-forms in-process after a membership change (``elastic_train.run``, docs/own-loop.md).

    ``train`` builds what depends on the group: the :class:`~elastic_train.train.checkpointer.Checkpointer`
    (in a ``with`` block, so that it is closed when the group breaks) and its ``restore()``, the DDP wrapper,
    the DataLoader iterator. Model, optimizer, dataset, sampler and DataLoader may live outside.

    Raises:
        ReformAbandoned: the group could not re-form in-process (the worker exits; torchrun restarts it).
        Whatever ``train`` raises that is not a broken group.
    """
    return run(train, worker_env(), backend)
