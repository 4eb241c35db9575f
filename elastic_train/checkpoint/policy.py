"""Pure decisions of the checkpoint subsystem: names, cadence, shares, retention, which state to restore."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{8,})(?:-r(\d+))?$")


def step_dir(step: int, round: int | None = None) -> str:
    """Directory name of ``step``: ``step-00000123``, or ``step-00000123-r4`` when written by the worker
    group of rendezvous round 4 (two worlds never write into the same directory)."""
    name = f"{STEP_PREFIX}{step:08d}"
    return name if round is None else f"{name}-r{round}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` (or ``step-XXXXXXXX-rN``) name, None for anything else."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def step_dir_round(name: str) -> int | None:
    """The round of a ``step-XXXXXXXX-rN`` name (None without one)."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(2)) if m and m.group(2) is not None else None


def off_line(
    checkpoints: Sequence[tuple[int, int | None, int | None]], starts: Sequence[tuple[int, int]] = ()
) -> dict[int, tuple[int, int]]:
    """The checkpoints a later world left behind: ``{index: (later round, the step it started from)}``.

    Each of ``checkpoints`` is ``(step, round, base)``; ``starts`` lists ``(round, base)`` of the worlds
    that recorded where they started (the run's lineage file), and every checkpoint's own round and base
    count as such a record too. A checkpoint written by round ``r`` at ``step`` is left behind when some
    round ``r2 > r`` started from a step ``base < step``: its world was cut off and the others restarted
    from an earlier state, so it holds steps the run's history no longer contains and must never be taken
    for the newest. Checkpoints without a round (written outside an ``etcd3`` rendezvous) neither lose nor
    win by this rule.
    """
    witnesses = [(r, b) for _, r, b in checkpoints if r is not None and b is not None] + list(starts)
    out: dict[int, tuple[int, int]] = {}
    for i, (step, rnd, _) in enumerate(checkpoints):
        if rnd is None:
            continue
        for later, base in witnesses:
            if later > rnd and base < step:
                out[i] = (later, base)
                break
    return out


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


def restore_order(memory_steps: Sequence[int | None], durable_steps: Sequence[int]) -> list[Candidate]:
    """Candidates in the order to try them: durable ones newer than every memory snapshot (newest
    first, each may turn out corrupt), then the newest memory snapshot, then the older durable ones.

    Args:
        memory_steps: per rank, the step of its newest valid shared-memory snapshot (None: none).
        durable_steps: steps of durable checkpoints whose manifests look valid.
    """
    held = [(s, r) for r, s in enumerate(memory_steps) if s is not None]
    best_mem = max((s for s, _ in held), default=None)
    order: list[Candidate] = []
    newer = sorted((s for s in set(durable_steps) if best_mem is None or s > best_mem), reverse=True)
    order += [Candidate("durable", s) for s in newer]
    if best_mem is not None:
        holder = min(r for s, r in held if s == best_mem)
        order.append(Candidate("memory", best_mem, holder))
        order += [Candidate("durable", s) for s in sorted(set(durable_steps), reverse=True) if s <= best_mem]
    return order
