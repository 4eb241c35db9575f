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
     "runs": [{config, job, repeat, samples, victim, store_host, phases, launch_phases}],
     "title", "description", "figures", "tables", "targets"}   # what the report shows (benchmarks/report.py)

SCENARIO is one of launch, kill, scale_up, hang; a sample's status is ok, timeout (not within the cap),
failed (every agent exited) or not_run (its launch failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CONFIGS,
    MAX_RESTARTS,
    MONITOR_INTERVAL,
    OURS,
    BackendConfig,
    Job,
    Outcome,
    format_ratio,
    format_summary,
    machine_info,
    phases,
    speedup,
    summarize,
    without_dirs,
)

SCENARIOS = {
    "launch": "launch 3 agents -> first step at world 3",
    "kill": "kill -9 one node -> first step at world 2",
    "scale_up": "add a 4th node -> first step at world 4",
    "hang": "SIGSTOP one node -> first step at world 2",
}
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
    """One job: launch 3 agents, then the job's fault or scale event. Returns samples and phases."""
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


#: The targets of this benchmark: (name, scenario, the bar in words, the baselines each ratio must reach,
#: the reason).
TARGETS = (
    ("launch 3 agents -> first step", "launch", ">= 4x faster than c10d and etcd-v2 defaults",
     {"c10d": 4.0, "etcd-v2": 4.0}, "a job starts without torchrun's default 30 s last-call wait"),
    ("kill -9 one node -> first step at world 2", "kill",
     ">= 10x faster than etcd-v2 defaults, faster than c10d-tuned", {"etcd-v2": 10.0, "c10d-tuned": 1.0},
     "a lost node is noticed by its lease, not by a keep-alive timeout, and no worker restarts"),
    ("add a 4th node -> first step at world 4", "scale_up", "<= 5 s (etcd3)", {},
     "a node that joins is in the next round within one settle window plus a worker start"),
)  # fmt: skip
#: The phases of a recovery the report shows, as its columns name them.
PHASES = {
    "workers_started": "first worker",
    "all_started": "all started",
    "imported": "torch imported",
    "pg_ready": "process group",
    "first_step": "first step",
}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendezvous targets: ratios of the baselines' medians to ours (a baseline that never got there
    within its cap gives a lower bound: short of the bar, that is inconclusive, not missed), and the
    scale-up time."""
    out = []
    for name, scen, bar, ratio_bars, why in TARGETS:
        block = doc["scenarios"].get(scen, {}).get("results", {})
        ours = block.get(OURS, {}).get("summary")
        target: dict[str, Any] = {"name": name, "threshold": bar}
        if not ours or ours.get("median") is None:
            out.append(target | {"why": f"{OURS} {scen} not measured"})
            continue
        figure = f"{OURS} {format_summary(ours)}"
        statuses, notes = [], []
        if not ratio_bars:  # the time itself
            statuses.append("met" if not ours["median_censored"] and ours["median"] <= 5.0 else "missed")
        for base, need in ratio_bars.items():
            ratio = (doc["ratios"].get(scen) or {}).get(base)
            bsum = block.get(base, {}).get("summary")
            figure += f"; {base} {format_summary(bsum or {})} ({format_ratio(ratio)})"
            if ratio is None:
                statuses.append("not measured")
                notes.append(f"no figure for {base}")
            elif ratio["ratio"] >= need if need > 1 else ratio["ratio"] > need:
                statuses.append("met")
                if ratio["lower_bound"]:
                    notes.append(f"{base} did not get there within the cap: ratio is a lower bound")
            else:
                statuses.append("inconclusive" if ratio["lower_bound"] else "missed")
                notes.append(f"{base} {format_ratio(ratio)} (bar {need:g}x)")
        phases = [p for p in block.get(OURS, {}).get("phases", []) if p]
        started = _median([p["workers_started"] for p in phases if p.get("workers_started") is not None])
        formed = _median([p["pg_ready"] for p in phases if p.get("pg_ready") is not None])
        if started is not None and formed is not None:
            notes.append(
                f"{OURS}: workers started at {started:.1f} s, process group formed at {formed:.1f} s"
            )
        status = next((s for s in ("missed", "not measured", "inconclusive") if s in statuses), "met")
        out.append(target | {"figure": figure, "status": status, "why": "; ".join([why, *notes])})
    return out


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (its samples, summaries and ratios) with what the report shows: every configuration per
    scenario with the ratio of its median to ours, where the time goes, the runs that did not get there and
    the targets."""
    st = doc["settings"]
    names = [c["name"] for c in doc["configs"] if c["name"] not in doc["not_run"]]
    figures = []
    for scen, block in doc["scenarios"].items():
        row: dict[str, Any] = {"scenario": block["title"]}
        for n in names:
            res = block["results"].get(n)
            ratio = (doc["ratios"].get(scen) or {}).get(n)
            row[f"`{n}`"] = (
                "not run"
                if res is None
                else format_summary(res["summary"])
                + (f"<br>{OURS} {format_ratio(ratio)} faster" if ratio else "")
            )
        figures.append(row)
    phase_rows, failures = [], []
    for scen, block in doc["scenarios"].items():
        for n, res in block["results"].items():
            row = {"scenario": scen, "config": f"`{n}`"}
            for key, label in PHASES.items():
                m = _median([p[key] for p in res["phases"] if p and p.get(key) is not None])
                row[label] = "-" if m is None else f"{m:.2f}"
            phase_rows.append(row)
            failures += [
                {
                    "scenario": scen,
                    "config": f"`{n}`",
                    "status": x["status"],
                    "detail": without_dirs(x.get("detail", ""))[:500],
                }
                for x in res["samples"]
                if x["status"] not in ("ok", "not_run")
            ]
    configs = [
        f"- `{c['name']}`: {c['description']}"
        + "".join(
            f" `{x}`"
            for x in (
                "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in c["rdzv_conf"].items())
                if c.get("rdzv_conf")
                else "",
                " ".join(f"{k}={v}" for k, v in c["env"].items()) if c.get("env") else "",
            )
            if x
        )
        for c in doc["configs"]
    ] + [f"- `{n}`: not run ({why})" for n, why in doc["not_run"].items()]
    tables = [
        {
            "caption": "Where the time goes: median seconds from the event to the first new worker process "
            "starting (detection + rendezvous + spawn), the last rank's worker starting, the last rank done "
            "importing torch, the first rank with its process group and DDP model (store bootstrap + gloo "
            "mesh), and the first step.",
            "rows": phase_rows,
        }
    ]
    if failures:
        tables.append(
            {"caption": "Runs that did not get there (agent states and last log lines):", "rows": failures}
        )
    partial = (
        f"**Partial run**: {len(doc['runs'])} of {doc['planned_jobs']} jobs finished before the benchmark "
        "stopped; the figures cover those only. "
        if not doc["complete"]
        else ""
    )
    quick = (
        f"Quick mode: the baselines ran only the {', '.join(st['baseline_jobs'])} job(s). "
        if st["baseline_jobs"] != st["jobs"]
        else ""
    )
    description = (
        f"3 torchrun agents on loopback, `--nnodes={st['nnodes']} --nproc-per-node=1`, tiny gloo DDP worker "
        f"stepping every {st['step_interval']} s, `--monitor-interval={st['monitor_interval']}` (torchrun's "
        f"default) and `--max-restarts={st['max_restarts']}` for every backend; {doc['repeats']} repeat(s). "
        "Seconds are median [min, max] (runs that got there / runs); `> cap` means the backend did not train "
        f"at the new size within the cap ({st['cap']} s; SIGSTOP on baselines {st['hang_cap']} s): it failed "
        f"or stalled. Ratios are baseline median / {OURS} median. The node killed or frozen is the most "
        "recently started one that does not host c10d's TCPStore (losing that host ends a c10d job by "
        "design, which is not a recovery figure). Each repeat runs three jobs per configuration (launch + "
        "add a node, launch + kill, launch + SIGSTOP), so `launch` has up to three samples per repeat. "
        f"{partial}{quick}Load average at start {doc['machine']['loadavg']}, at end {doc['loadavg_end']}. "
        "Configurations:\n\n" + "\n".join(configs)
    )
    return doc | {
        "title": "Rendezvous and recovery with torchrun agents",
        "description": description,
        "figures": figures,
        "tables": tables,
        "targets": targets(doc),
    }


def write_json(path: str, args: argparse.Namespace, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Write the results so far (rewritten after every job, so an interrupted run still leaves data)."""
    active = [n for n in args.config_names if n not in meta["not_run"]]
    doc = {
        **meta,
        "seconds": round(time.time() - meta["started"], 1),
        "complete": len(runs) == meta["planned_jobs"],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        **collect(runs, active),
        "runs": runs,
    }
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(summary(doc), indent=1) + "\n", encoding="utf-8")
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
