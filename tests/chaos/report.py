"""The chaos table: faults injected by kind, recoveries, steps redone, invariant results."""

from __future__ import annotations

from collections import Counter
from typing import Any

INVARIANTS = ("finished", "exactly_once", "no_corrupt_resume", "checkpoints_verify", "weights_equal",
              "no_orphans", "no_shm_leak")  # fmt: skip


def render(results: list[dict[str, Any]]) -> str:
    kinds: Counter[str] = Counter()
    recovered: Counter[str] = Counter()
    redone: list[int] = []
    resume_s: list[float] = []
    lines = [f"{'seed':>5} {'faults':>7} {'wall s':>7}  " + " ".join(f"{i[:12]:>12}" for i in INVARIANTS)]
    for r in results:
        for f in r["faults"]:
            kinds[f["kind"]] += 1
            if f.get("resumed_s") is not None:
                recovered[f["kind"]] += 1
                resume_s.append(f["resumed_s"])
            if f.get("steps_redone") is not None:
                redone.append(f["steps_redone"])
        marks = " ".join(f"{'ok' if r['invariants'].get(i) else 'FAIL':>12}" for i in INVARIANTS)
        lines.append(f"{r['seed']:>5} {len(r['faults']):>7} {r['wall_s']:>7.1f}  {marks}")
    lines.append("")
    lines.append(f"{'fault kind':<24}{'injected':>9}{'followed by a new round':>25}")
    for kind, n in sorted(kinds.items()):
        lines.append(f"{kind:<24}{n:>9}{recovered[kind]:>25}")
    total = sum(kinds.values())
    lines.append(f"{'total':<24}{total:>9}{sum(recovered.values()):>25}")
    if resume_s:
        resume_s.sort()
        lines.append(
            f"recovery (fault → training again): median {resume_s[len(resume_s) // 2]:.2f}s, "
            f"max {resume_s[-1]:.2f}s; steps redone: max {max(redone) if redone else 0}, "
            f"total {sum(redone)}"
        )
    passed = sum(all(r["invariants"].get(i) for i in INVARIANTS) for r in results)
    lines.append(f"runs with every invariant held: {passed}/{len(results)}")
    return "\n".join(lines)
