"""The durable writer: each rank writes its share of a step in the background, rank 0 commits it.

A step is written straight from its pinned shared-memory slot (or, without the memory tier, from a private
staging buffer the loop copies into). One attempt is collective on the manager's ``io`` group: every rank
writes its byte range (:func:`~elastic_train.checkpoint.policy.share_ranges`), an all-gather of the
records, then rank 0 builds the manifest and publishes it — manifest, ``latest``, retention — only as far
as the agent's publish gate allows (:meth:`~elastic_train.checkpoint.agent.Agent.may_publish`), and the
outcome is broadcast so every rank reports the same. At most one write is in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.agent import Agent
from elastic_train.checkpoint.background import OneJob
from elastic_train.checkpoint.codec import Flat, aligned_zeros, copy_into
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import CheckpointError, WriteFailed
from elastic_train.checkpoint.groups import Groups
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.policy import SHARE_ALIGN, share_ranges, step_dir
from elastic_train.checkpoint.specs import layout_key
from elastic_train.checkpoint.storage import Storage
from elastic_train.log import get_logger

if TYPE_CHECKING:
    from elastic_train.checkpoint.restore import Origin

log = get_logger(__name__)

#: Attempts for the final checkpoint (whatever ``on_error`` says): it is the job's result.
FINAL_ATTEMPTS = 8
#: A durable write's outcome when the publish gate kept it from being published (not an error).
_UNPUBLISHED = "(not published: the publish gate said no)"


def write_attempts(cfg: CheckpointConfig, final: bool) -> int:
    """Attempts at one durable write: ``retries`` with ``on_error: retry``, else one; the final checkpoint
    (the job's result, never lost silently) always gets at least :data:`FINAL_ATTEMPTS`."""
    if cfg.on_error == "retry" or final:
        return max(cfg.retries, FINAL_ATTEMPTS if final else 1)
    return 1


def retry_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): 0.5, 1, 2, 4, 8, then 10."""
    return float(min(10.0, 0.5 * 2 ** (attempt - 1)))


@dataclass(frozen=True, slots=True)
class Committed:
    """A durable checkpoint this manager committed (``seconds``: from the save call to the commit)."""

    step: int
    path: str
    bytes: int
    seconds: float


@dataclass(slots=True)
class _Write:
    """One step handed to the writer."""

    step: int
    flat: Flat
    slot: int | None
    started: float
    final: bool = False


class DurableWriter:
    """The durable tier's writer of one manager (see the module docstring).

    Args:
        cfg: the ``checkpoint:`` section (cadence, retries, retention, recycling).
        storage: the checkpoint root's storage; ``run_path`` the run's directory in it.
        groups: the manager's groups (writes are collective on ``io``).
        memory: the memory tier, whose slots a write reads (None: a staging buffer).
        agent: the publish gate and the heartbeat while the loop waits for a write.
        origin: the round and base the manifests carry (set by the restore).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        storage: Storage,
        run_path: str,
        run_id: str,
        *,
        groups: Groups,
        memory: MemorySnapshot | None,
        agent: Agent,
        origin: Origin,
    ) -> None:
        self.cfg = cfg
        self.storage = storage
        self.run_path = run_path
        self.run_id = run_id
        self.groups = groups
        self.memory = memory
        self.agent = agent
        self.origin = origin
        #: When the last step was handed over (monotonic) and which one: the cadence counts from them.
        self.submitted_at = time.monotonic()
        self.submitted_step: int | None = None
        #: The newest step this world holds durably (committed here, or restored from storage).
        self.ok_step: int | None = None
        self.last_committed: Committed | None = None
        self._staging: torch.Tensor | None = None
        #: The failure of an earlier write, raised once by :meth:`raise_failure`.
        self.failure: CheckpointError | None = None
        self._jobs: OneJob[_Write] = OneJob(self._run, "ckpt-writer")

    def submit(self, step: int, flat: Flat, slot: int | None, *, final: bool = False) -> None:
        """Write ``step`` (its slot pinned until the write ends, or ``flat`` copied into the staging buffer);
        in the background with ``async_write``. The caller waited for the previous write."""
        if slot is not None and self.memory is not None:
            # The writer reads the step straight from its shared-memory slot (pinned until the write ends).
            self.memory.pin(slot)
        else:
            if self._staging is None or self._staging.numel() < flat.nbytes:
                # Page-aligned (shares can be written with O_DIRECT) and zeroed (the padding between tensors
                # is written too, and must not carry stale process memory).
                self._staging = aligned_zeros(flat.nbytes, SHARE_ALIGN)
            copy_into(flat, self._staging)
        job = _Write(step, flat, slot, time.monotonic(), final)
        self.submitted_at = time.monotonic()
        self.submitted_step = step
        if self.cfg.async_write:
            self._jobs.submit(job)
        else:
            self._run(job)

    def wait(self) -> None:
        """Block until no write is in flight (its failure is raised by :meth:`raise_failure`).

        While it waits the worker still counts as making progress for its agent: it waits for its own
        writer (held up, say, by the publish gate during an etcd outage), not for peers that left.
        """
        self._jobs.wait(self.agent.beat)

    def raise_failure(self) -> None:
        """Raise the failure of an earlier write, once."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    def stop(self, timeout: float | None) -> bool:
        """Stop the thread (a write in flight finishes first, up to ``timeout`` seconds); whether it ended."""
        return self._jobs.stop(timeout)

    def _run(self, job: _Write) -> None:
        """Write one durable checkpoint (all ranks in step), retrying per ``on_error``; never raises."""
        try:
            self._write(job)
        finally:
            if job.slot is not None and self.memory is not None:
                self.memory.unpin(job.slot)

    def _write(self, job: _Write) -> None:
        try:
            n = job.flat.nbytes
            if job.slot is not None and self.memory is not None:
                source = self.memory.data(job.slot, n)
            else:
                assert self._staging is not None
                source = self._staging[:n]
            attempts = write_attempts(self.cfg, job.final)
            error = None
            for attempt in range(1, attempts + 1):
                error = self._attempt(job, source)
                if error == _UNPUBLISHED:  # the gate said no (logged by rank 0): nothing to retry
                    if job.final:  # a stale world: its result is not the job's
                        self.failure = WriteFailed(
                            f"final checkpoint of step {job.step} not published: round {self.agent.round} is "
                            "no longer the run's current round"
                        )
                    return
                if error is None:  # the outcome is broadcast: every rank records the same step
                    self.ok_step = job.step
                    return
                log.warning(
                    "checkpoint_write_failed", step=job.step, attempt=attempt, attempts=attempts, error=error
                )
                if attempt < attempts:  # storage outages are usually short: back off (same on every rank)
                    time.sleep(retry_delay(attempt))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {error}")
        except Exception as exc:  # a bug or a broken process group: report it, never die silently
            log.error("checkpoint_writer_crashed", step=job.step, error=repr(exc))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {exc!r}")
            # kept as the cause: a broken process group re-forms in-process (train.hot.classify_failure)
            failure.__cause__ = exc
        if self.cfg.on_error == "log" and not job.final:
            log.error("checkpoint_lost", step=job.step, error=str(failure))
        else:
            self.failure = failure

    def _attempt(self, job: _Write, source: torch.Tensor) -> str | None:
        """One collective attempt: every rank writes its share, rank 0 commits. Returns the error or None."""
        groups = self.groups
        coordinated = groups.coordinated
        world = groups.world_size if coordinated else 1
        me = groups.rank if coordinated else 0
        if not coordinated and groups.rank != 0:
            return None
        start, end = share_ranges(job.flat.nbytes, world)[me]
        path = self.storage.join(self.run_path, step_dir(job.step, self.origin.stamp))
        record, error = None, None
        if end > start:
            try:
                pool = durable.pool_path(self.storage, self.run_path) if self.cfg.recycle else None
                record = durable.write_share(self.storage, path, me, source, start, end, pool=pool)
            except Exception as exc:
                error = f"rank {groups.rank}: {exc}"
        key = layout_key(job.flat.specs)
        mine = (record, error, key)
        gathered: list[Any] = [mine]
        if coordinated:
            gathered = [None] * groups.world_size
            dist.all_gather_object(gathered, mine, group=groups.io)
        outcome: list[Any] = [None]
        if me == 0:
            errors = [e for _, e, _ in gathered if e]
            if any(k != key for _, _, k in gathered):
                errors.append("ranks hold states of different layouts (is the state replicated?)")
            if not errors:
                try:
                    if not self._commit(job, [r for r, _, _ in gathered if r is not None]):
                        outcome[0] = _UNPUBLISHED
                except Exception as exc:
                    errors.append(f"commit: {exc}")
            if errors:
                outcome[0] = "; ".join(errors)
        if coordinated:
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(groups.io, 0), group=groups.io)
        return outcome[0]

    def _commit(self, job: _Write, records: list[Any]) -> bool:
        """Rank 0: the manifest, ``latest`` and retention, each behind the publish gate; whether published."""
        flat = job.flat
        sampler = flat.skeleton.get("sampler") if isinstance(flat.skeleton, dict) else None
        manifest = durable.build_manifest(
            run_id=self.run_id,
            step=job.step,
            world_size=self.groups.world_size,
            skeleton=flat.skeleton,
            specs=flat.specs,
            shares=records,
            sampler=sampler,
            nbytes=flat.nbytes,
            round=self.origin.stamp,
            base=self.origin.base,
        )
        if not self._may_publish(job):
            return False
        path = durable.commit(self.storage, self.run_path, manifest, lambda: self._may_publish(job))
        if path is None:
            return False
        seconds = time.monotonic() - job.started
        self.last_committed = Committed(job.step, path, int(manifest["bytes"]), seconds)
        log.info(
            "checkpoint_committed",
            step=job.step,
            path=path,
            bytes=manifest["bytes"],
            seconds=round(seconds, 3),
        )
        for gone in durable.prune(
            self.storage,
            self.run_path,
            keep_last=self.cfg.keep_last,
            keep_every=self.cfg.keep_every,
            current=job.step,
            # The final checkpoint empties the pool of retired files: no later save will reuse them.
            recycle_bytes=0 if job.final or not self.cfg.recycle else int(manifest["bytes"]),
            round=self.origin.stamp,
        ):
            log.info("checkpoint_removed", path=gone)
        return True

    def _may_publish(self, job: _Write) -> bool:
        """The publish gate, asked before the manifest lands and again before ``latest`` moves."""
        return self.agent.may_publish(job.step, final=job.final)
