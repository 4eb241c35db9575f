"""A framework's training script under ``elastic-train local --entry``, with a kill -9 and a join: the job,
and what its summary, events and audit lines say about it.

benchmarks/hf.py (Hugging Face Trainer) and benchmarks/lightning.py (Lightning) pair elastic_train's
integration (variant ``elastic``) with the framework's own checkpoint and resume (variant ``plain``) through
these functions; each supplies its script's command line and its description.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Target on this machine: seconds from a kill to training again, and without a step around a join (the
#: joining node's own start-up, while the others train, is reported but not held to it).
TARGET_S = 3.0
VARIANTS = ("elastic", "plain")
#: The figures of a run: (column title, key of the run's record).
COLUMNS = (
    ("kill -> training s", "kill_s"),
    ("join -> training s", "join_s"),
    ("kill: no step for s", "kill_pause_s"),
    ("join: no step for s", "join_pause_s"),
    ("steps redone (kill)", "kill_redone"),
    ("steps redone (join)", "join_redone"),
    ("resumed from", "source"),
    ("samples lost", "lost"),
    ("samples duplicated", "duplicated"),
    ("of samples", "expected"),
    ("steps", "steps"),
    ("job s", "seconds"),
)

#: The script's command line (after ``--entry``) for a variant, given its job directory and audit directory.
Entry = Callable[[str, Path, Path], list[str]]


def add_fault_args(p: argparse.ArgumentParser, *, kill_step: int, join_step: int) -> None:
    """The options every paired run takes: where the faults land, the step delay, limits and outputs."""
    p.add_argument("--kill-step", type=int, default=kill_step, help="kill node 1 after this step")
    p.add_argument("--join-step", type=int, default=join_step, help="a node joins after this step")
    p.add_argument("--delay", type=float, default=0.2, help="seconds added to every step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--keep", metavar="DIR", help="keep the jobs' logs, events and audit files in DIR")
    p.add_argument("--only", choices=VARIANTS, help="run one variant (no pairing)")


def lost_and_duplicated(audit_dir: Path, dataset_len: int, epochs: int) -> dict[str, int]:
    """Samples never trained and trained more than once, per epoch, over the surviving trajectory (for
    every step, the last round that trained it)."""
    from elastic_train.train.audit import read_audit

    latest: dict[int, int] = {}
    lines = list(read_audit(str(audit_dir))) if audit_dir.is_dir() else []
    for line in lines:
        step, rnd = int(line["step"]), int(line["round"])
        latest[step] = max(rnd, latest.get(step, rnd))
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for line in lines:
        if int(line["round"]) == latest[int(line["step"])]:
            per_epoch[int(line["epoch"])].update(int(i) for i in line["indices"])
    lost = dup = 0
    for epoch in range(epochs):
        counts = per_epoch.get(epoch, Counter())
        lost += dataset_len - len(counts)
        dup += sum(counts.values()) - len(counts)
    return {"lost": lost, "duplicated": dup, "expected": dataset_len * epochs}


def pause(fault: dict[str, Any], events: list[dict[str, Any]]) -> float | None:
    """Seconds without a step around a fault: the last step before the round that resumed training after it
    to that round's first step (for a join: how long the running job stood still)."""
    fired = fault.get("fired_round")
    steps = [e for e in events if e.get("event") == "step" and e.get("round") is not None]
    after = [e for e in steps if fired is not None and e["round"] > fired]
    if not after:
        return None
    first = min(after, key=lambda e: float(e["time"]))
    before = [float(e["time"]) for e in steps if e["round"] < first["round"]]
    return round(float(first["time"]) - max(before), 3) if before else None


def run_variant(
    kind: str, args: argparse.Namespace, work: Path, entry: Entry, *, preload: str, env: dict[str, str]
) -> dict[str, Any]:
    """One job of ``kind`` in ``work/kind``: 3 nodes (2 to 3), node 1 killed after ``--kill-step``, a node
    added after ``--join-step``; ``elastic`` with the fork server preloading ``preload``. Its figures, or
    ``{"variant", "error"}`` when it left no summary."""
    workdir = work / kind
    audit = workdir / ("audit" if kind == "elastic" else "plain-audit")
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", f"1@step={args.kill_step}", "--add-node", f"@step={args.join_step}",
        "--workdir", str(workdir), "--audit", str(workdir / "audit"),
        "--summary", str(workdir / "summary.json"), "--timeout", str(args.timeout),
        *(["--preload", preload] if kind == "elastic" else []),
        "--entry", *entry(kind, workdir, audit),
    ]  # fmt: skip
    job_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    job_env.pop("ELASTIC_TRAIN_PRELOAD", None)
    job_env.update(env)
    print(f"== {kind}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    proc = subprocess.run(
        cmd, env=job_env, cwd=str(work), capture_output=True, text=True, timeout=args.timeout + 120
    )
    took = round(time.time() - t, 1)
    summary_path = workdir / "summary.json"
    if not summary_path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"variant": kind, "error": f"exit {proc.returncode}: {' | '.join(tail)[:300]}"}
    summary = json.loads(summary_path.read_text())
    faults = {f["kind"]: f for f in summary.get("faults", [])}
    kill, join = faults.get("kill-node", {}), faults.get("add-node", {})
    from elastic_train.train.events import read_events

    events = read_events(str(workdir / "events.jsonl"))
    out = {
        "variant": kind,
        "succeeded": bool(summary.get("succeeded")),
        "steps": summary.get("completed_steps"),
        "seconds": took,
        "kill_s": kill.get("resumed_s"),
        "join_s": join.get("resumed_s"),
        "kill_pause_s": pause(kill, events),
        "join_pause_s": pause(join, events),
        "kill_redone": kill.get("steps_redone"),
        "join_redone": join.get("steps_redone"),
        "source": kill.get("source"),
        **lost_and_duplicated(audit, args.samples, args.epochs),
    }
    print(f"   {took:.0f} s: {json.dumps(out)}", flush=True)
    return out


def run_pairs(args: argparse.Namespace, work: Path, pairs: int, run: Callable[[str, Path], dict]) -> list:
    """``pairs`` pairs of runs (``--only``: one variant), each in ``work/pair-I``, the order alternating
    from one pair to the next so that neither variant always runs on the warmer machine."""
    runs = []
    for i in range(pairs):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        for kind in (v for v in order if args.only in (None, v)):
            pair = work / f"pair-{i}"
            pair.mkdir(parents=True, exist_ok=True)
            runs.append(run(kind, pair))
    return runs


def targets(runs: list[dict[str, Any]], framework: str, why_missed: str = "") -> list[dict[str, Any]]:
    """The targets: kill -> training and a join's pause within :data:`TARGET_S`, nothing lost or repeated."""
    ours = [r for r in runs if r.get("variant") == "elastic" and "error" not in r]
    out: list[dict[str, Any]] = []
    for key, what in (
        ("kill_s", "kill -> training with run --entry"),
        ("join_pause_s", "join: the job without a step, with run --entry"),
    ):
        entry: dict[str, Any] = {"name": f"{framework} {what}", "threshold": f"<= {TARGET_S:g} s"}
        values = [r[key] for r in ours if r.get(key) is not None]
        if values:
            met = max(values) <= TARGET_S
            entry["figure"] = ", ".join(f"{v:.2f} s" for v in values)
            entry["status"] = "met" if met else "missed"
            entry["why"] = "" if met else why_missed
        out.append(entry)
    data: dict[str, Any] = {"name": f"{framework} samples lost or duplicated across a kill and a join"}
    data["threshold"] = "0"
    if ours:
        bad = sum(r["lost"] + r["duplicated"] for r in ours)
        data["figure"] = f"{bad} of {sum(r['expected'] for r in ours)}"
        data["status"] = "met" if bad == 0 else "missed"
        data["why"] = ""
    out.append(data)
    return out


def figures(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run, and the plain / elastic ratios of the times when both variants ran."""
    rows: list[dict[str, Any]] = []
    for r in runs:
        if "error" in r:
            rows.append({"variant": r["variant"], "error": r["error"]})
        else:
            rows.append({"variant": r["variant"], **{title: r[key] for title, key in COLUMNS}})
    by = {r["variant"]: r for r in runs if "error" not in r}
    if {"elastic", "plain"} <= set(by):
        e, p = by["elastic"], by["plain"]
        rows.append({
            "variant": "plain / elastic",
            **{title: round(p[key] / e[key], 1) for title, key in COLUMNS[:4] if e.get(key) and p.get(key)},
        })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table, one column per run."""
    variants = [r["variant"] for r in rows]
    lines = ["| | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for title in [t for t, _ in COLUMNS] + ["error"]:
        cells = [rows[i].get(title) for i in range(len(rows))]
        if all(c is None for c in cells):
            continue
        lines.append(f"| {title} | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def report(runs: list[dict[str, Any]], framework: str, why_missed: str = "") -> None:
    """Print the figures' table and each target's outcome."""
    print()
    print(table(figures(runs)))
    for t in targets(runs, framework, why_missed):
        status = t.get("status", "not measured")
        print(f"target {t['name']}: {t.get('figure', '-')} ({t['threshold']}: {status})")
