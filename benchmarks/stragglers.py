"""Slow nodes: goodput with ``report`` against ``evict``, and false positives of a healthy job under load.

Both run ``elastic-train local`` jobs of 3 nodes (one worker each) on loopback training
:mod:`straggler_task` (the regression task on a simulated accelerator: device time per sample that advances
only while the process runs, no CPU used, so that the 2-core machine's contention does not favour a smaller
world).

- ``goodput``: three jobs paired in one run, identical but for what they do about a slow node:
  ``rendezvous.straggler.policy: report`` (nothing: the baseline), ``evict``, and ``speed`` (policy
  ``report`` with ``train.shares: speed``: the slow node stays and trains a share proportional to its
  speed). Node 1 is slowed ``--factor`` times (``slow-node``: SIGSTOP/SIGCONT duty cycling) from step
  ``--slow-step`` for ``--slow-for`` seconds, then runs at full speed again. Reported per policy: samples
  and steps per second over the run (first to last step), during the slowdown, the eviction's and the
  readmission's times from the fault, the share changes; and the ratios evict / report and speed / report
  (target >= 1.3). Also printed: the median step at each world size during the slowdown, and from them the
  pace with node 1 evicted against the pace with it slowed (what an eviction gains while it holds), and
  how long node 1 was out during its slowdown. With a constant global batch the best an eviction can do
  for one node slowed 2x in 3 is 2 / 1.5 = 1.33x while it is slow (the two others take its samples);
  speed-weighted shares can reach 2 / 1.2 = 1.67x (the slow node keeps a fifth). ``--policies`` runs a
  subset.
- ``false-positives``: a healthy job with ``policy: evict`` for ``--minutes`` minutes while ``--load``
  busy-loop processes started by the benchmark (killed by PID at the end) compete for the cores; every
  ``straggler_flagged`` and ``straggler_evict`` event of every node is counted (target 0).

    PYTHONPATH=. .venv/bin/python benchmarks/stragglers.py goodput --json goodput.json
    PYTHONPATH=. .venv/bin/python benchmarks/stragglers.py false-positives --minutes 10
    PYTHONPATH=. .venv/bin/python benchmarks/stragglers.py goodput --steps 150 --slow-for 4
    PYTHONPATH=. .venv/bin/python benchmarks/stragglers.py goodput --fsdp --json goodput-fsdp.json

``--fsdp`` runs the goodput jobs with the model sharded by FSDP2 (``train.fsdp``, one replica of each shard):
the slow node found from the waits in FSDP2's collectives, evicted through the sharded hot path, or given a
share by its speed (the busy times riding in the loop's loss sum).

``--hf`` runs examples/hf_train.py (a Hugging Face Trainer script, ``ElasticTrainer``; ``--shares speed``
for the ``speed`` job) under ``elastic-train local --entry`` on the same simulated accelerator
(:mod:`on_device`: ``--per-sample-s`` over the 16 tokens of a sample, a token a row of the loss), 240
samples an epoch (10 steps of 24), as many epochs as ``--steps`` asks for:

    PYTHONPATH=. .venv/bin/python benchmarks/stragglers.py goodput --hf --per-sample-s 0.016 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from elastic_train.config import load_job_config
from elastic_train.launch.faults import parse_fault
from elastic_train.launch.local import LocalJob, LocalOptions
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from elastic_train.worker.forkserver import ENV_PRELOAD

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 24
#: examples/hf_train.py under --hf: samples an epoch (10 steps of GLOBAL_BATCH), tokens a sample.
HF_SAMPLES = 240
HF_TOKENS = 16
#: Detection and probation settings of both jobs (the defaults, with reports every second and a probation
#: that lets the slowed node back in after the slowdown).
STRAGGLER = {
    "report_every": 1.0,
    "window": 3,
    "slow_steps": 10,
    "probation_seconds": 15.0,
    "max_evictions": 2,
}


def job(
    work: Path,
    policy: str,
    steps: int,
    faults: list[str],
    per_sample_s: float,
    shares: str = "even",
    fsdp: bool = False,
    hf: bool = False,
) -> dict[str, Any]:
    """One ``elastic-train local`` job; its summary, events and the nodes' straggler events. ``fsdp``: the
    model sharded with FSDP2 (``train.fsdp``), each shard with a replica (``shard_replicas: 1``); ``hf``:
    examples/hf_train.py as the entry (``steps`` a multiple of 10)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    ov: dict[str, Any] = {
        "rendezvous.run_id": f"stragglers-{policy}-{shares}",
        "rendezvous.min_nodes": 2,
        "rendezvous.max_nodes": 3,
        "rendezvous.straggler": {**STRAGGLER, "policy": policy},
        "train.task": "straggler_task:build",
        "train.task_args": {"per_sample_s": per_sample_s},
        "train.steps": steps,
        "train.global_batch": GLOBAL_BATCH,
        "train.shares": shares,
        "train.audit_dir": str(work / "audit"),
        "checkpoint.url": str(work / "ckpt"),
        "checkpoint.every_steps": max(100, steps // 5),
    }
    if fsdp:
        ov.update({"train.fsdp": True, "checkpoint.shard_replicas": 1})
    entry = None
    if hf:
        for key in ("train.task", "train.task_args", "train.shares"):  # the script's own arguments say these
            del ov[key]
        entry = [
            str(HERE / "on_device.py"), str(HERE.parent / "examples" / "hf_train.py"),
            str(per_sample_s / HF_TOKENS),
            "--epochs", str(steps * GLOBAL_BATCH // HF_SAMPLES), "--samples", str(HF_SAMPLES),
            "--global-batch", str(GLOBAL_BATCH), "--shares", shares, "--output-dir", str(work / "hf_output"),
            "--checkpoint-every", str(ov["checkpoint.every_steps"]),
        ]  # fmt: skip
    parsed = [parse_fault(kind, spec) for kind, spec in (f.split(" ", 1) for f in faults)]
    local = LocalJob(
        load_job_config(None, ov),
        LocalOptions(
            config_path=None, overrides=ov, nodes=3, faults=parsed, workdir=str(work / "work"),
            timeout=max(600.0, steps * 1.0), out=io.StringIO(), entry=entry,
        ),
    )  # fmt: skip
    # with --hf, the nodes' fork servers import transformers once
    with mock.patch.dict(os.environ, {ENV_PRELOAD: "elastic_train.hf"} if hf else {}):
        summary = local.run()
    if not summary.succeeded:
        tail = local.opts.out.getvalue()[-2000:]  # type: ignore[attr-defined]
        raise RuntimeError(f"the {policy} job did not finish: {tail}")
    audit = check_exactly_once(str(work / "audit"), steps=steps)
    events = read_events(local.events_path)
    steps_ev = [e for e in events if e.get("event") == "step"]
    decisions = []
    for n in local.nodes:
        for line in Path(n.log_path).read_text(errors="replace").splitlines():
            if line.startswith("{") and '"straggler_' in line:
                decisions.append(json.loads(line))
    return {
        "summary": summary,
        "steps": steps_ev,
        "decisions": decisions,
        "shares": [e for e in events if e.get("event") == "shares"],
        "exactly_once": audit.ok,
        "timeline": summary.world_size_timeline,
    }


def rate(
    steps: list[dict[str, Any]], start: float | None = None, end: float | None = None
) -> dict[str, float]:
    """Steps and samples per second between the first and the last step event in [start, end]."""
    times = [float(e["time"]) for e in steps if (start is None or e["time"] >= start)]
    times = [t for t in times if end is None or t <= end]
    if len(times) < 2:
        return {"steps_per_s": 0.0, "samples_per_s": 0.0}
    per_s = (len(times) - 1) / (times[-1] - times[0])
    return {"steps_per_s": round(per_s, 3), "samples_per_s": round(per_s * GLOBAL_BATCH, 1)}


def paces(steps: list[dict[str, Any]], start: float, end: float) -> dict[int, tuple[float, float]]:
    """Per world size: (median seconds a step, seconds spent) over the steps that ended in [start, end],
    each timed from the step before it in the same round (the first step of a round includes the
    re-formation and is left out)."""
    spans: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(steps):
        if a.get("round") == b.get("round") and start <= float(b["time"]) <= end:
            spans.setdefault(int(b["world_size"]), []).append(float(b["time"]) - float(a["time"]))
    return {w: (round(statistics.median(d), 3), round(sum(d), 1)) for w, d in spans.items()}


def goodput(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    fault = f"slow-node 1@step={args.slow_step},factor={args.factor:g},for={args.slow_for:g}"
    if args.hf and (args.fsdp or args.steps % (HF_SAMPLES // GLOBAL_BATCH)):
        raise SystemExit("stragglers: --hf runs whole epochs (--steps a multiple of 10), without --fsdp")
    out: dict[str, Any] = {
        "fault": fault, "steps": args.steps, "straggler": STRAGGLER, "fsdp": args.fsdp, "hf": args.hf,
    }  # fmt: skip
    for policy in args.policies.split(","):
        shares = "speed" if policy == "speed" else "even"
        r = job(
            tmp / policy, "report" if policy == "speed" else policy, args.steps, [fault], args.per_sample_s,
            shares, fsdp=args.fsdp, hf=args.hf,
        )  # fmt: skip
        f = r["summary"].faults[0]
        fired = f.fired_at or 0.0
        evicted = [d for d in r["decisions"] if d["event"] == "straggler_evicted"]
        flagged = [d for d in r["decisions"] if d["event"] == "straggler_flagged"]
        sizes = r["timeline"]
        back = next((p for p in sizes[1:] if p["world_size"] == 3), None)
        row = {
            "policy": policy,
            **rate(r["steps"]),
            "slow_span": rate(r["steps"], fired, fired + args.slow_for),
            "slow_span_paces": {
                f"world {w}": {"median_step_s": m, "seconds": t}
                for w, (m, t) in sorted(paces(r["steps"], fired, fired + args.slow_for).items())
            },
            "flagged_after_s": round(_ts(flagged[0]) - fired, 2) if flagged else None,
            "evictions": len(evicted),
            "evicted_after_s": round(_ts(evicted[0]) - fired, 2) if evicted else None,
            "readmitted_at_step": back["step"] if back else None,
            "share_changes": [
                {"step": e["step"], "after_s": round(float(e["time"]) - fired, 2), "new": e["new"]}
                for e in r["shares"]
            ],
            "world_sizes": " -> ".join(f"{p['world_size']}@{p['step']}" for p in sizes),
            "exactly_once": r["exactly_once"],
            "load": round(os.getloadavg()[0], 1),
        }
        out[policy] = row
        print(json.dumps(row), flush=True)
    rep = out.get("report")
    if rep is None or not rep["samples_per_s"] or not rep["slow_span"]["samples_per_s"]:
        return out
    for name in ("evict", "speed"):
        if name not in out:
            continue
        other = out[name]
        whole = round(other["samples_per_s"] / rep["samples_per_s"], 3)
        span = round(other["slow_span"]["samples_per_s"] / rep["slow_span"]["samples_per_s"], 3)
        out["ratio" if name == "evict" else "ratio_speed"] = whole
        out["ratio_slow_span" if name == "evict" else "ratio_speed_slow_span"] = span
        verdict = "met" if whole >= 1.3 else "MISSED"
        print(
            f"goodput {name} / report over the run: {whole}x (target >= 1.3: {verdict}); "
            f"during the slowdown: {span}x"
        )
    # What an eviction does while it holds, apart from detection and trials: the pace without the slowed
    # node against the pace with it (the bound with a constant global batch: 2 / 1.5 at factor 2).
    slowed = rep["slow_span_paces"].get("world 3")
    without = out["evict"]["slow_span_paces"].get("world 2") if "evict" in out else None
    if slowed and without:
        out["pace_ratio"] = round(slowed["median_step_s"] / without["median_step_s"], 3)
        print(
            f"while evicted, {out['pace_ratio']}x the slowed pace ({without['median_step_s']} s a step "
            f"against {slowed['median_step_s']} s); out for {without['seconds']} s of the "
            f"{args.slow_for:g} s slowdown"
        )
    return out


def false_positives(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    step_s = GLOBAL_BATCH / 3 * args.per_sample_s + 0.015  # device time per step at world 3, plus overhead
    steps = max(50, int(args.minutes * 60 / step_s))
    spin = "import os\nos.nice(0)\nwhile True:\n    pass\n"
    load = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.load)]
    started = time.monotonic()
    try:
        r = job(tmp / "healthy", "evict", steps, [], args.per_sample_s)
    finally:
        for p in load:
            p.kill()
            p.wait()
    minutes = (time.monotonic() - started) / 60
    flagged = [d for d in r["decisions"] if d["event"] == "straggler_flagged"]
    evicted = [d for d in r["decisions"] if d["event"] == "straggler_evict"]
    out = {
        "minutes": round(minutes, 1),
        "steps": steps,
        "load_processes": args.load,
        "load": round(os.getloadavg()[0], 1),
        **rate(r["steps"]),
        "flagged": len(flagged),
        "evictions": len(evicted),
        "scores_flagged": [d["score"] for d in flagged],
        "exactly_once": r["exactly_once"],
    }
    verdict = "met" if not evicted else "MISSED"
    print(json.dumps(out))
    print(
        f"false positives in {minutes:.1f} min: {len(flagged)} flagged, {len(evicted)} evicted "
        f"(target 0: {verdict})"
    )
    return out


def _ts(event: dict[str, Any]) -> float:
    """Unix time of a JSON log event."""
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("goodput", "false-positives"))
    p.add_argument("--steps", type=int, default=900, help="goodput: steps of each job")
    p.add_argument("--slow-step", type=int, default=60, help="goodput: slow node 1 after this step")
    p.add_argument("--slow-for", type=float, default=30.0, help="goodput: seconds it stays slow")
    p.add_argument("--factor", type=float, default=2.0, help="goodput: how many times slower")
    p.add_argument("--minutes", type=float, default=10.0, help="false-positives: length of the healthy job")
    p.add_argument("--load", type=int, default=2, help="false-positives: busy-loop processes beside the job")
    p.add_argument(
        "--policies", default="report,evict,speed", help="goodput: the jobs to run (report first for ratios)"
    )
    p.add_argument("--per-sample-s", type=float, default=0.008, help="simulated device seconds per sample")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="goodput: the model sharded by FSDP2 (train.fsdp, shard_replicas 1)",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help="goodput: examples/hf_train.py (Hugging Face Trainer, ElasticTrainer) as the entry of each job",
    )
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--keep", metavar="DIR", help="keep the jobs' directories (logs, events) here")
    args = p.parse_args(argv)
    keep = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="et-slow-")
    with keep as tmp:
        run = goodput if args.mode == "goodput" else false_positives
        result = {"mode": args.mode, **run(args, Path(tmp))}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
