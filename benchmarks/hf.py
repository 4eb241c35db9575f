"""Hugging Face Trainer under faults: ElasticTrainer against a plain Trainer, paired in one run.

Both variants train examples/hf_train.py's model and data (benchmarks/hf_probe.py) as
``elastic-train local --entry`` jobs of 3 nodes x 1 worker on loopback with the same fault plan: kill -9 of
node 1 after step ``--kill-step``, a node joining after step ``--join-step``, every step slowed by
``--delay`` s so the faults land while it trains.

- ``elastic``: ``ElasticTrainer``, the fork server preloading transformers (``--preload elastic_train.hf``),
  global batch ``G``;
- ``plain``: ``transformers.Trainer`` with a per-device batch of ``G / 3`` (so ``G`` at the starting world
  size), its ``save_steps`` checkpoints every ``--save-steps`` steps and
  ``train(resume_from_checkpoint=get_last_checkpoint(...))``. It runs under the same fork server (torch
  preloaded, transformers not): a plain torchrun start would add torch's import to each restart.

Measured per fault: seconds from the fault (kill; the joining node's start) to the first step of the new
round (``elastic-train local``'s summary), seconds the job went without a step around it, steps redone; per
run, from the audit lines (one per step and rank with the indices trained), samples never trained and trained
twice over the run's surviving trajectory (for every step, the last round that trained it), per epoch,
against ``epochs x dataset`` expected. Prints a table and writes JSON.

    python benchmarks/hf.py --json docs/benchmarks/hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROBE = HERE / "hf_probe.py"
#: Target on this machine: seconds from a kill to training again, and without a step around a join.
TARGET_S = 3.0
VARIANTS = ("elastic", "plain")


def lost_and_duplicated(audit_dir: Path, dataset_len: int, epochs: int) -> dict[str, int]:
    """Samples never trained and trained more than once, per epoch, over the surviving trajectory."""
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


def run_variant(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workdir = work / kind
    audit = workdir / ("audit" if kind == "elastic" else "plain-audit")
    entry = [str(PROBE), kind, str(args.delay)] + ([str(audit)] if kind == "plain" else [])
    entry += [
        "--epochs", str(args.epochs), "--samples", str(args.samples),
        "--global-batch", str(args.global_batch), "--batch-size", str(args.global_batch // 3),
        "--save-steps", str(args.save_steps), "--output-dir", str(workdir / "out"),
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", f"1@step={args.kill_step}", "--add-node", f"@step={args.join_step}",
        "--workdir", str(workdir), "--audit", str(workdir / "audit"),
        "--summary", str(workdir / "summary.json"), "--timeout", str(args.timeout),
        *(["--preload", "elastic_train.hf"] if kind == "elastic" else []),
        "--entry", *entry,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("ELASTIC_TRAIN_PRELOAD", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    print(f"== {kind}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    proc = subprocess.run(
        cmd, env=env, cwd=str(work), capture_output=True, text=True, timeout=args.timeout + 120
    )
    took = round(time.time() - t, 1)
    summary_path = workdir / "summary.json"
    if not summary_path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"variant": kind, "error": f"exit {proc.returncode}: {' | '.join(tail)[:300]}"}
    summary = json.loads(summary_path.read_text())
    faults = {f["kind"]: f for f in summary.get("faults", [])}
    data = lost_and_duplicated(audit, args.samples, args.epochs)
    from elastic_train.train.events import read_events

    events = read_events(str(workdir / "events.jsonl"))
    out = {
        "variant": kind,
        "succeeded": bool(summary.get("succeeded")),
        "steps": summary.get("completed_steps"),
        "seconds": took,
        "kill_s": faults.get("kill-node", {}).get("resumed_s"),
        "join_s": faults.get("add-node", {}).get("resumed_s"),
        "kill_pause_s": pause(faults.get("kill-node", {}), events),
        "join_pause_s": pause(faults.get("add-node", {}), events),
        "kill_redone": faults.get("kill-node", {}).get("steps_redone"),
        "join_redone": faults.get("add-node", {}).get("steps_redone"),
        "source": faults.get("kill-node", {}).get("source"),
        **data,
    }
    print(f"   {took:.0f} s: {json.dumps(out)}", flush=True)
    return out


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = [r for r in runs if r.get("variant") == "elastic" and "error" not in r]
    out = []
    for key, name in (
        ("kill_s", "HF Trainer kill -> training with run --entry"),
        ("join_pause_s", "HF Trainer join: the job without a step, with run --entry"),
    ):
        values = [r[key] for r in ours if r.get(key) is not None]
        entry: dict[str, Any] = {"name": name, "threshold": f"<= {TARGET_S:g} s"}
        if values:
            entry["figure"] = ", ".join(f"{v:.2f} s" for v in values)
            entry["status"] = "met" if max(values) <= TARGET_S else "missed"
        out.append(entry)
    data: dict[str, Any] = {"name": "HF Trainer samples lost or duplicated across a kill and a join"}
    data["threshold"] = "0"
    if ours:
        bad = sum(r["lost"] + r["duplicated"] for r in ours)
        data["figure"] = f"{bad} of {sum(r['expected'] for r in ours)}"
        data["status"] = "met" if bad == 0 else "missed"
    out.append(data)
    return out


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


def figures(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
    """The figures as a Markdown table, one column per variant."""
    variants = [r["variant"] for r in rows]
    lines = ["| | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for title in [t for t, _ in COLUMNS] + ["error"]:
        cells = [rows[i].get(title) for i in range(len(rows))]
        if all(c is None for c in cells):
            continue
        lines.append(f"| {title} | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--samples", type=int, default=256, help="dataset size")
    p.add_argument("--global-batch", type=int, default=24, help="G (plain: G / 3 per device)")
    p.add_argument("--save-steps", type=int, default=10, help="the Trainer's own checkpoint every N steps")
    p.add_argument("--kill-step", type=int, default=15, help="kill node 1 after this step")
    p.add_argument("--join-step", type=int, default=30, help="a node joins after this step")
    p.add_argument("--delay", type=float, default=0.2, help="seconds added to every step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--keep", metavar="DIR", help="keep the jobs' logs, events and audit files in DIR")
    p.add_argument("--only", choices=VARIANTS, help="run one variant (no pairing)")
    args = p.parse_args(argv)
    if args.global_batch % 3:
        p.error("--global-batch: must be a multiple of 3 (the plain variant's per-device batch is G / 3)")
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = []
    with tempfile.TemporaryDirectory(prefix="et-hf-") as scratch:
        work = Path(args.keep or scratch)
        work.mkdir(parents=True, exist_ok=True)
        for kind in VARIANTS:
            if args.only in (None, kind):
                runs.append(run_variant(kind, args, work))
    load_end = os.getloadavg()
    rows = figures(runs)
    print()
    print(table(rows))
    for t in targets(runs):
        status = t.get("status", "not measured")
        print(f"target {t['name']}: {t.get('figure', '-')} ({t['threshold']}: {status})")
    if args.json:
        doc = {
            "benchmark": "hf",
            "started": started,
            "description": (
                f"3 nodes x 1 worker on loopback (examples/hf_train.py's GPT-2, {args.samples} sequences x "
                f"{args.epochs} epochs, global batch {args.global_batch}, +{args.delay} s per step): kill -9 "
                f"of node 1 after step {args.kill_step}, a node joins after step {args.join_step}; elastic = "
                "ElasticTrainer under `local --preload elastic_train.hf --entry`, plain = "
                f"transformers.Trainer with save_steps={args.save_steps} and resume_from_checkpoint under "
                "the same harness (fork server, transformers not preloaded). Load average at start "
                f"{[round(x, 2) for x in load_start]}, at end {[round(x, 2) for x in load_end]} on "
                f"{os.cpu_count()} cores."
            ),
            "loadavg": [list(load_start), list(load_end)],
            "runs": runs,
            "figures": rows,
            "targets": targets(runs),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
