"""Hot recovery against the restart path, paired in one run: a kill, a SIGSTOP and a join, three loops.

Each scenario runs ``elastic-train local`` jobs (3 nodes of one worker on loopback, ``--min-nodes 2
--max-nodes 3``) with ``rendezvous.hot`` on and off, in alternating order so that machine noise spreads
over both modes:

- ``kill``: node 1 is killed (agent and worker, SIGKILL) after ``--kill-step``; the figure is the kill ->
  the first optimizer step of the next round (at world 2). The same job adds a node ``--gap-steps`` later:
- ``join``: the joining worker's ``model_built`` log event (its model, optimizer and data exist; the
  moment it could train) -> the first step of the round that admits it (at world 3). Where the worker
  logs no ``model_built`` the joiner's start is used instead and the run says so (``join_basis``). The
  same join is also timed from the joining node's process start (``join_start_s``), split into phases from
  the joiner's events (``join_breakdown``, :data:`JOIN_PHASES`): where a new node's seconds go.
- ``stop``: node 1 is stopped (SIGSTOP, agent and worker) after ``--kill-step`` and never resumed; the
  figure is the stop -> the first step without it. Its peers are blocked in a collective that never fails
  on its own: they wait for its lease to expire; then hot recovery has them cut their group's connections
  and re-form in-process, and the restart path restarts them.

Loops: ``builtin`` (the built-in worker), ``own`` (``examples/own_loop.py`` under ``--entry``),
``compiled`` (``benchmarks/hot_compiled.py``: a ``torch.compile``d model of 8 small blocks, kill only; the
inductor cache is warmed by one run of the script before the paired jobs, so the restart path pays a
warm recompilation and the hot path none).

For hot kills the seconds are split into phases from the nodes' logs (``breakdown``): detection (the kill
-> the survivors' failed collective, ``group_broken``), the agents' round (``hot_round``), the new group
(``group_reformed``), the restore (``restored``), the first step. ``--torchft-python PATH`` also runs
``torchft_probe.py`` with that interpreter (a venv with ``torchft-nightly``) and reports its figures beside
ours.

Targets: kill <= 0.5 s, join <= 0.5 s after the joiner's model is built, compiled kill <= 1 s (hot). The
load average at the start and the end is part of the document: on a shared machine the ratio
restart/hot is the steadier figure.

    PYTHONPATH=. .venv/bin/python benchmarks/hot.py --json hot.json
    PYTHONPATH=. .venv/bin/python benchmarks/hot.py --quick --scenarios builtin:kill-join
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_KILL_S = 0.5
TARGET_JOIN_S = 0.5
TARGET_COMPILED_S = 1.0
MODES = {"hot": "true", "restart": "false"}
#: (loop, job kind) pairs the default run measures; ``kill-join`` jobs give the kill and the join figure.
SCENARIOS = ("builtin:kill-join", "builtin:stop", "own:kill-join", "own:stop", "compiled:kill")
#: Samples per step of the own-loop scripts (examples/own_loop.py's default global batch).
OWN_BATCH = 16
OWN_SAMPLES = 960
#: The own-loop script's tails are this many times the built-in loop's (its steps are that much shorter).
OWN_TAIL_FACTOR = 25
#: Phases of a hot kill and the log event that ends each (the first after the kill on every survivor).
HOT_PHASES = (
    ("detect", "group_broken"),
    ("round", "hot_round"),
    ("group", "group_reformed"),
    ("restore", "restored"),
)
RESTART_PHASES = (("round", "rendezvous_complete"), ("start+restore", "restored"))
#: Phases of a join measured from the joining node's process start, and the joiner's log event that ends
#: each: the agent's interpreter, imports, preflight (etcd) and torchrun up to its rendezvous handler; its
#: first rendezvous (a standby start on the hot path); the stand-in's start, its wait for the fork server's
#: imports and the fork (``worker_created``: the worker's ``worker_ready`` less its ``since_exec_s``); the
#: worker's imports and task build; the admission round; then ``first_step`` at world 3. The fork server's
#: imports run beside the agent's: ``forkserver_ready`` is reported as a time since the start.
JOIN_PHASES = (
    ("agent", "rendezvous_node_started"),
    ("rendezvous", "standby_start"),
    ("worker_start", "worker_created"),
    ("build", "model_built"),
    ("admission", "standby_admitted"),
)


# ------------------------------------------------------------------------------------------- one job


def job_steps(loop: str, kind: str, args: argparse.Namespace) -> int:
    """Steps of a job: the faults' steps plus the tail trained after the last one (longer for the own-loop
    script, whose steps are several times shorter: the joiner must have time to start)."""
    factor = OWN_TAIL_FACTOR if loop == "own" else 1
    if kind == "kill-join":
        return args.kill_step + args.gap_steps + factor * args.tail_steps
    return args.kill_step + factor * args.stop_tail_steps


def job_command(loop: str, kind: str, mode: str, args: argparse.Namespace, workdir: Path) -> list[str]:
    """The ``elastic-train local`` command of one job."""
    steps = job_steps(loop, kind, args)
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--steps", str(steps),
        "--set", f"rendezvous.hot={MODES[mode]}",
        "--workdir", str(workdir), "--summary", str(workdir / "summary.json"),
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    if kind in ("kill-join", "kill"):
        cmd += ["--kill-node", f"1@step={args.kill_step}"]
    if kind == "kill-join":
        cmd += ["--add-node", f"@step={args.kill_step + args.gap_steps}"]
    if kind == "stop":
        cmd += ["--hang-node", f"1@step={args.kill_step}"]
    ckpt = str(workdir / "ckpt")
    if loop == "builtin":
        cmd += ["--checkpoint", ckpt, "--checkpoint-every", "0"]
    elif loop == "own":
        epochs = math.ceil(steps / (OWN_SAMPLES // OWN_BATCH))
        cmd += ["--entry", str(ROOT / "examples" / "own_loop.py"), "--epochs", str(epochs),
                "--samples", str(OWN_SAMPLES), "--global-batch", str(OWN_BATCH), "--workers", "0",
                "--checkpoint", ckpt, "--checkpoint-every", "0"]  # fmt: skip
    elif loop == "compiled":
        cmd += ["--entry", str(HERE / "hot_compiled.py"), "--steps", str(steps), "--checkpoint", ckpt]
    else:
        raise ValueError(f"unknown loop {loop!r}")
    return cmd


def run_job(
    loop: str, kind: str, mode: str, args: argparse.Namespace, work: Path, repeat: int
) -> dict[str, Any]:
    """One job: its figures (``kill_s``, ``join_s``, ``stop_s``, breakdown), or the error."""
    workdir = work / f"{loop}-{kind}-{mode}-{repeat}"
    cmd = job_command(loop, kind, mode, args, workdir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.time()
    head = {"loop": loop, "kind": kind, "mode": mode, "repeat": repeat}
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout + 120
        )
    except subprocess.TimeoutExpired:
        return {**head, "error": f"no result within {args.timeout + 120:.0f} s"}
    path = workdir / "summary.json"
    if not path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {**head, "error": f"exit {proc.returncode}: {' | '.join(tail)[:300]}"}
    out = {
        **head,
        **job_figures(workdir, json.loads(path.read_text()), mode),
        "seconds": round(time.time() - t, 1),
    }
    print(f"   {loop}:{kind} {mode:<8} repeat {repeat}: {json.dumps(out)}", flush=True)
    return out


def job_figures(workdir: Path, summary: dict[str, Any], mode: str) -> dict[str, Any]:
    """The figures of one finished job from its summary, its progress events and its nodes' logs."""
    faults = {f["kind"]: f for f in summary.get("faults", [])}
    steps = read_step_events(workdir / "events.jsonl")
    logs = {int(p.stem.split("-")[1]): read_log_events(p) for p in sorted(workdir.glob("node-*.log"))}
    out: dict[str, Any] = {
        "succeeded": bool(summary.get("succeeded")),
        "exactly_once": (summary.get("exactly_once") or {}).get("ok"),
        "reformed": count_events(logs.values(), "group_reformed"),
        "fallbacks": count_events(logs.values(), "hot_fallback"),
    }
    kill, stop, add = faults.get("kill-node"), faults.get("hang-node"), faults.get("add-node")
    if kill is not None:
        out["kill_s"] = kill.get("resumed_s")
        out["kill_redone"] = kill.get("steps_redone")
        fired = fired_at(kill, steps)
        if fired is not None:
            survivors = {n: ev for n, ev in logs.items() if n != kill.get("node") and n in (0, 1, 2)}
            phases = HOT_PHASES if mode == "hot" else RESTART_PHASES
            out["kill_breakdown"] = breakdown(survivors, fired, kill.get("resumed_s"), phases)
            out["kill_details"] = hot_details(survivors, fired) if mode == "hot" else {}
            graphs = graphs_compiled_after(survivors, fired)
            if graphs is not None:
                out["graphs_compiled_after_kill"] = graphs
    if stop is not None:
        out["stop_s"] = stop.get("resumed_s")
    if add is not None:
        joiner = (add.get("extra") or {}).get("new_node")
        events = logs.get(joiner, []) if isinstance(joiner, int) else []
        out.update(join_ready(events, add, steps))
        out.update(join_from_start(events, add, steps))
    return out


# ------------------------------------------------------------------------------------------- parsing


def read_log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON log lines of a node's log (agent and workers), each with ``t`` (epoch seconds) added."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        ts = d.get("timestamp") if isinstance(d, dict) else None
        if not isinstance(ts, str) or not isinstance(d.get("event"), str):
            continue
        try:
            d["t"] = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        out.append(d)
    return out


def read_step_events(path: Path) -> list[dict[str, Any]]:
    """The ``step`` progress events of a job (``time``, ``round``, ``world_size``, ``step``)."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("event") == "step" and isinstance(d.get("time"), int | float):
            out.append(d)
    return out


def count_events(logs: Iterable[list[dict[str, Any]]], name: str) -> int:
    return sum(1 for events in logs for e in events if e["event"] == name)


def resumed_at(fault: dict[str, Any], steps: list[dict[str, Any]]) -> float | None:
    """Time of the first step of a round after the fault's round (what ``resumed_s`` ends at)."""
    rnd = fault.get("fired_round")
    if not isinstance(rnd, int):
        return None
    later = [e["time"] for e in steps if isinstance(e.get("round"), int) and e["round"] > rnd]
    return min(later) if later else None


def fired_at(fault: dict[str, Any], steps: list[dict[str, Any]]) -> float | None:
    """Epoch time the fault was injected: its first step after, less ``resumed_s``."""
    end, resumed = resumed_at(fault, steps), fault.get("resumed_s")
    return None if end is None or not isinstance(resumed, int | float) else end - resumed


def first_after(events: list[dict[str, Any]], name: str, since: float) -> float | None:
    times = [e["t"] for e in events if e["event"] == name and e["t"] >= since]
    return min(times) if times else None


def breakdown(
    survivors: dict[int, list[dict[str, Any]]],
    fired: float,
    total: float | None,
    phases: Iterable[tuple[str, str]],
) -> dict[str, float | None]:
    """Seconds of each phase of a recovery, in order: a phase ends when its event was logged on every
    survivor (the first such event after the fault on each, the latest over the survivors); the last phase,
    ``first_step``, ends at the first step of the new round (``total`` after the fault). A phase whose event
    is missing is None and the next one starts where the last known one ended."""
    out: dict[str, float | None] = {}
    last = 0.0
    for phase, event in phases:
        ends = [first_after(events, event, fired - 0.05) for events in survivors.values()]
        known = [t for t in ends if t is not None]
        if not known or len(known) < len(ends):
            out[phase] = None
            continue
        at = max(known) - fired
        out[phase] = round(max(0.0, at - last), 3)
        last = max(last, at)
    out["first_step"] = None if total is None else round(max(0.0, total - last), 3)
    return out


def hot_details(survivors: dict[int, list[dict[str, Any]]], fired: float) -> dict[str, float]:
    """The slowest survivor's own timings of a hot re-formation (from its events' fields)."""
    fields = {
        "hot_round": ("join_s", "ranks_s"),
        "group_reformed": ("teardown_s", "wait_s", "store_s", "pg_s"),
        "restored": ("find_s", "broadcast_s"),
    }
    out: dict[str, float] = {}
    for events in survivors.values():
        for name, keys in fields.items():
            first = next((e for e in events if e["event"] == name and e["t"] >= fired - 0.05), None)
            for k in keys if first is not None else ():
                v = first.get(k) if first is not None else None
                if isinstance(v, int | float):
                    out[f"{name}.{k}"] = max(out.get(f"{name}.{k}", 0.0), float(v))
    return out


def graphs_compiled_after(survivors: dict[int, list[dict[str, Any]]], fired: float) -> int | None:
    """Graphs dynamo compiled on the survivors for their first step after the fault (``hot_compiled.py``'s
    ``dynamo_graphs`` lines): a process that kept its compiled code adds none, a restarted one compiles all
    again. None when the script logs no such lines."""
    total, seen = 0, False
    for events in survivors.values():
        records = sorted((e for e in events if e["event"] == "dynamo_graphs"), key=lambda e: e["t"])
        after = next((e for e in records if e["t"] >= fired), None)
        if after is None:
            continue
        seen = True
        before = [e for e in records if e["t"] < fired and e.get("pid") == after.get("pid")]
        total += int(after.get("graphs", 0)) - (int(before[-1].get("graphs", 0)) if before else 0)
    return total if seen else None


def join_ready(
    joiner: list[dict[str, Any]], fault: dict[str, Any], steps: list[dict[str, Any]], world: int = 3
) -> dict[str, Any]:
    """Seconds from the joining worker's ``model_built`` to the first step at world ``world`` after the join
    (``join_s``, ``join_basis: model_built``); without that event, from the joiner's start (``join_basis:
    start``). None when no step at that world followed (the job ended first)."""
    fired = fired_at(fault, steps)
    later = [
        e["time"] for e in steps if fired is not None and e["time"] > fired and e.get("world_size") == world
    ]
    if fired is None or not later:
        return {"join_s": None, "join_basis": None}
    built = [e["t"] for e in joiner if e["event"] == "model_built"]
    if built:
        return {"join_s": round(min(later) - min(built), 3), "join_basis": "model_built"}
    return {"join_s": round(min(later) - fired, 3), "join_basis": "start"}


def join_from_start(
    joiner: list[dict[str, Any]], fault: dict[str, Any], steps: list[dict[str, Any]], world: int = 3
) -> dict[str, Any]:
    """A join timed from the joining node's process start (the ``add-node`` fault's firing) to the first
    step at world ``world`` (``join_start_s``), split into :data:`JOIN_PHASES` (``join_breakdown``) from the
    joiner's events, and when its fork server was ready (``forkserver_ready_s``, since the start)."""
    fired = fired_at(fault, steps)
    if fired is None:
        return {}
    events = list(joiner)
    for e in joiner:  # the worker's process creation, from its own start-up timings
        if e["event"] == "worker_ready" and isinstance(e.get("since_exec_s"), int | float):
            events.append({"event": "worker_created", "t": e["t"] - float(e["since_exec_s"])})
    later = [e["time"] for e in steps if e["time"] > fired and e.get("world_size") == world]
    total = round(min(later) - fired, 3) if later else None
    out: dict[str, Any] = {
        "join_start_s": total,
        "join_breakdown": breakdown({0: events}, fired, total, JOIN_PHASES),
    }
    ready = first_after(events, "forkserver_ready", fired - 0.05)
    out["forkserver_ready_s"] = None if ready is None else round(ready - fired, 3)
    return out


# ------------------------------------------------------------------------------------------- summary


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(vals), "median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def median_breakdown(runs: list[dict[str, Any]], field: str = "kill_breakdown") -> dict[str, float | None]:
    """Per phase, the median over the runs that have it."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r.get(field) or {} if k not in keys]
    return {k: summarize((r.get(field) or {}).get(k) for r in runs)["median"] for k in keys}


FIGURES = (("kill", "kill_s"), ("join", "join_s"), ("stop", "stop_s"))
#: The job kinds that measure each scenario.
MEASURED_BY = {"kill": ("kill-join", "kill"), "join": ("kill-join",), "stop": ("stop",)}


def summary_table(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{loop: {scenario: {mode: summary}}}`` over the jobs that succeeded."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for loop in dict.fromkeys(r["loop"] for r in runs):
        for scen, key in FIGURES:
            cells = {}
            for mode in MODES:
                mine = [
                    r
                    for r in runs
                    if r["loop"] == loop and r["mode"] == mode and r.get("kind") in MEASURED_BY[scen]
                ]
                if not mine:
                    continue
                ok = [r for r in mine if r.get("succeeded")]
                cells[mode] = {**summarize(r.get(key) for r in ok), "jobs": len(mine), "ok": len(ok)}
                if scen == "join":
                    cells[mode]["basis"] = sorted({str(r["join_basis"]) for r in ok if r.get("join_basis")})
                    cells[mode]["from_start"] = summarize(r.get("join_start_s") for r in ok)
                    cells[mode]["start_breakdown"] = median_breakdown(ok, "join_breakdown")
                    cells[mode]["forkserver_ready"] = summarize(r.get("forkserver_ready_s") for r in ok)[
                        "median"
                    ]
                if scen == "kill":
                    cells[mode]["breakdown"] = median_breakdown(ok)
            if cells:
                out.setdefault(loop, {})[scen] = cells
    return out


def figure_rows(table: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for loop, scens in table.items():
        for scen, cells in scens.items():
            h, r = cells.get("hot", {}), cells.get("restart", {})
            hm, rm = h.get("median"), r.get("median")
            row: dict[str, Any] = {
                "loop": loop,
                "scenario": scen,
                "hot median s": hm,
                "hot min-max s": _span(h),
                "restart median s": rm,
                "restart min-max s": _span(r),
                "restart / hot": rm / hm if hm and rm else None,
                "jobs ok (hot, restart)": f"{_ok(h)}, {_ok(r)}",
            }
            if scen == "kill" and h.get("breakdown"):
                row["hot phases s"] = ", ".join(
                    f"{k} {v:.3f}" for k, v in h["breakdown"].items() if v is not None
                )
            if scen == "join":
                row["from"] = "/".join(h.get("basis") or r.get("basis") or []) or None
                start = h.get("from_start") or {}
                if start.get("median") is not None:
                    row["hot from process start s"] = f"{start['median']:.2f} ({_span(start)})"
                    phases = [
                        f"{k} {v:.2f}" for k, v in (h.get("start_breakdown") or {}).items() if v is not None
                    ]
                    if h.get("forkserver_ready") is not None:
                        phases.append(f"(fork server ready at {h['forkserver_ready']:.2f})")
                    row["hot phases s"] = ", ".join(phases)
            rows.append(row)
    return rows


def _ok(s: dict[str, Any]) -> str:
    return f"{s.get('ok', 0)}/{s.get('jobs', 0)}"


def _span(s: dict[str, Any]) -> str | None:
    return None if s.get("min") is None else f"{s['min']:.2f}-{s['max']:.2f}"


def _cell(table: dict[str, Any], loop: str, scen: str, mode: str) -> dict[str, Any]:
    return table.get(loop, {}).get(scen, {}).get(mode, {})


def evaluate_targets(table: dict[str, Any], load: list[float], load_end: list[float]) -> list[dict[str, Any]]:
    """The benchmark's own targets (every loop measured must be on the right side of the bar)."""
    context = f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end"
    specs = (
        (
            "kill -9 one node -> first step at world 2, hot recovery",
            "kill",
            ("builtin", "own"),
            TARGET_KILL_S,
        ),
        (
            "join -> first step at world 3 after the joiner's model is built, hot recovery",
            "join",
            ("builtin", "own"),
            TARGET_JOIN_S,
        ),
        (
            "torch.compile'd model: kill -9 -> first step at world 2, hot recovery",
            "kill",
            ("compiled",),
            TARGET_COMPILED_S,
        ),
    )
    out = []
    for name, scen, loops, bar in specs:
        figures, restart, status = [], [], "not measured"
        measured = [(loop, _cell(table, loop, scen, "hot")) for loop in loops]
        measured = [(loop, c) for loop, c in measured if c.get("median") is not None]
        if measured:
            status = "met" if all(c["median"] <= bar for _, c in measured) else "missed"
        for loop, c in measured:
            figures.append(f"{loop} {c['median']:.2f} s (n={c['n']})")
            rm = _cell(table, loop, scen, "restart").get("median")
            if rm is not None:
                restart.append(f"{loop} {rm:.2f} s")
        why = [f"restart path in the same run: {', '.join(restart)}"] if restart else []
        if scen == "join":
            bases = {b for loop, _ in measured for b in _cell(table, loop, scen, "hot").get("basis", [])}
            if "start" in bases:
                why.append(
                    "measured from the joiner's start (its workers log no model_built): includes imports"
                )
        missing = [loop for loop in loops if _cell(table, loop, scen, "hot").get("median") is None]
        if missing and measured:
            why.append(f"not measured for {', '.join(missing)}")
        why.append(context)
        out.append(
            {
                "name": name,
                "threshold": f"<= {bar:g} s",
                "figure": "; ".join(figures) if figures else "not measured",
                "status": status,
                "why": "; ".join(why),
            }
        )
    return out


def build_doc(
    runs: list[dict[str, Any]],
    args: argparse.Namespace,
    load: list[float],
    torchft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    load_end = list(os.getloadavg())
    table = summary_table(runs)
    doc: dict[str, Any] = {
        "benchmark": "hot",
        "title": "Hot recovery",
        "description": (
            "3 nodes x 1 worker on loopback, `elastic-train local`, `rendezvous.hot` on and off paired in "
            "one run (alternating order); loops: the built-in worker, `examples/own_loop.py` (--entry), "
            "`benchmarks/hot_compiled.py` (a torch.compile'd model, warm inductor cache). kill: kill -9 of "
            "node 1 -> first step at world 2; join: the joiner's model built -> first step at world 3; stop: "
            "SIGSTOP of node 1 -> first step without it (peers wait for its lease; hot cuts their group's "
            "connections and re-forms in-process). "
            f"Load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end."
        ),
        "loadavg": load,
        "loadavg_end": load_end,
        "settings": {
            "repeats": args.repeats,
            "scenarios": list(args.scenarios),
            "kill_step": args.kill_step,
            "gap_steps": args.gap_steps,
            "tail_steps": args.tail_steps,
            "stop_tail_steps": args.stop_tail_steps,
        },
        "summary": table,
        "runs": runs,
        "figures": figure_rows(table),
        "targets": evaluate_targets(table, load, load_end),
    }
    doc["tables"] = [{"caption": torchft_line(torchft)}]
    if torchft is not None:
        doc["torchft"] = torchft
        if torchft.get("kill_s") is not None:
            doc["figures"].append(
                {
                    "loop": "torchft (probe)",
                    "scenario": "kill",
                    "hot median s": torchft["kill_s"],
                    "from": "kill -> next committed step of the survivors",
                }
            )
        if torchft.get("join_s") is not None:
            row = {
                "loop": "torchft (probe)",
                "scenario": "join",
                "hot median s": torchft["join_s"],
                "from": "model_built -> first committed step with the joiner",
            }
            if torchft.get("join_start_s") is not None:
                row["hot from process start s"] = f"{torchft['join_start_s']:.2f}"
            doc["figures"].append(row)
    return doc


def torchft_line(torchft: dict[str, Any] | None) -> str:
    """One line on torchft beside hot recovery: its version and settings, or why it did not run."""
    if torchft is None:
        return "torchft: not run (`hot.py --torchft-python PATH` runs `benchmarks/torchft_probe.py`)."
    if torchft.get("skipped"):
        return f"torchft: not measured: {torchft['skipped']}"
    kill, join, start = (
        f"{v:.4g}" if isinstance(v, float) else v
        for v in (torchft.get("kill_s"), torchft.get("join_s"), torchft.get("join_start_s"))
    )
    return (
        f"torchft {torchft.get('torchft')} (`benchmarks/torchft_probe.py`: 3 replica groups of 1 process on "
        f"gloo, lighthouse join timeout {torchft.get('join_timeout_ms')} ms): kill -> next committed step "
        f"{kill} s, joiner's model built -> committed step with it {join} s, joiner's process start -> "
        f"that step {start} s."
    )


# ------------------------------------------------------------------------------------------- main


def warm_compiled(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Fill the inductor cache with one run of the compiled script (a world of one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.time()
    proc = subprocess.run(
        [sys.executable, str(HERE / "hot_compiled.py"), "--steps", "3", "--checkpoint", str(work / "warm")],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout,
    )  # fmt: skip
    return {"seconds": round(time.time() - t, 1), "exit": proc.returncode}


def run_torchft(python: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """torchft's figures from ``torchft_probe.py`` run by ``python``, or why there are none."""
    out = work / "torchft.json"
    cmd = [python, str(HERE / "torchft_probe.py"), "--json", str(out), "--workdir", str(work / "torchft")]
    if args.quick:
        cmd.append("--quick")
    try:
        proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"torchft probe did not run: {exc}"}
    if not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"skipped": f"torchft probe exit {proc.returncode}: {' | '.join(tail)[:300]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="jobs per mode and scenario")
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"LOOP:KIND,... (default: {','.join(SCENARIOS)})"
    )
    p.add_argument("--kill-step", type=int, default=20, help="kill (or stop) node 1 after this step")
    p.add_argument("--gap-steps", type=int, default=30, help="steps between the kill and the join")
    p.add_argument("--tail-steps", type=int, default=400, help="steps after the join (it takes seconds)")
    p.add_argument("--stop-tail-steps", type=int, default=100, help="steps after a stop")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="one repeat, shorter tails")
    p.add_argument("--torchft-python", metavar="PATH", help="run torchft_probe.py with this interpreter")
    p.add_argument("--keep", metavar="DIR", help="keep the jobs' work directories here")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {', '.join(bad)} (known: {', '.join(SCENARIOS)})")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: one or more of {', '.join(MODES)}")
    if args.quick:
        args.repeats, args.tail_steps, args.stop_tail_steps = 1, min(args.tail_steps, 300), 60
    load = list(os.getloadavg())
    runs: list[dict[str, Any]] = []
    torchft: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-hot-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if any(s.startswith("compiled:") for s in args.scenarios):
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))
            print(f"== warming the inductor cache: {json.dumps(warm_compiled(args, work))}", flush=True)
        for repeat in range(args.repeats):
            order = list(args.modes) if repeat % 2 == 0 else list(reversed(args.modes))
            for scenario in args.scenarios:
                loop, kind = scenario.split(":")
                for mode in order:
                    runs.append(run_job(loop, kind, mode, args, work, repeat))
        if args.torchft_python:
            torchft = run_torchft(args.torchft_python, args, work)
            print(f"== torchft: {json.dumps(torchft)}", flush=True)
    doc = build_doc(runs, args, load, torchft)
    for f in doc["figures"]:
        print(json.dumps(f))
    for t in doc["targets"]:
        print(json.dumps(t))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
