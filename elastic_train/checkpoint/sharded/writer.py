"""The sharded manager's durable tier: a DCP directory per checkpoint, written in the background.

A mix-in of :class:`~elastic_train.checkpoint.sharded.manager.ShardedCheckpointManager` (its state is the
manager's). A due checkpoint pins the step's sealed memory slot (or copies the state into a staging buffer
without the memory tier) and hands it to a writer thread: DCP's ``dcp.save`` on the manager's own gloo group
``io`` writes every rank's part, each rank hashes the files it wrote (sha256 trees and their 8 MiB pieces),
rank 0 builds the manifest and publishes it through the publish gate, then applies retention. At most one
write is in flight; ``on_error`` decides what a failed one does, as for a replicated state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint import durable
from elastic_train.checkpoint import writer as durable_writer
from elastic_train.checkpoint.codec import ALIGN, Flat, aligned_zeros, copy_into, tensor_at, unflatten
from elastic_train.checkpoint.errors import WriteFailed
from elastic_train.checkpoint.policy import step_dir
from elastic_train.checkpoint.sharded import dcp
from elastic_train.checkpoint.sharded import manifest as smanifest
from elastic_train.checkpoint.sharded.base import ManagerBase
from elastic_train.checkpoint.sharded.layout import dcp_state as _dcp_state
from elastic_train.checkpoint.sharded.layout import fingerprint as _fingerprint
from elastic_train.checkpoint.sharded.layout import manifest_tensors as _manifest_tensors
from elastic_train.checkpoint.sharded.shardmap import ShardMap
from elastic_train.checkpoint.sharded.slots import INFO
from elastic_train.checkpoint.writer import Committed, write_attempts
from elastic_train.log import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class _Job:
    step: int
    flat: Flat
    slot: int | None
    started: float
    fqns: list[str]
    """The optimizer's parameter names, read on the training thread (a forward in flight re-registers
    FSDP2's unsharded parameters on the module)."""
    final: bool = False


class DurableWriting(ManagerBase):
    """The durable tier of :class:`~elastic_train.checkpoint.sharded.manager.ShardedCheckpointManager`."""

    def _submit(self, step: int, flat: Flat, slot: int | None, *, final: bool = False) -> None:
        self.wait()
        self._raise_pending()
        if slot is not None and self.memory is not None:
            self.memory.own.pin(slot)
        else:
            if self._staging is None or self._staging.numel() < flat.nbytes:
                self._staging = aligned_zeros(max(flat.nbytes, ALIGN), ALIGN)
            copy_into(flat, self._staging)
        job = _Job(step, flat, slot, time.monotonic(), self._fqn_of(), final)
        self._last_durable_time = time.monotonic()
        self._last_durable_step = step
        if not self.cfg.async_write or final:
            self._run_job(job)
            self._raise_pending()
            return
        self._jobs.submit(job)

    def _run_job(self, job: _Job) -> None:
        """One durable checkpoint (all ranks in step), retried per ``on_error``; never raises."""
        try:
            data = (
                self.memory.own.data(job.slot, job.flat.nbytes)
                if job.slot is not None and self.memory is not None
                else self._staging[: job.flat.nbytes]  # type: ignore[index]
            )
            attempts = write_attempts(self.cfg, job.final)
            error: str | None = None
            for attempt in range(1, attempts + 1):
                error = self._write_once(job, data)
                if error == "unpublished":
                    if job.final:
                        self._failure = WriteFailed(
                            f"final checkpoint of step {job.step} not published: round {self.agent.round} is "
                            "no longer the run's current round"
                        )
                    return
                if error is None:
                    self._durable_ok_step = job.step
                    return
                log.warning(
                    "checkpoint_write_failed", step=job.step, attempt=attempt, attempts=attempts, error=error
                )
                if attempt < attempts:
                    time.sleep(durable_writer.retry_delay(attempt))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {error}")
        except Exception as exc:  # a bug or a broken group: reported, never lost silently
            log.error("checkpoint_writer_crashed", step=job.step, error=repr(exc))
            failure = WriteFailed(f"durable checkpoint of step {job.step} failed: {exc!r}")
            # kept as the cause: a broken process group re-forms in-process (train.hot.classify_failure)
            failure.__cause__ = exc
        finally:
            if job.slot is not None and self.memory is not None:
                self.memory.own.unpin(job.slot)
        if self.cfg.on_error == "log" and not job.final:
            log.error("checkpoint_lost", step=job.step, error=str(failure))
        else:
            self._failure = failure

    def _write_once(self, job: _Job, data: torch.Tensor) -> str | None:
        """One collective attempt: DCP writes every rank's part, each rank hashes its files, rank 0 commits.
        Returns the error, ``"unpublished"`` when the gate said no, or None."""
        me = self.rank if self.coordinated else 0
        path = self.storage.join(self.run_path, step_dir(job.step, self.stamp))
        flat = job.flat
        tensors = [tensor_at(data, s) for s in flat.specs]
        payload = unflatten(flat.skeleton, tensors)
        smap = ShardMap.from_json(payload[INFO]["map"])
        fqns = job.fqns
        record: Any = None
        error = None
        try:
            state = _dcp_state(payload["state"], smap, self._host_mesh(), fqns)
            dcp.save(state, self.storage, path, group=self._io, options=self.cfg.storage_options)
            names = self.storage.listdir(path)
            mine = dcp.written_by(names, me) + ([dcp.METADATA] if me == 0 else [])
            record = {n: (*d, me) for n, d in dcp.file_digests(self.storage, path, mine).items()}
        except Exception as exc:
            error = f"rank {self.rank}: {exc}".splitlines()[0]
        gathered = [(record, error)]
        if self.coordinated:
            gathered = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, (record, error), group=self._io)
        outcome: list[Any] = [None]
        if me == 0:
            errors = [e for _, e in gathered if e]
            if not errors:
                files: dict[str, Any] = {}
                for r, _ in gathered:
                    files.update(r or {})
                try:
                    skeleton, entries = _manifest_tensors(flat, smap, fqns)
                    manifest = smanifest.build(
                        run_id=self.run_id, step=job.step, world_size=self.world_size, skeleton=skeleton,
                        tensors=entries, smap=smap, files=files, sampler=payload["state"].get("sampler"),
                        model=_fingerprint(entries), round=self.stamp, base=self.base,
                    )  # fmt: skip
                    if not self._commit(job, manifest):
                        outcome[0] = "unpublished"
                except Exception as exc:
                    errors.append(f"commit: {exc}")
            if errors:
                outcome[0] = "; ".join(errors)
        if self.coordinated:
            dist.broadcast_object_list(outcome, src=self._global_io(0), group=self._io)
        return outcome[0]

    def _host_mesh(self) -> Any:
        """The mesh the DTensors DCP writes are placed on: the model's, or on a GPU the same ranks on the
        host (the slot's bytes are on the host; a CUDA mesh would copy them to the device first)."""
        if self._mesh is None or self._mesh.device_type == "cpu":
            return self._mesh
        if self._cpu_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._cpu_mesh = DeviceMesh("cpu", self._mesh.mesh)
        return self._cpu_mesh

    def _global_io(self, rank: int) -> int:
        assert self._io is not None
        return dist.get_global_rank(self._io, rank)

    def _commit(self, job: _Job, manifest: dict[str, Any]) -> bool:
        if not self._may_publish(job):
            return False
        path = durable.commit(self.storage, self.run_path, manifest, lambda: self._may_publish(job))
        if path is None:
            return False
        seconds = time.monotonic() - job.started
        self.last_committed = Committed(job.step, path, int(manifest["bytes"]), seconds)
        log.info("checkpoint_committed", step=job.step, path=path, bytes=manifest["bytes"],
                 seconds=round(seconds, 3), layout="dcp")  # fmt: skip
        for gone in durable.prune(
            self.storage, self.run_path, keep_last=self.cfg.keep_last, keep_every=self.cfg.keep_every,
            current=job.step, recycle_bytes=0, round=self.stamp,
        ):  # fmt: skip
            log.info("checkpoint_removed", path=gone)
        return True

    def _may_publish(self, job: _Job) -> bool:
        return self.agent.may_publish(job.step, final=job.final)
