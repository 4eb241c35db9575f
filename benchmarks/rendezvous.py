"""Side-by-side rendezvous benchmark: our etcd v3 handlers against torchrun's own backends, in one run.

Scenarios (real torchrun agents on loopback, ``--nnodes=2:4 --nproc-per-node=1``, tiny gloo DDP worker):

- ``launch``: start 3 agents -> seconds until the first step at world size 3 (from launching the first).
- ``kill``: kill -9 one node (agent + workers) while training at 3 -> first step at world size 2.
- ``scale_up``: start a 4th node while training at 3 -> first step at world size 4 (from starting it).
- ``hang``: SIGSTOP one node while training at 3 -> first step at world size 2.

Each repeat runs three jobs per configuration (launch+scale_up, launch+kill, launch+hang), so ``launch`` gets
three samples per repeat. A baseline that does not get there within the cap is a result ("> cap"), not an
error. Configurations run interleaved within a repeat so that machine noise spreads over all of them.

    .venv/bin/python benchmarks/rendezvous.py --quick --json out.json

JSON (``--json FILE``, rewritten after every job; ``complete`` is false until the last one)::

    {"benchmark": "rendezvous", "schema": 1, "quick", "repeats", "command", "machine": {cpu, cores, ram_gib,
     loadavg, torch, python, etcd, platform}, "loadavg_end", "started", "seconds", "planned_jobs", "complete",
     "settings": {nnodes, cap, hang_cap, step_interval, monitor_interval, max_restarts, jobs, baseline_jobs},
     "ours": "etcd3", "configs": [{name, backend, rdzv_conf, env, ours, description}], "not_run": {name: why},
     "scenarios": {SCENARIO: {"title", "results": {CONFIG: {"samples": [{status, seconds, cap, detail}],
                   "summary": {n, ok, median, median_censored, min, max, max_censored, cap},
                   "phases": [{workers_started, all_started, imported, pg_ready, first_step}]}}}},
     "ratios": {SCENARIO: {BASELINE: {"ratio": baseline median / etcd3 median, "lower_bound"} | null}},
     "timelines": {SCENARIO: {CONFIG: [[seconds since event, world size], ...]}},   # first repeat, rank 0
     "runs": [{config, job, repeat, samples, victim, store_host, phases, launch_phases}]}

SCENARIO is one of launch, kill, scale_up, hang; a sample's status is ok, timeout (not within the cap),
failed (every agent exited) or not_run (its launch failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CONFIGS,
    MAX_RESTARTS,
    MONITOR_INTERVAL,
    BackendConfig,
    Job,
    Outcome,
    format_ratio,
    format_summary,
    machine_info,
    phases,
    speedup,
    summarize,
    timeline,
)

SCENARIOS = {
    "launch": "launch 3 agents -> first step at world 3",
    "kill": "kill -9 one node -> first step at world 2",
    "scale_up": "add a 4th node -> first step at world 4",
    "hang": "SIGSTOP one node -> first step at world 2",
}
#: The configuration every ratio is taken against.
OURS = "etcd3"
DEFAULT_CONFIGS = [
    "etcd3", "etcd3-torchrun", "etcd3-dynamic", "c10d", "c10d-tuned", "etcd-v2", "etcd-v2-tuned",
]  # fmt: skip
#: Configurations with torchrun's default timings (30 s last call, etc.): each job takes a minute or more and
#: often ends at the cap, so ``--slow-repeats`` (default 1) bounds how often they run.
SLOW_CONFIGS = ("etcd3-dynamic", "c10d", "etcd-v2", "etcd")
QUICK_CONFIGS = ["etcd3", "c10d-tuned"]
#: Jobs per repeat: name -> the scenario it runs after ``launch``.
JOBS = {"scale": "scale_up", "kill": "kill", "hang": "hang"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 repeat, fewer configurations (< ~2 min)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per configuration (default 3, quick 1)")
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated configurations from: {', '.join(CONFIGS)} "
        f"(default {','.join(DEFAULT_CONFIGS)}; quick {','.join(QUICK_CONFIGS)})",
    )
    p.add_argument(
        "--scenarios", default=",".join(JOBS), help="jobs to run per repeat: scale,kill,hang (default all)"
    )
    p.add_argument(
        "--cap", type=float, default=90.0, help="seconds before a scenario counts as failed/stalled"
    )
    p.add_argument(
        "--hang-cap", type=float, default=60.0, help="cap for the SIGSTOP scenario on every config but etcd3"
    )
    p.add_argument(
        "--slow-repeats",
        type=int,
        default=None,
        help=f"repeats for the default-timing configurations {', '.join(SLOW_CONFIGS)} (default: 1, "
        "or --repeats if smaller)",
    )
    p.add_argument("--step-interval", type=float, default=0.1, help="seconds between worker steps")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep job directories (logs, progress) for debugging")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.slow_repeats = min(args.repeats, 1 if args.slow_repeats is None else args.slow_repeats)
    names = args.configs.split(",") if args.configs else (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s): {', '.join(unknown)}")
    args.config_names = names
    jobs = args.scenarios.split(",")
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        p.error(f"unknown scenario job(s): {', '.join(bad)} (choose from {', '.join(JOBS)})")
    # Quick mode keeps to ~2 minutes: baselines run only the kill job (the figure a target compares with a
    # tuned baseline); their hang figure is "> cap" by construction and not worth the cap in time.
    args.baseline_jobs = ["kill"] if args.quick and args.scenarios == ",".join(JOBS) else jobs
    args.jobs = jobs
    return args


def handler_available(config: BackendConfig) -> str | None:
    """None when torchrun can load this configuration's handler here, else the reason it cannot."""
    if not config.ours:
        return None
    from importlib.metadata import entry_points

    import torch.distributed.elastic.rendezvous  # noqa: F401  (registers out-of-tree handlers first)

    found = [ep for ep in entry_points(group="torchrun.handlers") if ep.name == config.backend]
    if not found:
        return f"no torchrun.handlers entry point named {config.backend!r} (pip install -e .)"
    try:
        found[0].load()
    except Exception as exc:
        return f"handler {config.backend!r} does not load: {exc}"
    return None


def run_job(config: BackendConfig, job_kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job: launch 3 agents, then the job's fault or scale event. Returns samples, timeline, phases."""
    scenario = JOBS[job_kind]
    cap = args.hang_cap if scenario == "hang" and config.name != OURS else args.cap
    out: dict[str, Any] = {"config": config.name, "job": job_kind, "samples": {}}
    with Job(config, step_interval=args.step_interval, keep=args.keep) as job:
        out["workdir"] = job.workdir if args.keep else None
        t0 = job.add_nodes(3)
        launch = job.wait_world(3, t0, args.cap)
        out["samples"]["launch"] = launch.to_json()
        out["launch_phases"] = phases(job.reader.records, 3, t0)
        if launch.status != "ok":
            out["samples"][scenario] = Outcome("not_run", detail="launch did not reach world 3").to_json()
            return out
        job.wait_steps(3, 5, time.time(), cap=15)
        if scenario == "scale_up":
            target = 4
            t_event = job.add_node().started
            out["victim"] = None
        else:
            target = 2
            victim = job.pick_victim()
            out["victim"], out["store_host"] = victim, job.store_host()
            t_event = job.kill_node(victim) if scenario == "kill" else job.stop_node(victim)
        result = job.wait_world(target, t_event, cap)
        if result.status == "ok":
            job.wait_steps(target, 10, time.time(), cap=3)
        job.reader.poll()
        out["samples"][scenario] = result.to_json()
        out["phases"] = phases(job.reader.records, target, t_event)
        end = (result.seconds or cap) + 2.0
        out["timeline"] = timeline(job.reader.records, t_event, -3.0, end)
    return out


def collect(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per scenario and configuration: samples and their summary; ratios of each baseline to ours."""
    scenarios: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for scen, title in SCENARIOS.items():
        per_config: dict[str, Any] = {}
        for name in names:
            samples = [r["samples"][scen] for r in runs if r["config"] == name and scen in r["samples"]]
            if samples:
                phase_list = [r["phases"] for r in runs if r["config"] == name and JOBS[r["job"]] == scen]
                if scen == "launch":
                    phase_list = [r["launch_phases"] for r in runs if r["config"] == name]
                per_config[name] = {"samples": samples, "summary": summarize(samples), "phases": phase_list}
        if per_config:
            scenarios[scen] = {"title": title, "results": per_config}
        if OURS in per_config:
            ours = per_config[OURS]["summary"]
            ratios[scen] = {
                name: speedup(res["summary"], ours) for name, res in per_config.items() if name != OURS
            }
    return {"scenarios": scenarios, "ratios": ratios}


def print_table(result: dict[str, Any], names: list[str]) -> None:
    print()
    print(
        f"{'scenario':<10} {'config':<15} {'seconds: median [min, max] (ok/n)':<38} {'etcd3 faster by':>15}"
    )
    for scen, block in result["scenarios"].items():
        for name in names:
            if name not in block["results"]:
                continue
            summary = block["results"][name]["summary"]
            ratio = result["ratios"].get(scen, {}).get(name)
            ratio_s = "(ours)" if name == OURS else format_ratio(ratio)
            print(f"{scen:<10} {name:<15} {format_summary(summary):<38} {ratio_s:>15}")
    print()


def write_json(path: str, args: argparse.Namespace, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Write the results so far (rewritten after every job, so an interrupted run still leaves data)."""
    active = [n for n in args.config_names if n not in meta["not_run"]]
    timelines: dict[str, dict[str, Any]] = {}
    for r in runs:
        if "timeline" in r and r["repeat"] == 0:
            timelines.setdefault(JOBS[r["job"]], {})[r["config"]] = r["timeline"]
    doc = {
        **meta,
        "seconds": round(time.time() - meta["started"], 1),
        "complete": len(runs) == meta["planned_jobs"],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        **collect(runs, active),
        "timelines": timelines,
        "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in runs],
    }
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the jobs' cleanup on SIGTERM too
    os.environ.setdefault("ELASTIC_TRAIN_LOG_LEVEL", "warning")
    from elastic_train.log import configure_logging

    configure_logging()
    configs = [CONFIGS[n] for n in args.config_names]
    skipped = {c.name: why for c in configs if (why := handler_available(c))}
    for name, why in skipped.items():
        print(f"{name}: not run ({why})", flush=True)
    active = [c for c in configs if c.name not in skipped]
    plan = [
        (repeat, job_kind, config)
        for repeat in range(args.repeats)
        for job_kind in args.jobs
        for config in active
        if (config.ours or job_kind in args.baseline_jobs)
        and (repeat < args.slow_repeats or config.name not in SLOW_CONFIGS)
    ]
    meta: dict[str, Any] = {
        "benchmark": "rendezvous",
        "schema": 1,
        "quick": args.quick,
        "repeats": args.repeats,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "machine": machine_info(),
        "started": time.time(),
        "planned_jobs": len(plan),
        "settings": {
            "nnodes": "2:4",
            "nproc_per_node": 1,
            "cap": args.cap,
            "hang_cap": args.hang_cap,
            "step_interval": args.step_interval,
            "monitor_interval": MONITOR_INTERVAL,
            "max_restarts": MAX_RESTARTS,
            "jobs": args.jobs,
            "baseline_jobs": args.baseline_jobs,
            "slow_repeats": args.slow_repeats,
            "slow_configs": list(SLOW_CONFIGS),
        },
        "ours": OURS,
        "configs": [c.to_json() for c in configs],
        "not_run": skipped,
    }
    started = meta["started"]
    runs: list[dict[str, Any]] = []
    for repeat, job_kind, config in plan:
        run = run_job(config, job_kind, args)
        run["repeat"] = repeat
        runs.append(run)
        figures = ", ".join(
            f"{k} {v['seconds']:.2f} s" if v["status"] == "ok" else f"{k} {v['status']}"
            for k, v in run["samples"].items()
        )
        print(f"[{time.time() - started:6.0f}s] repeat {repeat} {config.name:<14} {figures}", flush=True)
        if args.json_path:
            write_json(args.json_path, args, meta, runs)

    result = collect(runs, [c.name for c in active])
    print_table(result, [c.name for c in active])
    for scen, block in result["scenarios"].items():
        for name, res in block["results"].items():
            for s in res["samples"]:
                if s["status"] not in ("ok", "not_run") and s.get("detail"):
                    print(f"{scen} {name} {s['status']}: {s['detail'][:400]}")
    if args.json_path and not runs:
        write_json(args.json_path, args, meta, runs)
    return 0


if __name__ == "__main__":
    from elastic_train.errors import ElasticTrainError

    try:
        sys.exit(main())
    except ElasticTrainError as exc:  # e.g. no etcd binary: one clear line, not a traceback
        print(f"rendezvous benchmark: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
