"""Training settings of a job (the ``train:`` section of job.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: How a step is split over the ranks: ``even``, or ``speed`` (by measured speed: train/balance.py).
SHARES = ("even", "speed")


#: The built-in loop's compute dtypes of a sharded model (``train.mixed_precision``): ``none`` computes in the
#: parameters' own dtype; ``bfloat16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
#: reduce_dtype=float32)``: forward and backward in bfloat16, gradients reduced in float32, while the shards,
#: the optimizer state and every checkpoint keep the parameters' own dtype.
MIXED_PRECISION = ("none", "bfloat16")


def check_shares(shares: str) -> None:
    """Raises ValueError naming the choices when ``shares`` is not one of :data:`SHARES`."""
    if shares not in SHARES:
        raise ValueError(f"shares: {shares!r} is not one of {', '.join(SHARES)}")


def check_mixed_precision(mixed_precision: str) -> None:
    """Raises ValueError naming the choices when ``mixed_precision`` is not one of :data:`MIXED_PRECISION`."""
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision: {mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """What to train and for how long; the global batch stays fixed at any world size."""

    task: str = "charlm"
    """Built-in task name (regression, charlm) or module:function returning a Task."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task factory."""
    steps: int = 100
    """Optimizer steps to train in total."""
    global_batch: int = 32
    """Samples per optimizer step over all ranks (constant when the world size changes)."""
    micro_batch: int = 0
    """Largest per-rank micro-batch; larger shares use gradient accumulation (0: no limit)."""
    seed: int = 0
    """Seed for the data order, model initialisation and every other random choice."""
    log_every: int = 1
    """Log a progress line every N steps."""
    audit_dir: str | None = None
    """Directory where every rank appends one JSON line per step with the sample indices it trained."""
    backend: str = "auto"
    """Process-group backend: auto (nccl with CUDA, else gloo), gloo or nccl."""
    fsdp: bool = False
    """Shard the model with FSDP2 (fully_shard per block) instead of replicating it with DDP."""
    shares: str = "even"
    """Split of each step over the ranks: even, or speed (a slow rank trains fewer, docs/stragglers.md)."""
    mixed_precision: str = "none"
    """Compute dtype of a sharded model (fsdp): none (the parameters' own) or bfloat16 (docs/sharded.md)."""

    def __post_init__(self) -> None:
        if not self.task:
            raise ValueError("task: must not be empty")
        if self.steps < 1:
            raise ValueError(f"steps: {self.steps} must be >= 1")
        if self.global_batch < 1:
            raise ValueError(f"global_batch: {self.global_batch} must be >= 1")
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch: {self.micro_batch} must be >= 0")
        if self.log_every < 1:
            raise ValueError(f"log_every: {self.log_every} must be >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend: {self.backend!r} is not one of auto, gloo, nccl")
        check_shares(self.shares)
        check_mixed_precision(self.mixed_precision)
        if self.mixed_precision != "none" and not self.fsdp:
            raise ValueError(
                f"mixed_precision: {self.mixed_precision} needs fsdp: true (FSDP2's MixedPrecisionPolicy); "
                "a replicated (DDP) model computes in its parameters' dtype"
            )
