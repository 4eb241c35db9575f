"""Lightning under faults: ElasticStrategy against plain Lightning + DistributedSampler, paired in one run.

Both variants train examples/lightning_train.py's model and data (benchmarks/lightning_worker.py) as
``elastic-train local --entry`` jobs of 3 nodes x 1 worker on loopback with the same fault plan: kill -9 of
node 1 at step ``--kill-step``, a node joining at ``--join-step``, every step slowed by ``--delay`` s so the
faults land while it trains.

- ``elastic``: ``ElasticStrategy``, the fork server preloading Lightning
  (``--preload elastic_train.lightning``), global batch ``G``;
- ``plain``: ``strategy="ddp"`` with ``num_nodes`` from torchrun's environment, Lightning's
  ``DistributedSampler`` with a per-rank batch of ``G / 3`` (so ``G`` at the starting world size),
  ``ModelCheckpoint`` writing last.ckpt every 10 steps and ``ckpt_path="last"``. It runs under the same fork
  server (torch preloaded, Lightning not): a plain torchrun start would add torch's import to each restart.

Measured per fault: seconds from the fault (kill; the joining node's start) to the first step of the new
round (``elastic-train local``'s summary), steps redone; per run, from the audit lines (one per step and
rank with the indices trained), samples never trained and trained twice over the run's surviving
trajectory (for every step, the last round that trained it), against ``epochs x dataset`` expected.

    PYTHONPATH=. .venv/bin/python benchmarks/lightning.py --json lightning.json
    PYTHONPATH=. .venv/bin/python benchmarks/lightning.py --quick
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
WORKER = HERE / "lightning_worker.py"
#: Targets on this machine: seconds from a kill to training again, and without a step around a join (the
#: joining node's own start-up, while the others train, is reported but not held to it).
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
    batch = args.global_batch if kind == "elastic" else args.global_batch // 3
    entry = [str(WORKER), kind, str(args.delay)] + ([str(audit)] if kind == "plain" else [])
    entry += [
        "--float64", "--epochs", str(args.epochs), "--samples", str(args.samples), "--batch-size", str(batch),
        "--checkpoint", str(workdir / "ck"), "--root", str(workdir / "pl"),
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", f"1@step={args.kill_step}", "--add-node", f"@step={args.join_step}",
        "--workdir", str(workdir), "--audit", str(workdir / "audit"),
        "--summary", str(workdir / "summary.json"), "--timeout", str(args.timeout),
        *(["--preload", "elastic_train.lightning"] if kind == "elastic" else []),
        "--entry", *entry,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("ELASTIC_TRAIN_PRELOAD", None)
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
        ("kill_s", "Lightning kill -> training with run --entry"),
        ("join_pause_s", "Lightning join: the job without a step, with run --entry"),
    ):
        values = [r[key] for r in ours if r.get(key) is not None]
        if not values:
            out.append({"name": name, "threshold": f"<= {TARGET_S:g} s"})
            continue
        worst = max(values)
        out.append({
            "name": name,
            "threshold": f"<= {TARGET_S:g} s",
            "figure": ", ".join(f"{v:.2f} s" for v in values),
            "status": "met" if worst <= TARGET_S else "missed",
            "why": "" if worst <= TARGET_S else "see the lightning section (machine load)",
        })  # fmt: skip
    name = "Lightning samples lost or duplicated across a kill and a join"
    if ours:
        bad = sum(r["lost"] + r["duplicated"] for r in ours)
        out.append({
            "name": name, "threshold": "0", "figure": f"{bad} of {sum(r['expected'] for r in ours)}",
            "status": "met" if bad == 0 else "missed", "why": "",
        })  # fmt: skip
    else:
        out.append({"name": name, "threshold": "0"})
    return out


def figures(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for r in runs:
        if "error" in r:
            rows.append({"variant": r["variant"], "error": r["error"]})
            continue
        rows.append({
            "variant": r["variant"], "kill -> training s": r["kill_s"], "join -> training s": r["join_s"],
            "kill: no step for s": r["kill_pause_s"], "join: no step for s": r["join_pause_s"],
            "steps redone (kill)": r["kill_redone"], "steps redone (join)": r["join_redone"],
            "resumed from": r["source"], "samples lost": r["lost"], "samples duplicated": r["duplicated"],
            "of samples": r["expected"], "steps": r["steps"], "job s": r["seconds"],
        })  # fmt: skip
    by = {r["variant"]: r for r in runs if "error" not in r}
    if {"elastic", "plain"} <= set(by):
        e, p = by["elastic"], by["plain"]

        def ratio(key: str) -> float | None:
            return p[key] / e[key] if e.get(key) and p.get(key) is not None else None

        rows.append({"variant": "plain / elastic", "kill -> training s": ratio("kill_s"),
                     "join -> training s": ratio("join_s"), "kill: no step for s": ratio("kill_pause_s"),
                     "join: no step for s": ratio("join_pause_s")})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--samples", type=int, default=240, help="dataset size")
    p.add_argument("--global-batch", type=int, default=24, help="G (plain: G / 3 per rank)")
    p.add_argument("--kill-step", type=int, default=10, help="kill node 1 after this step")
    p.add_argument("--join-step", type=int, default=20, help="a node joins after this step")
    p.add_argument("--delay", type=float, default=0.2, help="seconds added to every step")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="one pair (the default)")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--keep", metavar="DIR", help="keep the jobs' logs, events and audit files in DIR")
    p.add_argument("--only", choices=VARIANTS, help="run one variant (no pairing)")
    args = p.parse_args(argv)
    if args.global_batch % 3:
        p.error("--global-batch: must be a multiple of 3 (the plain variant's per-rank batch is G / 3)")
    load_start = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="et-lightning-") as scratch:
        tmp = args.keep or scratch
        for i in range(1 if args.quick else args.repeats):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            order = tuple(v for v in order if args.only in (None, v))
            for kind in order:
                work = Path(tmp) / f"pair-{i}"
                work.mkdir(parents=True, exist_ok=True)
                runs.append(run_variant(kind, args, work))
    load_end = os.getloadavg()
    if args.json:
        doc = {
            "benchmark": "lightning",
            "title": "PyTorch Lightning under a kill and a join",
            "description": (
                f"3 nodes x 1 worker on loopback (examples/lightning_train.py's model, float64, "
                f"{args.samples} samples x {args.epochs} epochs, global batch {args.global_batch}, "
                f"+{args.delay} s per step): kill -9 of node 1 after step {args.kill_step}, a node joins "
                f"after step {args.join_step}; elastic = ElasticStrategy under `local --preload "
                "elastic_train.lightning --entry`, plain = strategy='ddp' + DistributedSampler + last.ckpt "
                "every 10 steps under the same harness (fork server, Lightning not preloaded). Load average "
                f"at start {[round(x, 2) for x in load_start]}, at end {[round(x, 2) for x in load_end]} "
                f"on {os.cpu_count()} cores."
            ),
            "loadavg": [list(load_start), list(load_end)],
            "runs": runs,
            "figures": figures(runs),
            "targets": targets(runs),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
