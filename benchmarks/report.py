"""Run every benchmark in benchmarks/ and write docs/benchmarks.md (figures, ratios, targets, machine, plots).

    .venv/bin/python benchmarks/report.py --out docs/benchmarks.md            # what `make bench` runs
    .venv/bin/python benchmarks/report.py --quick --out /tmp/b.md             # a fast check of the pipeline
    .venv/bin/python benchmarks/report.py --from-json docs/benchmarks --out docs/benchmarks.md   # re-render

Each benchmark script is run as ``python benchmarks/NAME.py --json FILE [--quick]``. A script that is absent,
fails or times out gets a "not run" row with the reason, and every target that needed it is "not measured".
The raw JSON is kept next to the report (``--json-dir``) so a report can be re-rendered or audited.

Reading other benchmarks' JSON is tolerant: a document may carry its own ``targets`` list
(``[{"name", "figure", "value", "threshold", "met", "why"}]``) and ``figures`` list
(``[{"name", "value", "unit", ...}]``); otherwise known keys are looked up, and anything missing is
"not measured", never an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import format_ratio, format_summary, machine_info

HERE = Path(__file__).resolve().parent
#: Benchmark scripts, in the order they run and appear.
BENCHMARKS = ("rendezvous", "rdzv_scale", "checkpoint", "overhead", "recovery", "rdzv_latency")
BASELINE_DEFAULTS = ("c10d", "etcd-v2")


# ---------------------------------------------------------------------------------------------------------
# Tolerant lookups (pure)


def dig(doc: Any, *paths: str) -> Any:
    """The value at the first dotted path that exists in ``doc`` (dict keys or list indices), else None."""
    for path in paths:
        cur = doc
        for part in path.split("."):
            if isinstance(cur, Mapping) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
                cur = cur[int(part)]
            else:
                cur = None
                break
        if cur is not None:
            return cur
    return None


def median(values: Iterable[float]) -> float | None:
    """The median of ``values`` (mean of the middle two for an even count), None when empty."""
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def number(value: Any) -> float | None:
    """``value`` as a float when it is a number (or a summary dict with a ``median``), else None."""
    if isinstance(value, Mapping):
        value = value.get("median", value.get("value"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def find_records(doc: Any, keys: Iterable[str]) -> list[Mapping[str, Any]]:
    """Every dict anywhere in ``doc`` that has all of ``keys`` (depth-first, document order)."""
    wanted = list(keys)
    found: list[Mapping[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if all(k in node for k in wanted):
                found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return found


# ---------------------------------------------------------------------------------------------------------
# Targets (pure)


@dataclass(slots=True)
class Target:
    """One target from the issues and how this run did against it."""

    name: str
    """What is promised, in words."""
    threshold: str
    """The bar, e.g. ">= 4x vs c10d and etcd-v2 defaults"."""
    figure: str = "not measured"
    """What this run measured."""
    status: str = "not measured"
    """``met``, ``missed``, ``inconclusive`` or ``not measured``."""
    why: str = ""
    """The reason, in particular for anything not met."""


def _ratio_check(ratio: Mapping[str, Any] | None, need: float) -> str:
    if not ratio:
        return "not measured"
    if ratio["ratio"] >= need:
        return "met"
    return "inconclusive" if ratio.get("lower_bound") else "missed"


def _combine(statuses: list[str]) -> str:
    for s in ("missed", "not measured", "inconclusive"):
        if s in statuses:
            return s
    return "met"


def _phase_note(rdzv: Mapping[str, Any], scenario: str, config: str) -> str:
    """ "of which: workers started +X s, process group +Y s" from the median phases of a configuration."""
    phases = dig(rdzv, f"scenarios.{scenario}.results.{config}.phases") or []
    parts = []
    for key, label in (("workers_started", "workers started"), ("pg_ready", "process group formed")):
        med = median(p[key] for p in phases if isinstance(p, Mapping) and p.get(key) is not None)
        if med is not None:
            parts.append(f"{label} at {med:.1f} s")
    return f" ({config}: {', '.join(parts)})" if parts else ""


def rendezvous_targets(rdzv: Mapping[str, Any] | None) -> list[Target]:
    """The three torchrun-level targets of the rendezvous issue, from rendezvous.py's JSON."""
    launch = Target("launch 3 agents -> first step", ">= 4x faster than c10d and etcd-v2 defaults")
    kill = Target(
        "kill -9 one node -> first step at world 2",
        ">= 10x faster than etcd-v2 defaults, faster than c10d-tuned",
    )
    scale = Target("add a 4th node -> first step at world 4", "<= 5 s (etcd3)")
    if not rdzv:
        for t in (launch, kill, scale):
            t.why = "rendezvous benchmark not run"
        return [launch, kill, scale]
    ours = rdzv.get("ours", "etcd3")
    ratios = rdzv.get("ratios", {})

    def summary(scen: str, config: str) -> Mapping[str, Any] | None:
        s = dig(rdzv, f"scenarios.{scen}.results.{config}.summary")
        return s if isinstance(s, Mapping) and s.get("median") is not None else None

    # launch: >= 4x vs both defaults
    own = summary("launch", ours)
    if own:
        rs = {b: (ratios.get("launch") or {}).get(b) for b in BASELINE_DEFAULTS}
        launch.figure = f"{ours} {format_summary(own)}; " + ", ".join(
            f"{b} {format_summary(summary('launch', b) or {})} ({format_ratio(r)})" for b, r in rs.items()
        )
        launch.status = _combine([_ratio_check(r, 4.0) for r in rs.values()])
        launch.why = _why(launch.status, "launch", rs, dict.fromkeys(rs, 4.0)) + _phase_note(
            rdzv, "launch", ours
        )
    else:
        launch.why = f"{ours} launch not measured"

    own = summary("kill", ours)
    if own:
        r_v2 = (ratios.get("kill") or {}).get("etcd-v2")
        r_tuned = (ratios.get("kill") or {}).get("c10d-tuned")
        kill.figure = (
            f"{ours} {format_summary(own)}; etcd-v2 {format_summary(summary('kill', 'etcd-v2') or {})} "
            f"({format_ratio(r_v2)}); c10d-tuned {format_summary(summary('kill', 'c10d-tuned') or {})} "
            f"({format_ratio(r_tuned)})"
        )
        faster = "not measured" if not r_tuned else ("met" if r_tuned["ratio"] > 1.0 else "missed")
        kill.status = _combine([_ratio_check(r_v2, 10.0), faster])
        needs = {"etcd-v2": 10.0, "c10d-tuned": 1.0}
        kill.why = _why(kill.status, "kill", {"etcd-v2": r_v2, "c10d-tuned": r_tuned}, needs) + _phase_note(
            rdzv, "kill", ours
        )
    else:
        kill.why = f"{ours} kill scenario not measured"

    own = summary("scale_up", ours)
    if own:
        scale.figure = f"{ours} {format_summary(own)}"
        scale.status = "missed" if own.get("median_censored") or own["median"] > 5.0 else "met"
        scale.why = ("median within 5 s" if scale.status == "met" else "median above 5 s") + _phase_note(
            rdzv, "scale_up", ours
        )
    else:
        scale.why = f"{ours} scale-up not measured"
    return [launch, kill, scale]


def _why(
    status: str, scen: str, ratios: Mapping[str, Mapping[str, Any] | None], needs: Mapping[str, float]
) -> str:
    """Explain a ratio target: which baselines are below their bar, and which ratios are only lower bounds."""
    missing = [b for b, r in ratios.items() if not r]
    bounds = [b for b, r in ratios.items() if r and r.get("lower_bound")]
    short = [
        f"{b} {format_ratio(r)} (bar {needs[b]:g}x)"
        for b, r in ratios.items()
        if r and (r["ratio"] < needs[b] or (needs[b] == 1.0 and r["ratio"] == 1.0))
    ]
    parts = []
    if short:
        parts.append("below the bar: " + ", ".join(short))
    if missing:
        parts.append(f"no {scen} figure for {', '.join(missing)} in this run")
    if bounds:
        parts.append(f"{', '.join(bounds)} did not get there within the cap: ratio is a lower bound")
    if status == "inconclusive":
        parts.append("a longer cap could show more")
    return "; ".join(parts) or "every ratio at or above its bar"


def scale_target(doc: Mapping[str, Any] | None) -> list[Target]:
    """Rendezvous alone at N=256 <= 3 s, and etcd writes per round O(N), from rdzv_scale.py's JSON."""
    t = Target("rendezvous alone at N=256 participants", "<= 3 s per round (first round and failure round)")
    w = Target("etcd writes per rendezvous round", "O(N): writes/N flat from smallest to largest N")
    if not doc:
        t.why = w.why = "rdzv_scale benchmark not run"
        return [t, w]
    points = scale_points(doc)
    at256 = [p for p in points if p["n"] == 256 and p.get("seconds") is not None]
    if at256:
        p = at256[0]
        t.figure = _round_figure(p)
        t.status = "met" if p["seconds"] <= 3.0 else "missed"
        t.why = "" if t.status == "met" else f"slowest round {p['seconds']:.2f} s at N=256"
        own = [
            r
            for r in doc.get("scale_own") or []
            if isinstance(r, Mapping) and r.get("n") == 256 and r.get("failure_round_s") is not None
        ]
        if doc.get("watch") in ("shared", "both") or own:
            t.why = (t.why + "; " if t.why else "") + (
                "one watch per host process (as behind an etcd gRPC proxy), a probe participant with its "
                "own watch finished in "
                f"{max(number(at256[0].get('probe_s')) or 0.0, 0.0):.2f} s"
            )
            if own:
                o = own[0]
                t.why += (
                    f"; with a watch per participant (N^2 events decoded on 2 cores) "
                    f"{max(o['first_round_s'], o['failure_round_s']):.2f} s"
                )
    else:
        timed = [p for p in points if p.get("seconds") is not None]
        t.why = "no N=256 point in rdzv_scale output" + (" (quick mode?)" if timed else "")
        if timed:
            t.figure = f"N={timed[-1]['n']}: {_round_figure(timed[-1])}"
    writes = [p for p in points if p.get("writes") is not None and p["n"] > 0]
    if len(writes) >= 2:
        lo, hi = writes[0], writes[-1]
        per_lo, per_hi = lo["writes"] / lo["n"], hi["writes"] / hi["n"]
        w.figure = f"{per_lo:.1f} writes/participant at N={lo['n']}, {per_hi:.1f} at N={hi['n']}"
        w.status = "met" if per_hi <= 2.0 * per_lo else "missed"
        w.why = "" if w.status == "met" else "writes per participant grow with N"
    else:
        w.why = "no write counts in rdzv_scale output"
    return [t, w]


def _round_figure(p: Mapping[str, Any]) -> str:
    parts = [f"{p['seconds']:.2f} s"]
    if p.get("first_round_s") is not None and p.get("failure_round_s") is not None:
        parts.append(f"(first round {p['first_round_s']:.2f} s, failure round {p['failure_round_s']:.2f} s)")
    return " ".join(parts)


def scale_points(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``[{"n", "seconds", "writes", ...}]`` sorted by n, from whatever shape rdzv_scale.py writes.

    With rdzv_scale.py's ``scale`` list, ``seconds`` is the slower of the first round and the round after a
    failure, and ``writes`` the etcd writes of the larger of the two.
    """
    out: dict[int, dict[str, Any]] = {}
    scale = doc.get("scale")
    if isinstance(scale, list):
        for rec in scale:
            n = number(rec.get("n")) if isinstance(rec, Mapping) else None
            if n is None:
                continue
            first, fail = number(rec.get("first_round_s")), number(rec.get("failure_round_s"))
            known = [x for x in (first, fail) if x is not None]
            w = [number(dig(rec, f"{k}.writes")) for k in ("first_round_ops", "failure_round_ops")]
            wk = [x for x in w if x is not None]
            probes = [number(rec.get(k)) for k in ("probe_first_round_s", "probe_failure_round_s")]
            pk = [x for x in probes if x is not None]
            out[int(n)] = {
                "n": int(n),
                "probe_s": max(pk) if pk else None,
                "seconds": max(known) if known else None,
                "first_round_s": first,
                "failure_round_s": fail,
                "writes": max(wk) if wk else None,
            }
        return [out[k] for k in sorted(out)]
    for key in ("n", "participants", "N", "nodes"):
        for rec in find_records(doc, [key]):
            n = number(rec.get(key))
            if n is None:
                continue
            secs = number(dig(rec, "seconds", "median_s", "rdzv_seconds", "time_s", "median", "wall_s"))
            writes = number(dig(rec, "writes", "etcd_writes", "ops.writes", "etcd_ops.writes", "puts"))
            out.setdefault(int(n), {"n": int(n), "seconds": secs, "writes": writes})
        if out:
            break
    return [out[k] for k in sorted(out)]


def checkpoint_targets(doc: Mapping[str, Any] | None) -> list[Target]:
    """Stall <= 1.5x a shared-memory copy; durable throughput >= 80% raw write and >= DCP, at every size."""
    stall = Target("checkpoint stall of the training loop", "<= 1.5x a plain shared-memory copy, every size")
    thr = Target("durable checkpoint throughput", ">= 80% of raw write and >= torch DCP, every size")
    if not doc:
        stall.why = thr.why = "checkpoint benchmark not run"
        return [stall, thr]
    sizes = checkpoint_sizes(doc)
    stalls = [(z, r["stall"]) for z, r in sizes if r.get("stall") is not None]
    if stalls:
        stall.figure = ", ".join(f"{z:g} MB: {v:.2f}x" for z, v in stalls)
        bad = [f"{z:g} MB" for z, v in stalls if v > 1.5]
        stall.status = "missed" if bad else "met"
        stall.why = f"above 1.5x at {', '.join(bad)}" if bad else ""
    else:
        stall.why = "stall or shm-copy figure not found in checkpoint output"
    thr_rows = [(z, r) for z, r in sizes if r.get("raw") is not None]
    if thr_rows:
        thr.figure = ", ".join(
            f"{z:g} MB: {r['raw']:.0%} of raw"
            + (f", {r['dcp']:.2f}x DCP" if r.get("dcp") is not None else "")
            for z, r in thr_rows
        )
        bad = [f"{z:g} MB" for z, r in thr_rows if r["raw"] < 0.8 or (r.get("dcp") or 1.0) < 1.0]
        thr.status = "missed" if bad else "met"
        if not bad and any(r.get("dcp") is None for _, r in thr_rows):
            thr.status, thr.why = "not measured", "no DCP figure in checkpoint output"
        elif bad:
            thr.why = f"below the bar at {', '.join(bad)}"
    else:
        thr.why = "durable or raw-write throughput not found in checkpoint output"
    return [stall, thr]


def checkpoint_sizes(doc: Mapping[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """Per state size (MB): ratios ``stall`` (stall / shm copy), ``raw`` (durable / raw write), ``dcp``,
    and ``overwrite`` (durable / raw overwrite, None when not measured).

    Reads checkpoint.py's ``results`` list (``size_mb`` with ``ratios`` or the seconds/throughput figures
    they derive from), or a flat document with the same keys (one size).
    """
    recs = [r for r in (doc.get("results") or []) if isinstance(r, Mapping)] or [doc]
    out = []
    for r in recs:
        size = number(dig(r, "size_mb", "state_mb", "mb")) or 0.0
        ratios: Mapping[str, Any] = r["ratios"] if isinstance(r.get("ratios"), Mapping) else {}
        st = number(ratios.get("stall_over_shm_copy"))
        if st is None:
            s = number(dig(r, "et_stall_s", "stall_s", "stall.seconds"))
            c = number(dig(r, "shm_copy_s", "shm_copy.seconds"))
            st = s / c if s is not None and c else None
        raw = number(ratios.get("durable_over_raw_write"))
        dcp = number(ratios.get("durable_over_dcp"))
        over = number(ratios.get("durable_over_raw_overwrite"))
        tp: Mapping[str, Any] = r["throughput_mb_s"] if isinstance(r.get("throughput_mb_s"), Mapping) else {}
        d = number(dig(tp, "elastic_train")) or number(dig(r, "durable_mb_s", "durable.mb_s"))
        rw = number(dig(tp, "raw_write")) or number(dig(r, "raw_write_mb_s", "raw.mb_s"))
        dc = number(dig(tp, "dcp")) or number(dig(r, "dcp_mb_s", "dcp.mb_s"))
        if raw is None and d is not None and rw:
            raw = d / rw
        if dcp is None and d is not None and dc:
            dcp = d / dc
        if st is not None or raw is not None:
            out.append((size, {"stall": st, "raw": raw, "dcp": dcp, "overwrite": over}))
    return sorted(out, key=lambda x: x[0])


def overhead_targets(doc: Mapping[str, Any] | None) -> list[Target]:
    """Per-step overhead of elastic_train over a plain DDP loop <= 3%."""
    t = Target("per-step overhead over plain DDP", "<= 3%")
    if not doc:
        t.why = "overhead benchmark not run"
        return [t]
    pct = number(dig(doc, "overhead_pct", "overhead.pct", "overhead_percent", "figures.overhead_pct"))
    if pct is None:
        frac = number(dig(doc, "overhead", "overhead_fraction"))
        pct = frac * 100 if frac is not None and frac < 1 else frac
    if pct is None:
        # overhead.py: "ratio" = our step time / plain DDP step time (or the two step times)
        ratio = number(doc.get("ratio"))
        plain, ours = number(doc.get("plain_step_s")), number(doc.get("ours_step_s"))
        if ratio is None and plain and ours is not None:
            ratio = ours / plain
        pct = (ratio - 1.0) * 100 if ratio is not None else None
    if pct is None:
        t.why = "overhead figure not found in overhead output"
        return [t]
    t.figure = f"{pct:+.2f}%"
    plain, ours = number(doc.get("plain_step_s")), number(doc.get("ours_step_s"))
    if plain and ours:
        t.figure += f" ({ours * 1e3:.2f} ms vs plain DDP {plain * 1e3:.2f} ms per step)"
    t.status = "met" if pct <= 3.0 else "missed"
    if t.status == "missed":
        t.why = "above 3%; see the overhead section for the per-block spread"
    return [t]


def recovery_target(doc: Mapping[str, Any] | None) -> list[Target]:
    """Restore/broadcast within 1.5x of state size / loopback bandwidth (recovery.py reports its own)."""
    t = Target("restore/broadcast vs state size / loopback bandwidth", "<= 1.5x")
    t.why = "recovery benchmark not run" if not doc else "figure not found in recovery output"
    return [t]


def self_reported_targets(doc: Mapping[str, Any] | None) -> list[Target]:
    """Targets a benchmark evaluated itself (its ``targets`` list), as :class:`Target`."""
    out = []
    for rec in (doc or {}).get("targets") or []:
        if not isinstance(rec, Mapping) or "name" not in rec:
            continue
        met = rec.get("met")
        status = rec.get("status") or ("met" if met else "missed" if met is False else "not measured")
        figure = rec.get("figure") or (str(rec["value"]) if rec.get("value") is not None else "not measured")
        out.append(
            Target(str(rec["name"]), str(rec.get("threshold", "")), figure, status, str(rec.get("why", "")))
        )
    return out


def evaluate_targets(docs: Mapping[str, Mapping[str, Any] | None]) -> list[Target]:
    """Every target, from each benchmark's JSON (None where the benchmark did not run).

    A benchmark's own ``targets`` list wins over the built-in reading of its figures.
    """
    targets = rendezvous_targets(docs.get("rendezvous"))
    for name, builtin in (
        ("rdzv_scale", scale_target),
        ("checkpoint", checkpoint_targets),
        ("overhead", overhead_targets),
        ("recovery", recovery_target),
    ):
        own = self_reported_targets(docs.get(name))
        targets.extend(own or builtin(docs.get(name)))
    return targets


# ---------------------------------------------------------------------------------------------------------
# Running the benchmarks


@dataclass(slots=True)
class RunRecord:
    """How one benchmark script ran."""

    name: str
    status: str
    """``ok``, ``absent``, ``failed``, ``timeout``, ``from-json`` or ``earlier run``."""
    command: str = ""
    seconds: float = 0.0
    detail: str = ""


def run_benchmark(name: str, json_path: Path, *, quick: bool, timeout: float, extra: list[str]) -> RunRecord:
    """Run ``benchmarks/NAME.py --json FILE``; its output goes to ``NAME.log`` next to the JSON and is echoed.

    On timeout the script gets SIGTERM (so it can clean up its processes) and SIGKILL 60 s later.
    """
    script = HERE / f"{name}.py"
    if not script.exists():
        return RunRecord(name, "absent", detail=f"benchmarks/{name}.py does not exist")
    cmd = [sys.executable, str(script), "--json", str(json_path), *(["--quick"] if quick else []), *extra]
    shown = " ".join(shlex.quote(a) for a in cmd)
    log_path = json_path.with_suffix(".log")
    print(f"== {name}: {shown}  (output: {log_path})", flush=True)
    started = time.time()
    json_path.unlink(missing_ok=True)
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    seconds = round(time.time() - started, 1)
    kept = [ln for ln in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    kept = [ln for ln in kept if not ln.startswith(("W1", "I1", "E1"))]  # torch's glog-style agent lines
    print("\n".join(kept[-40:]), flush=True)
    if timed_out:
        return RunRecord(name, "timeout", shown, seconds, f"over {timeout:.0f} s")
    if proc.returncode != 0 or not json_path.exists():
        last = kept[-1:] or [""]
        return RunRecord(name, "failed", shown, seconds, f"exit {proc.returncode}: {last[0][:300]}")
    return RunRecord(name, "ok", shown, seconds)


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------------------------------------
# Plots


def plot_timelines(rdzv: Mapping[str, Any], img_dir: Path) -> list[Path]:
    """One PNG per scenario: world size of each rank-0 step against seconds since the event, per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for scen, per_config in (rdzv.get("timelines") or {}).items():
        names = [n for n, pts in per_config.items() if pts]
        if not names:
            continue
        fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.3 * len(names) + 1), sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names, strict=True):
            pts = per_config[name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=3)
            ax.axvline(0, color="red", linewidth=1)
            rec = dig(rdzv, f"scenarios.{scen}.results.{name}.samples.0")
            if rec and rec.get("status") == "ok":
                ax.axvline(rec["seconds"], color="green", linewidth=1, linestyle="--")
            phase = dig(rdzv, f"scenarios.{scen}.results.{name}.phases.0") or {}
            if phase.get("workers_started") is not None:
                ax.axvline(phase["workers_started"], color="gray", linewidth=1, linestyle=":")
            ax.set_ylabel(name, rotation=0, ha="right", va="center")
            ax.set_ylim(0.5, 4.5)
            ax.set_yticks([1, 2, 3, 4])
            ax.grid(True, alpha=0.3)
        title = dig(rdzv, f"scenarios.{scen}.title") or scen
        axes[0, 0].set_title(
            f"{title}\nworld size of rank 0's steps; red: event, gray: new workers started, "
            "green: first step at the new size",
            fontsize=9,
        )
        axes[-1, 0].set_xlabel("seconds since the event (first repeat)")
        fig.tight_layout()
        path = img_dir / f"recovery-{scen}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


#: checkpoint.py per-size keys plotted against state size, with their legend labels.
STALL_SERIES = {
    "et_stall_s": "elastic_train stall, durable checkpoint due",
    "et_memory_step_stall_s": "elastic_train stall, memory-only step",
    "shm_copy_s": "plain shared-memory copy (floor)",
    "torch_save_s": "torch.save + fsync (synchronous)",
    "dcp_s": "torch DCP save (synchronous)",
}


def stall_series(doc: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """``{label: [(state MB, seconds)]}`` for every :data:`STALL_SERIES` key found per size."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in doc.get("results") or []:
        if not isinstance(r, Mapping):
            continue
        size = number(dig(r, "size_mb", "state_mb", "mb"))
        if size is None:
            continue
        for key, label in STALL_SERIES.items():
            v = number(r.get(key))
            if v is not None:
                out.setdefault(label, []).append((size, v))
    return {k: sorted(v) for k, v in out.items()}


def plot_stall(doc: Mapping[str, Any], img_dir: Path) -> Path | None:
    series = stall_series(doc)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in series.items():
        style = "o-" if label.startswith("elastic_train") else "s--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    floor = series.get(STALL_SERIES["shm_copy_s"])
    if floor:
        ax.plot(
            [p[0] for p in floor],
            [1.5 * p[1] for p in floor],
            ":",
            color="gray",
            label="target: 1.5x shm copy",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state size (MB)")
    ax.set_ylabel("seconds the training loop waits")
    ax.set_title("Checkpoint stall vs state size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = img_dir / "checkpoint-stall.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def latency_series(doc: Mapping[str, Any]) -> dict[str, list[tuple[float, Mapping[str, Any]]]]:
    """``{config: [(one-way delay ms, summary)]}`` from rdzv_latency.py's ``recovery``, by delay."""
    out: dict[str, list[tuple[float, Mapping[str, Any]]]] = {}
    for name, per_delay in (doc.get("recovery") or {}).items():
        if not isinstance(per_delay, Mapping):
            continue
        for delay, cell in per_delay.items():
            summary = cell.get("summary") if isinstance(cell, Mapping) else None
            try:
                d: float | None = float(delay)
            except (TypeError, ValueError):
                d = None
            if d is not None and isinstance(summary, Mapping) and summary.get("n"):
                out.setdefault(name, []).append((d, summary))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def plot_latency(doc: Mapping[str, Any], img_dir: Path) -> Path | None:
    """Median recovery (kill -9 -> training at world 2) against one-way delay, min-max bars, per backend."""
    series = latency_series(doc)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in series.items():
        xs = [p[0] for p in pts]
        med = [number(p[1].get("median")) or 0.0 for p in pts]
        lo = [m - (number(p[1].get("min")) or m) for m, p in zip(med, pts, strict=True)]
        hi = [(number(p[1].get("max")) or m) - m for m, p in zip(med, pts, strict=True)]
        style = "o-" if name == "etcd3" else "s--"
        ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=name)
    ax.set_xlabel("one-way delay to the rendezvous service (ms)")
    ax.set_ylabel("seconds from kill -9 to training at world 2")
    ax.set_title("Recovery vs network latency (median, min-max)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = img_dir / "latency-recovery.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------
# Markdown


def render(
    docs: Mapping[str, Mapping[str, Any] | None],
    runs: list[RunRecord],
    targets: list[Target],
    images: list[Path],
    *,
    out: Path,
    command: str,
    machine: Mapping[str, Any],
    json_dir: Path,
) -> str:
    """The whole of docs/benchmarks.md as a string."""
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `benchmarks/report.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        + (
            "The benchmarks marked *earlier run* in the table of runs were not re-run by this command: their "
            "figures come from their JSON of an earlier run, and the others from this one"
            if any(r.status == "earlier run" for r in runs)
            else "Every figure below was rendered from the JSON that earlier runs of the benchmarks wrote"
            if runs and all(r.status in ("from-json", "absent") for r in runs)
            else "Every figure below comes from one run of this command"
        )
        + "; each benchmark measures its baselines "
        "(torchrun's own `c10d` and `etcd-v2` rendezvous, defaults and tuned; raw I/O) in the same run.",
        "",
        "```",
        command,
        "```",
        "",
        "One benchmark alone, the others kept from their JSON (e.g. to re-measure on a quiet machine):",
        "",
        "```",
        *(
            f"PYTHONPATH=. .venv/bin/python benchmarks/report.py --out docs/benchmarks.md --only {name} "
            "--keep-others"
            for name in ("overhead", "recovery")
        ),
        "```",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    for key in ("cpu", "cores", "ram_gib", "loadavg", "torch", "python", "etcd", "platform"):
        if key in machine:
            lines.append(f"| {key} | {machine[key]} |")
    lines += [
        "",
        "A busy or shared machine inflates every figure that includes process start-up (importing torch) "
        "for all backends alike; ratios are more stable than absolute seconds.",
        "",
        "## Targets",
        "",
        "| target | bar | measured | status | why |",
        "|---|---|---|---|---|",
    ]
    for t in targets:
        mark = {"met": "**met**", "missed": "**MISSED**"}.get(t.status, t.status)
        lines.append(f"| {t.name} | {t.threshold} | {_cell(t.figure)} | {mark} | {_cell(t.why)} |")
    lines += [
        "",
        "## Benchmarks run",
        "",
        "| benchmark | status | seconds | command / reason |",
        "|---|---|---|---|",
    ]
    for r in runs:
        what = f"`{r.command}`" if r.command else ""
        if r.detail:
            what = (what + " - " if what else "") + _cell(r.detail)
        status = "not run" if r.status in ("absent", "failed", "timeout") else r.status
        if r.status in ("failed", "timeout"):
            status = f"not run ({r.status})"
        seconds = f"{r.seconds:.0f}" if r.command else "-"
        lines.append(f"| {r.name} | {status} | {seconds} | {what} |")
    lines.append(f"\nRaw JSON: `{os.path.relpath(json_dir, out.parent)}/`.\n")

    rdzv = docs.get("rendezvous")
    if rdzv:
        lines += render_rendezvous(rdzv, images, out)
    for name in ("rdzv_scale", "checkpoint", "overhead", "recovery", "rdzv_latency"):
        doc = docs.get(name)
        if doc and name == "rdzv_latency" and latency_series(doc):
            lines += render_latency(doc, images, out)
        elif doc and name == "checkpoint" and checkpoint_sizes(doc):
            lines += render_checkpoint(doc)
        elif doc and name == "rdzv_scale" and isinstance(doc.get("scale"), list):
            lines += render_scale(doc)
        elif doc:
            lines += render_generic(name, doc)
    stall_img = [p for p in images if p.name == "checkpoint-stall.png"]
    if stall_img:
        lines += ["", f"![checkpoint stall vs state size]({os.path.relpath(stall_img[0], out.parent)})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_rendezvous(rdzv: Mapping[str, Any], images: list[Path], out: Path) -> list[str]:
    ours = rdzv.get("ours", "etcd3")
    settings = rdzv.get("settings", {})
    lines = [
        "## Rendezvous and recovery (torchrun agents, `benchmarks/rendezvous.py`)",
        "",
        f"3 torchrun agents on loopback, `--nnodes={settings.get('nnodes', '2:4')} --nproc-per-node=1`, "
        f"tiny gloo DDP worker stepping every {settings.get('step_interval', 0.1)} s, "
        f"`--monitor-interval={settings.get('monitor_interval', 0.1)}` (torchrun's default) and "
        f"`--max-restarts={settings.get('max_restarts', 100)}` for every backend; {rdzv.get('repeats', '?')} "
        f"repeat(s). Seconds are median [min, max] (runs that got there / runs); `> cap` means the backend "
        f"did not train at the new size within the cap ({settings.get('cap', '?')} s; SIGSTOP on baselines "
        f"{settings.get('hang_cap', '?')} s): it failed or stalled. "
        f"Ratios are baseline median / {ours} median.",
        "",
        "The node killed or frozen is the most recently started one that does not host c10d's TCPStore "
        "(losing that host ends a c10d job by design, which is not a recovery figure). Each repeat runs "
        "three jobs per configuration (launch + add a node, launch + kill, launch + SIGSTOP), so `launch` "
        "has up to three samples per repeat.",
        "",
    ]
    if rdzv.get("complete") is False:
        lines += [
            f"**Partial run**: {len(rdzv.get('runs') or [])} of {rdzv.get('planned_jobs', '?')} jobs "
            "finished before the benchmark stopped; the figures below cover those only.",
            "",
        ]
    if rdzv.get("loadavg_end") is not None:
        load0 = (rdzv.get("machine") or {}).get("loadavg")
        lines += [f"Load average at start {load0}, at end {rdzv['loadavg_end']}.", ""]
    jobs, baseline_jobs = settings.get("jobs"), settings.get("baseline_jobs")
    if baseline_jobs is not None and jobs is not None and baseline_jobs != jobs:
        lines += [f"Quick mode: the baselines ran only the {', '.join(baseline_jobs)} job(s).", ""]
    lines += ["Configurations:", ""]
    for c in rdzv.get("configs", []):
        conf = ",".join(f"{k}={v}" for k, v in (c.get("rdzv_conf") or {}).items())
        env = " ".join(f"{k}={v}" for k, v in (c.get("env") or {}).items())
        extra = " ".join(x for x in (f"`--rdzv-conf={conf}`" if conf else "", f"`{env}`" if env else "") if x)
        lines.append(f"- `{c['name']}`: {c.get('description', '')} {extra}".rstrip())
    for name, why in (rdzv.get("not_run") or {}).items():
        lines.append(f"- `{name}`: not run ({why})")
    names = [c["name"] for c in rdzv.get("configs", [])]
    header = "| scenario | " + " | ".join(f"`{n}`" for n in names) + " |"
    lines += ["", header, "|---|" + "---|" * len(names)]
    for scen, block in (rdzv.get("scenarios") or {}).items():
        cells = []
        for n in names:
            res = block.get("results", {}).get(n)
            if not res:
                cells.append("not run")
                continue
            cell = format_summary(res.get("summary", {}))
            ratio = (rdzv.get("ratios", {}).get(scen) or {}).get(n)
            if n != ours and ratio:
                cell += f"<br>{ours} {format_ratio(ratio)} faster"
            cells.append(cell)
        lines.append(f"| {block.get('title', scen)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the time goes: median seconds from the event to the first new worker process starting "
        "(detection + rendezvous + spawn), the last rank's worker starting, the last rank done importing "
        "torch, the first rank with its process group and DDP model (store bootstrap + gloo mesh), and the "
        "first step.",
        "",
        "| scenario | config | first worker | all started | torch imported | process group | first step |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = ("workers_started", "all_started", "imported", "pg_ready", "first_step")
    for scen, block in (rdzv.get("scenarios") or {}).items():
        for n, res in block.get("results", {}).items():
            cells = []
            for key in keys:
                m = median(p[key] for p in res.get("phases", []) if p and p.get(key) is not None)
                cells.append("-" if m is None else f"{m:.2f}")
            lines.append(f"| {scen} | `{n}` | " + " | ".join(cells) + " |")
    failures = []
    for scen, block in (rdzv.get("scenarios") or {}).items():
        for n, res in block.get("results", {}).items():
            for s in res.get("samples", []):
                if s.get("status") not in ("ok", "not_run"):
                    failures.append(f"- {scen} `{n}`: {s['status']} - {_cell(s.get('detail', ''))[:500]}")
    if failures:
        lines += ["", "Runs that did not get there (agent states and last log lines):", "", *failures]
    for img in images:
        if img.name.startswith("recovery-"):
            lines += ["", f"![{img.stem}]({os.path.relpath(img, out.parent)})"]
    lines.append("")
    return lines


def render_scale(doc: Mapping[str, Any]) -> list[str]:
    """Rounds at N participants with etcd operation counts, and the process-group bootstrap comparison."""
    lines = [
        "## Rendezvous alone at scale (`benchmarks/rdzv_scale.py`)",
        "",
        "N participants (each with its own lease, keep-alive, join loop and etcd writes, as an agent without "
        f"torchrun) run as threads of {doc.get('processes', '?')} host processes. They form a round, then "
        "one participant's lease is revoked and the rest form the next (a failure round); settle window "
        f"{doc.get('settle_s', '?')} s. Seconds run from the start signal to the last participant holding "
        "its rank. etcd operations: client counts; CPU: the host processes' CPU time in the failure round "
        "divided by the participants.",
        "",
    ]
    tables = (
        ("scale", "One watch of the run per host process (as agents behind an etcd gRPC proxy, which "
         "coalesces identical watches); one probe participant keeps a watch of its own."),
        ("scale_own", "A watch per participant: etcd sends every event to N watchers and this machine "
         "decodes all N^2 of them, so on 2 cores the round time is bounded by the simulation's client CPU "
         "(N x the per-agent figure), which separate machines would spend in parallel."),
    )  # fmt: skip
    for key, title in tables:
        rows = [r for r in doc.get(key) or [] if isinstance(r, Mapping)]
        if not rows:
            continue
        lines += [
            title,
            "",
            "| N | first round s | writes | failure detected s | failure round s | writes | writes/N | "
            "probe s | client CPU ms / participant |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r.get("error"):
                lines.append(f"| {r.get('n')} | did not finish: {r['error']} | | | | | | | |")
                continue
            w2 = number(dig(r, "failure_round_ops.writes"))
            per = f"{w2 / r['n']:.2f}" if w2 is not None and r.get("n") else "-"
            probes = [number(r.get(k)) for k in ("probe_first_round_s", "probe_failure_round_s")]
            pk = [x for x in probes if x is not None]
            lines.append(
                f"| {r.get('n')} | {_fmt(r.get('first_round_s'))} | "
                f"{_fmt(dig(r, 'first_round_ops.writes'))} | {_fmt(r.get('detect_s'))} | "
                f"{_fmt(r.get('failure_round_s'))} | {_fmt(w2)} | {per} | "
                f"{_fmt(max(pk) if pk else None)} | "
                f"{_fmt(dig(r, 'client_cpu_ms_per_participant.failure_round'))} |"
            )
        lines.append("")
    boot = [b for b in doc.get("bootstrap") or [] if isinstance(b, Mapping)]
    if boot:
        lines += [
            "",
            "Process-group bootstrap exchange (every rank publishes an address and reads all others):",
            "",
            "| ranks | TCPStore s | etcd keys s | etcd / TCPStore |",
            "|---|---|---|---|",
        ]
        for b in boot:
            lines.append(
                f"| {b.get('n')} | {_fmt(b.get('tcpstore_s'))} | {_fmt(b.get('etcd_keys_s'))} | "
                f"{_fmt(b.get('etcd_over_tcp'))} |"
            )
    lines.append("")
    return lines


def render_latency(doc: Mapping[str, Any], images: list[Path], out: Path) -> list[str]:
    """Recovery against one-way delay per backend, and the etcd leader-kill samples."""
    settings = doc.get("settings") or {}
    lines = [
        "## Recovery vs network latency (`benchmarks/rdzv_latency.py`)",
        "",
        "Three torchrun agents (`--nnodes=2:4`) reach their rendezvous service through `tests/netproxy.py`, "
        "a loopback proxy that delays each direction by the one-way delay below; one node is killed with "
        "SIGKILL and the figure is the time to the first step at world size 2 (median over "
        f"{settings.get('repeats', '?')} repeats, min-max in brackets, cap {_fmt(settings.get('cap'))} s). "
        "c10d's TCPStore runs as a separate process behind the proxy (`is_host=false`), like etcd. Only "
        "rendezvous traffic is delayed; the workers' gloo traffic stays on loopback. The 0 ms column goes "
        "through the proxy too. Load average at the start and end: "
        f"{(doc.get('machine') or {}).get('loadavg', '?')}, {doc.get('loadavg_end', '?')} (a loaded machine "
        "slows the baselines most: their recovery restarts workers, which import torch again).",
        "",
    ]
    if doc.get("command"):
        lines += ["```", str(doc["command"]), "```", ""]
    series = latency_series(doc)
    delays = sorted({d for pts in series.values() for d, _ in pts})
    lines += [
        "| backend | " + " | ".join(f"{d:g} ms" for d in delays) + " |",
        "|---|" + "---|" * len(delays),
    ]
    for name, pts in series.items():
        by = dict(pts)
        cells = []
        for d in delays:
            sm = by.get(d)
            if sm is None:
                cells.append("-")
                continue
            med = f"> {_fmt(sm.get('median'))}" if sm.get("median_censored") else _fmt(sm.get("median"))
            mx = f"> {_fmt(sm.get('max'))}" if sm.get("max_censored") else _fmt(sm.get("max"))
            cells.append(f"{med} ({_fmt(sm.get('min'))}-{mx}), {sm.get('ok')}/{sm.get('n')} ok")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    img = [p for p in images if p.name == "latency-recovery.png"]
    if img:
        lines += ["", f"![recovery vs latency]({os.path.relpath(img[0], out.parent)})", ""]
    lk = doc.get("leader_kill") or {}
    samples = [s for s in lk.get("samples") or [] if isinstance(s, Mapping)]
    if samples:
        sm = lk.get("summary") or {}
        restarts = sum(1 for s in samples if s.get("restarted"))
        lines += [
            "",
            "**etcd leader killed** (etcd3, 3-member etcd, endpoint list of all members, no proxy; three "
            "nodes training): seconds from SIGKILL of the leader to the next committed training step, median "
            f"{_fmt(sm.get('median'))} s (min {_fmt(sm.get('min'))}, max {_fmt(sm.get('max'))}) over "
            f"{sm.get('n', len(samples))} kills; workers restarted in {restarts} of them.",
            "",
            "| kill | status | seconds to next step | workers restarted | world sizes after |",
            "|---|---|---|---|---|",
        ]
        for i, s in enumerate(samples):
            lines.append(
                f"| {i + 1} | {s.get('status')} | {_fmt(s.get('seconds'))} | "
                f"{'yes' if s.get('restarted') else 'no'} | {_fmt(s.get('worlds_after'))} |"
            )
    lines.append("")
    return lines


def render_checkpoint(doc: Mapping[str, Any]) -> list[str]:
    """Per state size: seconds of each way to save, throughput, and the target ratios."""
    lines = [
        "## Checkpoint stall and throughput (`benchmarks/checkpoint.py`)",
        "",
        f"Median of {doc.get('repeats', '?')} repeats per size. Seconds the training loop waits per "
        "checkpoint, durable throughput in MB/s, and the ratios the targets are about.",
        "",
    ]
    keys = [*STALL_SERIES, "raw_write_s", "raw_overwrite_s", "et_durable_s"]
    results = [r for r in doc.get("results") or [] if isinstance(r, Mapping)]
    present = [k for k in keys if any(k in r for r in results)]
    if results and present:
        lines += [
            "| state MB | " + " | ".join(f"`{k}`" for k in present) + " |",
            "|---|" + "---|" * len(present),
        ]
        for r in results:
            lines.append(
                f"| {_fmt(r.get('size_mb'))} | " + " | ".join(_fmt(r.get(k)) for k in present) + " |"
            )
        tp_keys: list[str] = []
        for r in results:
            tp_keys += [k for k in (r.get("throughput_mb_s") or {}) if k not in tp_keys]
        if tp_keys:
            lines += ["", "| state MB | " + " | ".join(f"{k} MB/s" for k in tp_keys) + " |"]
            lines.append("|---|" + "---|" * len(tp_keys))
            for r in results:
                tp = r.get("throughput_mb_s") or {}
                lines.append(
                    f"| {_fmt(r.get('size_mb'))} | " + " | ".join(_fmt(tp.get(k)) for k in tp_keys) + " |"
                )
    lines += [
        "",
        "| state MB | stall / shm copy (<= 1.5) | durable / raw write (>= 0.8) | durable / DCP (>= 1) "
        "| durable / raw overwrite |",
    ]
    lines.append("|---|---|---|---|---|")
    for size, r in checkpoint_sizes(doc):
        cells = [_fmt(r["stall"]), _fmt(r["raw"]), _fmt(r["dcp"]), _fmt(r.get("overwrite"))]
        lines.append(f"| {size:g} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def render_generic(name: str, doc: Mapping[str, Any]) -> list[str]:
    """A benchmark's ``figures`` list as a table, else its top-level numbers; enough to audit any shape."""
    lines = [f"## {name} (`benchmarks/{name}.py`)", ""]
    if doc.get("description"):
        lines += [str(doc["description"]), ""]
    figures = doc.get("figures")
    if isinstance(figures, list) and figures and all(isinstance(f, Mapping) for f in figures):
        keys: list[str] = []
        for f in figures:
            keys += [k for k in f if k not in keys and not isinstance(f[k], (dict, list))]
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for f in figures:
            lines.append("| " + " | ".join(_fmt(f.get(k)) for k in keys) + " |")
    else:
        rows = [(k, v) for k, v in _leaves(doc) if not k.startswith(("machine.", "targets."))][:60]
        lines += ["| figure | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows]
    lines.append("")
    return lines


def _leaves(doc: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(doc, Mapping):
        for k, v in doc.items():
            out += _leaves(v, f"{prefix}{k}.")
    elif isinstance(doc, list):
        if doc and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in doc):
            out.append((prefix.rstrip("."), ", ".join(f"{v:.4g}" for v in doc[:20])))
        elif len(doc) <= 20:
            for i, v in enumerate(doc):
                out += _leaves(v, f"{prefix}{i}.")
    elif isinstance(doc, (int, float, str)) and not isinstance(doc, bool):
        out.append((prefix.rstrip("."), doc))
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return _cell("" if v is None else str(v))


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run the benchmarks and write docs/benchmarks.md.")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown file to write")
    p.add_argument("--json-dir", default=None, help="where the raw JSON goes (default: <out dir>/benchmarks)")
    p.add_argument("--img-dir", default=None, help="where the PNG plots go (default: <out dir>/img)")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--from-json", default=None, help="do not run anything: render from JSON files in this dir"
    )
    p.add_argument(
        "--keep-others",
        action="store_true",
        help="with --only: render the benchmarks not selected from their JSON of an earlier run",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds per benchmark (default 10800, quick 600)"
    )
    p.add_argument(
        "--rendezvous-args",
        default="",
        help="extra arguments for rendezvous.py, e.g. '--repeats 5 --cap 120'",
    )
    args = p.parse_args(argv)
    if args.keep_others and not args.only:
        p.error("--keep-others needs --only")
    if args.only:
        bad = [n for n in args.only.split(",") if n not in BENCHMARKS]
        if bad:
            p.error(f"unknown benchmark(s): {', '.join(bad)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_dir = Path(args.from_json or args.json_dir or out.parent / "benchmarks")
    img_dir = Path(args.img_dir or out.parent / "img")
    json_dir.mkdir(parents=True, exist_ok=True)
    img_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (600.0 if args.quick else 10800.0)
    selected = args.only.split(",") if args.only else list(BENCHMARKS)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])

    docs: dict[str, dict[str, Any] | None] = {}
    runs: list[RunRecord] = []
    for name in BENCHMARKS:
        path = json_dir / f"{name}.json"
        if name not in selected:
            docs[name] = load_json(path) if args.keep_others else None
            if docs[name] is not None:
                when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
                runs.append(RunRecord(name, "earlier run", detail=f"not re-run: {path} of {when}"))
            else:
                runs.append(RunRecord(name, "absent", detail="not selected (--only)"))
            continue
        if args.from_json:
            docs[name] = load_json(path)
            doc = docs[name]
            if doc is not None:
                started = doc.get("started")
                when = f" (run started {started})" if isinstance(started, str) else ""
                runs.append(RunRecord(name, "earlier run", detail=f"from {path}{when}"))
            else:
                runs.append(RunRecord(name, "absent", detail=f"no {path}"))
            continue
        extra = shlex.split(args.rendezvous_args) if name == "rendezvous" else []
        rec = run_benchmark(name, path, quick=args.quick, timeout=timeout, extra=extra)
        runs.append(rec)
        docs[name] = load_json(path)
        if rec.status == "ok" and docs[name] is None:
            rec.status, rec.detail = "failed", f"{path} is not a JSON object"
        elif rec.status != "ok" and docs[name] is not None:
            # a benchmark that writes as it goes (rendezvous.py) leaves partial results: show them as such
            rec.detail += "; partial results shown"
            rec.status = f"partial ({rec.status})"

    machine = dict((docs.get("rendezvous") or {}).get("machine") or machine_info())
    targets = evaluate_targets(docs)
    images: list[Path] = []
    if docs.get("rendezvous"):
        images += plot_timelines(docs["rendezvous"] or {}, img_dir)
    if docs.get("rdzv_latency"):
        latency_img = plot_latency(docs["rdzv_latency"] or {}, img_dir)
        if latency_img:
            images.append(latency_img)
    if docs.get("checkpoint"):
        stall = plot_stall(docs["checkpoint"] or {}, img_dir)
        if stall:
            images.append(stall)
    text = render(docs, runs, targets, images, out=out, command=command, machine=machine, json_dir=json_dir)
    out.write_text(text, encoding="utf-8")
    (json_dir / "targets.json").write_text(
        json.dumps([asdict(t) for t in targets], indent=1) + "\n", encoding="utf-8"
    )
    print(f"wrote {out}")
    for t in targets:
        print(f"  {t.status:<13} {t.name}: {t.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
