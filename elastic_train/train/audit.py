"""The data audit: which samples every rank trained at every step, and the exactly-once check.

With ``--audit DIR`` (``train.audit_dir``) every rank appends, before training a step, one JSON line
``{"epoch", "step", "rank", "world_size", "round", "indices"}`` to ``DIR/rank-<rank>-round-<round>.jsonl``.
Steps are numbered from 1 (``step`` is the optimizer step count once the step completes). A step cut short by
a failure is redone in a later round, so it appears again with a higher ``round``; for every step only the
lines of its **latest** round count.

:func:`check_exactly_once` merges the files and checks, from the audit alone, that:

- every step ``first_step..steps`` (``1..steps`` unless the run resumed from another run's checkpoint) has
  exactly one line per rank ``0..W-1`` of its latest round, all with one ``W``;
- the step has the expected size and epoch (``G`` samples, fewer for the last step of an epoch) and its ranks'
  indices are disjoint and valid;
- within an epoch no index is trained twice, and every completed epoch covered the whole dataset.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from elastic_train.train.jsonl import JsonLinesWriter, read_json_lines

AUDIT_GLOB = "rank-*-round-*.jsonl"
#: Written by rank 0 next to the audit files: ``{"dataset_len", "global_batch", "seed"}``.
META_FILE = "meta.json"


def audit_file(directory: str, rank: int, round: int) -> str:
    """Path of the audit file of ``rank`` in ``round``."""
    return os.path.join(directory, f"rank-{rank}-round-{round}.jsonl")


class AuditWriter:
    """Appends one line per step for one rank of one round (one ``write`` per line, ``O_APPEND``)."""

    def __init__(self, directory: str, *, rank: int, world_size: int, round: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = audit_file(directory, rank, round)
        self._out = JsonLinesWriter(self.path)
        self.rank = rank
        self.world_size = world_size
        self.round = round

    def write(self, *, epoch: int, step: int, indices: list[int]) -> None:
        line = {
            "epoch": epoch,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "round": self.round,
            "indices": indices,
        }
        self._out.append(line)

    def close(self) -> None:
        self._out.close()


def write_meta(directory: str, *, dataset_len: int, global_batch: int, seed: int) -> None:
    """Record what a checker needs besides the lines (atomically: write then rename)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{META_FILE}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"dataset_len": dataset_len, "global_batch": global_batch, "seed": seed}, f)
    os.replace(tmp, os.path.join(directory, META_FILE))


def read_meta(directory: str) -> dict[str, Any] | None:
    """The meta record of an audit directory, or ``None`` when there is none."""
    try:
        with open(os.path.join(directory, META_FILE), encoding="utf-8") as f:
            meta: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    return meta


def read_audit(directory: str) -> list[dict[str, Any]]:
    """Every complete line of every audit file in ``directory`` (a crashed rank's torn last line left out)."""
    return [
        line
        for path in sorted(glob.glob(os.path.join(directory, AUDIT_GLOB)))
        for line in read_json_lines(path)
    ]


def expected_steps(steps: int, global_batch: int, dataset_len: int) -> list[tuple[int, int]]:
    """``(epoch, size)`` of steps ``1..steps`` under the sampler's epoch-boundary rule."""
    plan, epoch, cursor = [], 0, 0
    for _ in range(steps):
        size = min(global_batch, dataset_len - cursor)
        plan.append((epoch, size))
        cursor += size
        if cursor >= dataset_len:
            epoch, cursor = epoch + 1, 0
    return plan


@dataclass(slots=True)
class AuditReport:
    """Outcome of :func:`check_exactly_once`."""

    ok: bool
    """True when no problem was found."""
    steps: int
    """Last step checked."""
    samples: int
    """Samples trained over all counted steps."""
    problems: list[str] = field(default_factory=list)
    """One line per violation (empty when ok)."""
    redone_steps: dict[int, int] = field(default_factory=dict)
    """Steps that appear in more than one round → number of rounds they appear in."""
    first_step: int = 1
    """First step checked (after the step a run resumed from another run's checkpoint at)."""
    world_sizes: dict[int, int] = field(default_factory=dict)
    """World size of the counted (latest) round of each step."""
    rounds: dict[int, int] = field(default_factory=dict)
    """Round counted for each step."""

    def summary(self) -> str:
        """One line for humans."""
        if self.ok:
            return (
                f"exactly-once OK: {self.steps} steps, {self.samples} samples, "
                f"{len(self.redone_steps)} steps redone after failures"
            )
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"exactly-once FAILED: {self.problems[0]}{more}"

    def to_json(self) -> dict[str, Any]:
        """Plain data for a JSON summary."""
        return {
            "ok": self.ok,
            "steps": self.steps,
            "first_step": self.first_step,
            "samples": self.samples,
            "problems": self.problems,
            "redone_steps": self.redone_steps,
        }


def check_exactly_once(
    directory: str,
    steps: int,
    global_batch: int | None = None,
    dataset_len: int | None = None,
    *,
    first_step: int = 1,
) -> AuditReport:
    """Check from the audit files in ``directory`` that steps ``first_step..steps`` trained every sample
    exactly once.

    Args:
        directory: the ``--audit`` directory of the run.
        steps: number of steps the run completed.
        global_batch: ``train.global_batch`` (default: from the directory's meta.json).
        dataset_len: number of samples in the task's dataset (default: from the directory's meta.json).
        first_step: first step this run trained (a run started with ``--resume-from`` another run's step
            ``S`` trains from ``S + 1``; the steps before it were audited, if at all, by that run).
    """
    if first_step < 1:
        raise ValueError(f"first_step: {first_step} must be >= 1")
    if global_batch is None or dataset_len is None:
        meta = read_meta(directory)
        if meta is None:
            return AuditReport(ok=False, steps=steps, samples=0, problems=[f"{directory}: no {META_FILE}"])
        global_batch = int(meta["global_batch"]) if global_batch is None else global_batch
        dataset_len = int(meta["dataset_len"]) if dataset_len is None else dataset_len
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for line in read_audit(directory):
        by_step[int(line["step"])][int(line["round"])].append(line)
    problems: list[str] = []
    report = AuditReport(ok=False, steps=steps, samples=0, problems=problems, first_step=first_step)
    seen: dict[int, set[int]] = defaultdict(set)  # epoch -> indices trained in it
    plan = expected_steps(steps, global_batch, dataset_len)
    for step, (epoch, size) in enumerate(plan, start=1):
        if step < first_step:
            continue
        rounds = by_step.get(step)
        if not rounds:
            problems.append(f"step {step}: no audit lines")
            continue
        if len(rounds) > 1:
            report.redone_steps[step] = len(rounds)
        latest = max(rounds)
        lines = rounds[latest]
        report.rounds[step] = latest
        sizes = {int(line["world_size"]) for line in lines}
        if len(sizes) != 1:
            problems.append(f"step {step} round {latest}: ranks disagree on the world size {sorted(sizes)}")
            continue
        world = sizes.pop()
        report.world_sizes[step] = world
        ranks = sorted(int(line["rank"]) for line in lines)
        if ranks != list(range(world)):
            problems.append(f"step {step} round {latest}: ranks {ranks}, expected 0..{world - 1} once each")
            continue
        epochs = {int(line["epoch"]) for line in lines}
        if epochs != {epoch}:
            problems.append(f"step {step}: epoch {sorted(epochs)}, expected {epoch}")
        indices = [int(i) for line in lines for i in line["indices"]]
        if len(indices) != size:
            problems.append(f"step {step}: {len(indices)} samples, expected {size}")
        bad = [i for i in indices if not 0 <= i < dataset_len]
        if bad:
            problems.append(f"step {step}: indices outside the dataset: {bad[:5]}")
        repeated: set[int] = seen[epoch].intersection(indices) | {
            i for i, n in Counter(indices).items() if n > 1
        }
        if repeated:
            problems.append(f"step {step}: samples trained twice in epoch {epoch}: {sorted(repeated)[:5]}")
        seen[epoch].update(indices)
        report.samples += len(indices)
    last_epoch = plan[-1][0] if plan else 0
    final_complete = sum(s for e, s in plan if e == last_epoch) == dataset_len
    # An epoch this run joined half-way was partly trained by the run it resumed from.
    first_epoch_whole = 0
    if 1 < first_step <= len(plan):
        joined = plan[first_step - 1][0]
        first_epoch_whole = joined if plan[first_step - 2][0] != joined else joined + 1
    for epoch, trained in seen.items():
        if epoch < first_epoch_whole:
            continue
        if (epoch < last_epoch or final_complete) and len(trained) != dataset_len:
            problems.append(f"epoch {epoch}: {dataset_len - len(trained)} samples never trained")
    report.ok = not problems
    return report
