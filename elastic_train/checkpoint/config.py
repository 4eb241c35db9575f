"""Checkpoint settings of a job (the ``checkpoint:`` section of job.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ON_ERROR = ("retry", "log", "fatal")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how safely state is kept."""

    url: str = "checkpoints"
    """fsspec URL or local path of the checkpoint root; the run id is appended."""
    every_steps: int = 50
    """Commit a durable checkpoint every N optimizer steps (0: only the final one)."""
    every_seconds: float = 0.0
    """Also commit when this many seconds passed since the last one (0: off)."""
    keep_last: int = 3
    """Durable checkpoints kept; older ones are deleted after a newer one commits."""
    keep_every: int = 0
    """Additionally keep every checkpoint whose step is a multiple of this (0: off)."""
    recycle: bool = True
    """Local disks: write new share files over the files of deleted checkpoints instead of allocating new
    blocks (turn off on copy-on-write filesystems such as ZFS or btrfs, where it gains nothing)."""
    direct_io: bool = True
    """Local disks: write shares with O_DIRECT, straight from memory to the device: no copy into the page
    cache (the CPU is left to the checksums) and no gigabytes of checkpoint evicting cached training data.
    Filesystems without O_DIRECT fall back to the page cache by themselves."""
    async_write: bool = True
    """Write durable checkpoints in a background thread (the loop pays only for a CPU copy)."""
    on_error: str = "retry"
    """What a failed durable write does: retry (then fatal), log (carry on), fatal (stop training)."""
    retries: int = 3
    """Attempts per durable write when on_error is retry."""
    memory: bool = True
    """Keep the in-memory (shared memory) tier: a restarted or re-formed group resumes from a surviving
    rank's snapshot instead of the newest durable checkpoint."""
    memory_every_steps: int = 1
    """Copy state into the in-memory tier every N steps (N >= 1); a failure redoes up to N steps."""
    resume_from: str | None = None
    """Checkpoint URL (a run root or one step-XXXXXXXX directory), used when the run has none of its own."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options of the URL's filesystem, e.g. {"endpoint_url": "http://127.0.0.1:9000"} for s3."""
    memory_dir: str = "/dev/shm"
    """Directory (a tmpfs) holding the in-memory tier's snapshots (three slots per local rank)."""
    shard_replicas: int = 0
    """Sharded (FSDP2) state: also keep each rank's shards in the memory of the rank one node further on (0 or
    1). With 1 a node that dies takes no shard with it (the survivors reshard from memory); it costs three
    more slots of a rank's part of the state in shared memory and sending that part to the next node after
    every snapshot. Replicated (DDP) state ignores it."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: must not be empty")
        for name in ("every_steps", "keep_every"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name}: {value} must be >= 0")
        if self.memory_every_steps < 1:
            raise ValueError(
                f"memory_every_steps: {self.memory_every_steps} must be >= 1 "
                "(memory: false turns the tier off)"
            )
        if self.every_seconds < 0:
            raise ValueError(f"every_seconds: {self.every_seconds} must be >= 0")
        if self.keep_last < 1:
            raise ValueError(f"keep_last: {self.keep_last} must be >= 1")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error: {self.on_error!r} is not one of {', '.join(ON_ERROR)}")
        if self.shard_replicas not in (0, 1):
            raise ValueError(f"shard_replicas: {self.shard_replicas} must be 0 or 1")
        if self.retries < 1:
            raise ValueError(f"retries: {self.retries} must be >= 1")
