"""Pure decisions of the checkpoint subsystem: names, cadence, shares, retention, which state to restore."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    """Directory name of ``step``: ``step-00000123``."""
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` name, None for anything else."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def durable_due(step: int, *, every_steps: int, every_seconds: float, since_last: float) -> bool:
    """Whether a durable checkpoint is due after ``step`` (``since_last``: seconds since the last one)."""
    if every_steps and step % every_steps == 0:
        return True
    return bool(every_seconds) and since_last >= every_seconds


#: Share boundaries in the flat layout fall on multiples of this (a page): every share then starts on a page
#: of the page-aligned buffer it is written from, which is what O_DIRECT needs.
SHARE_ALIGN = 4096


def share_ranges(nbytes: int, world_size: int, align: int = SHARE_ALIGN) -> list[tuple[int, int]]:
    """Cut the flat layout ``[0, nbytes)`` into ``world_size`` contiguous byte ranges, one per rank.

    Cuts are the multiples of ``align`` nearest to the even split, so shares differ by at most ``align``
    bytes (tensors may straddle two shares); a state smaller than ``align`` per rank leaves some ranks an
    empty range. Deterministic: every rank computes the same cuts.
    """
    cuts = [0]
    for k in range(1, world_size):
        cut = (k * nbytes // world_size + align // 2) // align * align
        cuts.append(min(max(cut, cuts[-1]), nbytes))
    cuts.append(nbytes)
    return [(cuts[r], cuts[r + 1]) for r in range(world_size)]


def retention(valid_steps: Sequence[int], *, keep_last: int, keep_every: int) -> list[int]:
    """Steps of valid checkpoints to delete: all but the newest ``keep_last`` and multiples of ``keep_every``.

    The newest valid checkpoint is never among them.
    """
    steps = sorted(set(valid_steps), reverse=True)
    keep = set(steps[: max(1, keep_last)])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return sorted(s for s in steps if s not in keep)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One place a restore can take its state from."""

    source: str
    """"memory" (a rank's shared-memory snapshot), "durable" (this run's storage) or "resume_from"."""
    step: int
    holder: int | None = None
    """Rank that holds a memory snapshot (the lowest of those holding the step)."""


def restore_plan(memory_steps: Sequence[int | None], durable_steps: Sequence[int]) -> list[Candidate]:
    """Candidates in the order to try them: durable ones newer than every memory snapshot (newest
    first, each may turn out corrupt), then the newest memory snapshot, then the older durable ones.

    Args:
        memory_steps: per rank, the step of its newest valid shared-memory snapshot (None: none).
        durable_steps: steps of durable checkpoints whose manifests look valid.
    """
    held = [(s, r) for r, s in enumerate(memory_steps) if s is not None]
    best_mem = max((s for s, _ in held), default=None)
    plan: list[Candidate] = []
    newer = sorted((s for s in set(durable_steps) if best_mem is None or s > best_mem), reverse=True)
    plan += [Candidate("durable", s) for s in newer]
    if best_mem is not None:
        holder = min(r for s, r in held if s == best_mem)
        plan.append(Candidate("memory", best_mem, holder))
        plan += [Candidate("durable", s) for s in sorted(set(durable_steps), reverse=True) if s <= best_mem]
    return plan
