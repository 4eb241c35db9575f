"""Run every benchmark in benchmarks/ and write docs/benchmarks.md (figures, ratios, targets, machine, plots).

    .venv/bin/python benchmarks/report.py --out docs/benchmarks.md            # what `make bench` runs
    .venv/bin/python benchmarks/report.py --quick --out /tmp/b.md             # a fast check of the pipeline
    .venv/bin/python benchmarks/report.py --from-json docs/benchmarks --out docs/benchmarks.md   # re-render

Each benchmark script is run as ``python benchmarks/NAME.py --json FILE [--quick]``. A script that is absent,
fails or times out gets a "not run" row with the reason, and every target that needed it is "not measured".
The raw JSON is kept next to the report (``--json-dir``) so a report can be re-rendered or audited.

Every document is read through its model in :mod:`schema`: one that does not fit is refused with the file
and the first problem (its benchmark shows as failed, its targets as not measured). The targets are the
table in :mod:`targets`, evaluated by one function.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import schema
import targets as target_table
from harness import format_ratio, format_summary, machine_info
from schema import CheckpointDoc, Document, LatencyDoc, RendezvousDoc, ScaleDoc, ScaleRound
from targets import Target, median

HERE = Path(__file__).resolve().parent
#: Benchmark scripts, in the order they run and appear.
BENCHMARKS = (
    "rendezvous",
    "rdzv_scale",
    "checkpoint",
    "overhead",
    "recovery",
    "rdzv_latency",
    "lightning",
    "hot",
)


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


#: Before each command block of the report: tests/docs runs every documented command unless told why not.
SKIP_MARKER = (
    '<!-- doc-test: skip="a benchmark run: minutes to half an hour of a quiet machine (make bench)" -->'
)
#: Before the command that wrote the report (with --from-json it runs nothing, but rewrites the page).
REPORT_MARKER = '<!-- doc-test: skip="the command that wrote this page: it rewrites docs/benchmarks.md" -->'
_VENV_DIR = re.compile(r"(?<![\w.])/(?:[\w.-]+/)*(?=\.venv/)")


def without_dirs(text: str) -> str:
    """A recorded log line without the directories above the machine's virtual environment."""
    return _VENV_DIR.sub("", text)


def shown_command(argv: list[str]) -> str:
    """A command line as the report shows it: the interpreter as ``python``, paths of this checkout relative,
    so that the page names no directory of the machine it was made on."""
    root = str(HERE.parent) + os.sep
    words = [
        "python" if n == 0 and os.path.basename(a).startswith("python") else a for n, a in enumerate(argv)
    ]
    return " ".join(shlex.quote(w.replace(root, "")) for w in words)


def run_benchmark(name: str, json_path: Path, *, quick: bool, timeout: float, extra: list[str]) -> RunRecord:
    """Run ``benchmarks/NAME.py --json FILE``; its output goes to ``NAME.log`` next to the JSON and is echoed.

    On timeout the script gets SIGTERM (so it can clean up its processes) and SIGKILL 60 s later.
    """
    script = HERE / f"{name}.py"
    if not script.exists():
        return RunRecord(name, "absent", detail=f"benchmarks/{name}.py does not exist")
    cmd = [sys.executable, str(script), "--json", str(json_path), *(["--quick"] if quick else []), *extra]
    shown = shown_command(cmd)
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


def load_doc(name: str, path: Path) -> tuple[Document | None, str]:
    """Benchmark ``name``'s document from ``path``: (the document, "") or (None, why it is not usable)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None, f"no {path}"
    except OSError as exc:
        return None, f"{path}: {exc.strerror}"
    try:
        return schema.parse(name, text, str(path)), ""
    except schema.SchemaError as exc:
        return None, str(exc)


# ---------------------------------------------------------------------------------------------------------
# Plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def _xy_plot(path: Path, title: str, xlabel: str, ylabel: str, draw: Any, *, log: bool = False) -> Path:
    """One 8x4.5 in. chart with a legend: ``draw(ax)`` adds the series."""
    fig, ax = _pyplot().subplots(figsize=(8, 4.5))
    draw(ax)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_timelines(rdzv: RendezvousDoc, img_dir: Path) -> list[Path]:
    """One PNG per scenario: world size of each rank-0 step against seconds since the event, per backend."""
    plt = _pyplot()
    written = []
    for scen, per_config in rdzv.timelines.items():
        names = [n for n, pts in per_config.items() if pts]
        if not names:
            continue
        block = rdzv.scenarios.get(scen)
        fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.3 * len(names) + 1), sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names, strict=True):
            pts = per_config[name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=3)
            ax.axvline(0, color="red", linewidth=1)
            res = block.results.get(name) if block else None
            if res and res.samples and res.samples[0].status == "ok" and res.samples[0].seconds is not None:
                ax.axvline(res.samples[0].seconds, color="green", linewidth=1, linestyle="--")
            phase = res.phases[0] if res and res.phases else None
            if phase and phase.workers_started is not None:
                ax.axvline(phase.workers_started, color="gray", linewidth=1, linestyle=":")
            ax.set_ylabel(name, rotation=0, ha="right", va="center")
            ax.set_ylim(0.5, 4.5)
            ax.set_yticks([1, 2, 3, 4])
            ax.grid(True, alpha=0.3)
        axes[0, 0].set_title(
            f"{block.title if block else scen}\nworld size of rank 0's steps; red: event, gray: new workers "
            "started, green: first step at the new size",
            fontsize=9,
        )
        axes[-1, 0].set_xlabel("seconds since the event (first repeat)")
        written.append(_save(fig, img_dir / f"recovery-{scen}.png"))
    return written


#: checkpoint.py per-size keys plotted against state size, with their legend labels.
STALL_SERIES = {
    "et_stall_s": "elastic_train stall, durable checkpoint due",
    "et_memory_step_stall_s": "elastic_train stall, memory-only step",
    "shm_copy_s": "plain shared-memory copy (floor)",
    "torch_save_s": "torch.save + fsync (synchronous)",
    "dcp_s": "torch DCP save (synchronous)",
}


def stall_series(doc: CheckpointDoc) -> dict[str, list[tuple[float, float]]]:
    """``{label: [(state MB, seconds)]}`` for every :data:`STALL_SERIES` key, sorted by size."""
    sizes = sorted(doc.results, key=lambda r: r.size_mb)
    return {label: [(r.size_mb, getattr(r, key)) for r in sizes] for key, label in STALL_SERIES.items()}


def plot_stall(doc: CheckpointDoc, img_dir: Path) -> Path | None:
    """Seconds the loop waits per checkpoint against state size, every way to save, and the 1.5x bar."""
    if not doc.results:
        return None
    series = stall_series(doc)

    def draw(ax: Any) -> None:
        for label, pts in series.items():
            style = "o-" if label.startswith("elastic_train") else "s--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        floor = series[STALL_SERIES["shm_copy_s"]]
        xs, ys = [p[0] for p in floor], [1.5 * p[1] for p in floor]
        ax.plot(xs, ys, ":", color="gray", label="target: 1.5x shm copy")

    return _xy_plot(
        img_dir / "checkpoint-stall.png", "Checkpoint stall vs state size", "state size (MB)",
        "seconds the training loop waits", draw, log=True,
    )  # fmt: skip


def plot_latency(doc: LatencyDoc, img_dir: Path) -> Path | None:
    """Median recovery (kill -9 -> training at world 2) against one-way delay, min-max bars, per backend."""
    series = doc.series()
    if not series:
        return None

    def draw(ax: Any) -> None:
        for name, pts in series.items():
            med = [s.median or 0.0 for _, s in pts]
            lo = [m - (s.min if s.min is not None else m) for m, (_, s) in zip(med, pts, strict=True)]
            hi = [(s.max if s.max is not None else m) - m for m, (_, s) in zip(med, pts, strict=True)]
            style = "o-" if name == "etcd3" else "s--"
            ax.errorbar([d for d, _ in pts], med, yerr=[lo, hi], fmt=style, capsize=3, label=name)

    return _xy_plot(
        img_dir / "latency-recovery.png", "Recovery vs network latency (median, min-max)",
        "one-way delay to the rendezvous service (ms)", "seconds from kill -9 to training at world 2", draw,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Markdown


def render(
    docs: Mapping[str, Document | None],
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
        REPORT_MARKER,
        "```bash",
        command,
        "```",
        "",
        "One benchmark alone, the others kept from their JSON (e.g. to re-measure on a quiet machine):",
        "",
        SKIP_MARKER,
        "```bash",
        *(
            f"python benchmarks/report.py --out docs/benchmarks.md --only {name} --keep-others"
            for name in ("overhead", "recovery", "lightning", "hot")
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
    lines.append(
        f"\nRaw JSON and logs: [`{os.path.relpath(json_dir)}/`]({os.path.relpath(json_dir, out.parent)}/).\n"
    )

    for name in BENCHMARKS:
        doc = docs.get(name)
        if isinstance(doc, RendezvousDoc):
            lines += render_rendezvous(doc, images, out)
        elif isinstance(doc, ScaleDoc):
            lines += render_scale(doc)
        elif isinstance(doc, CheckpointDoc):
            lines += render_checkpoint(doc)
        elif isinstance(doc, LatencyDoc) and doc.series():
            lines += render_latency(doc, images, out)
        elif isinstance(doc, schema.OverheadDoc | schema.RecoveryDoc | schema.LightningDoc | schema.HotDoc):
            lines += render_figures(name, doc.description, doc.figures)
            if isinstance(doc, schema.HotDoc):
                lines += render_torchft(doc.torchft)
    stall_img = [p for p in images if p.name == "checkpoint-stall.png"]
    if stall_img:
        lines += ["", f"![checkpoint stall vs state size]({os.path.relpath(stall_img[0], out.parent)})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_rendezvous(rdzv: RendezvousDoc, images: list[Path], out: Path) -> list[str]:
    """Every configuration per scenario, where the time goes, what did not get there, the timelines."""
    ours, st = rdzv.ours, rdzv.settings
    lines = [
        "## Rendezvous and recovery (torchrun agents, `benchmarks/rendezvous.py`)",
        "",
        f"3 torchrun agents on loopback, `--nnodes={st.nnodes} --nproc-per-node=1`, "
        f"tiny gloo DDP worker stepping every {st.step_interval} s, "
        f"`--monitor-interval={st.monitor_interval}` (torchrun's default) and "
        f"`--max-restarts={st.max_restarts}` for every backend; {rdzv.repeats} "
        f"repeat(s). Seconds are median [min, max] (runs that got there / runs); `> cap` means the backend "
        f"did not train at the new size within the cap ({st.cap} s; SIGSTOP on baselines "
        f"{st.hang_cap} s): it failed or stalled. "
        f"Ratios are baseline median / {ours} median.",
        "",
        "The node killed or frozen is the most recently started one that does not host c10d's TCPStore "
        "(losing that host ends a c10d job by design, which is not a recovery figure). Each repeat runs "
        "three jobs per configuration (launch + add a node, launch + kill, launch + SIGSTOP), so `launch` "
        "has up to three samples per repeat.",
        "",
    ]
    if not rdzv.complete:
        lines += [
            f"**Partial run**: {len(rdzv.runs)} of {rdzv.planned_jobs} jobs "
            "finished before the benchmark stopped; the figures below cover those only.",
            "",
        ]
    lines += [f"Load average at start {rdzv.machine.loadavg}, at end {rdzv.loadavg_end}.", ""]
    if st.baseline_jobs != st.jobs:
        lines += [f"Quick mode: the baselines ran only the {', '.join(st.baseline_jobs)} job(s).", ""]
    lines += ["Configurations:", ""]
    for c in rdzv.configs:
        conf = ",".join(f"{k}={v}" for k, v in c.rdzv_conf.items())
        env = " ".join(f"{k}={v}" for k, v in c.env.items())
        extra = " ".join(x for x in (f"`--rdzv-conf={conf}`" if conf else "", f"`{env}`" if env else "") if x)
        lines.append(f"- `{c.name}`: {c.description} {extra}".rstrip())
    for name, why in rdzv.not_run.items():
        lines.append(f"- `{name}`: not run ({why})")
    names = [c.name for c in rdzv.configs]
    header = "| scenario | " + " | ".join(f"`{n}`" for n in names) + " |"
    lines += ["", header, "|---|" + "---|" * len(names)]
    for scen, block in rdzv.scenarios.items():
        cells = []
        for n in names:
            res = block.results.get(n)
            if not res:
                cells.append("not run")
                continue
            cell = format_summary(res.summary.model_dump())
            ratio = (rdzv.ratios.get(scen) or {}).get(n)
            if n != ours and ratio:
                cell += f"<br>{ours} {format_ratio(ratio.model_dump())} faster"
            cells.append(cell)
        lines.append(f"| {block.title} | " + " | ".join(cells) + " |")
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
    for scen, block in rdzv.scenarios.items():
        for n, res in block.results.items():
            cells = []
            for key in keys:
                m = median(getattr(p, key) for p in res.phases if p and getattr(p, key) is not None)
                cells.append("-" if m is None else f"{m:.2f}")
            lines.append(f"| {scen} | `{n}` | " + " | ".join(cells) + " |")
    failures = []
    for scen, block in rdzv.scenarios.items():
        for n, res in block.results.items():
            for s in res.samples:
                if s.status not in ("ok", "not_run"):
                    failures.append(f"- {scen} `{n}`: {s.status} - {_cell(without_dirs(s.detail))[:500]}")
    if failures:
        lines += ["", "Runs that did not get there (agent states and last log lines):", "", *failures]
    for img in images:
        if img.name.startswith("recovery-"):
            lines += ["", f"![{img.stem}]({os.path.relpath(img, out.parent)})"]
    lines.append("")
    return lines


def render_scale(doc: ScaleDoc) -> list[str]:
    """Rounds at N participants with etcd operation counts, and the process-group bootstrap comparison."""
    lines = [
        "## Rendezvous alone at scale (`benchmarks/rdzv_scale.py`)",
        "",
        "N participants (each with its own lease, keep-alive, join loop and etcd writes, as an agent without "
        f"torchrun) run as threads of {doc.processes} host processes. They form a round, then "
        "one participant's lease is revoked and the rest form the next (a failure round); settle window "
        f"{doc.settle_s} s. Seconds run from the start signal to the last participant holding "
        "its rank. etcd operations: client counts; CPU: the host processes' CPU time in the failure round "
        "divided by the participants.",
        "",
    ]
    tables = (
        (doc.scale, "One watch of the run per host process (as agents behind an etcd gRPC proxy, which "
         "coalesces identical watches); one probe participant keeps a watch of its own."),
        (doc.scale_own, "A watch per participant: etcd sends every event to N watchers and this machine "
         "decodes all N^2 of them, so on 2 cores the round time is bounded by the simulation's client CPU "
         "(N x the per-agent figure), which separate machines would spend in parallel."),
    )  # fmt: skip
    for rows, title in tables:
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
            if not isinstance(r, ScaleRound):
                lines.append(f"| {r.n} | did not finish: {r.error} | | | | | | | |")
                continue
            w2 = r.failure_round_ops.writes
            lines.append(
                f"| {r.n} | {_fmt(r.first_round_s)} | {r.first_round_ops.writes} | {_fmt(r.detect_s)} | "
                f"{_fmt(r.failure_round_s)} | {w2} | {w2 / r.n:.2f} | {_fmt(r.probe_s)} | "
                f"{_fmt(r.client_cpu_ms_per_participant.failure_round)} |"
            )
        lines.append("")
    if doc.bootstrap:
        lines += [
            "",
            "Process-group bootstrap exchange (every rank publishes an address and reads all others):",
            "",
            "| ranks | TCPStore s | etcd keys s | etcd / TCPStore |",
            "|---|---|---|---|",
        ]
        for b in doc.bootstrap:
            lines.append(
                f"| {b.n} | {_fmt(b.tcpstore_s)} | {_fmt(b.etcd_keys_s)} | {_fmt(b.etcd_over_tcp)} |"
            )
    lines.append("")
    return lines


def render_latency(doc: LatencyDoc, images: list[Path], out: Path) -> list[str]:
    """Recovery against one-way delay per backend, and the etcd leader-kill samples."""
    lines = [
        "## Recovery vs network latency (`benchmarks/rdzv_latency.py`)",
        "",
        "Three torchrun agents (`--nnodes=2:4`) reach their rendezvous service through `tests/netproxy.py`, "
        "a loopback proxy that delays each direction by the one-way delay below; one node is killed with "
        "SIGKILL and the figure is the time to the first step at world size 2 (median over "
        f"{doc.settings.repeats} repeats, min-max in brackets, cap {_fmt(doc.settings.cap)} s). "
        "c10d's TCPStore runs as a separate process behind the proxy (`is_host=false`), like etcd. Only "
        "rendezvous traffic is delayed; the workers' gloo traffic stays on loopback. The 0 ms column goes "
        "through the proxy too. Load average at the start and end: "
        f"{doc.machine.loadavg}, {doc.loadavg_end} (a loaded machine "
        "slows the baselines most: their recovery restarts workers, which import torch again).",
        "",
    ]
    if doc.command:
        lines += [SKIP_MARKER, "```bash", shown_command(shlex.split(doc.command)), "```", ""]
    series = doc.series()
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
            med = f"> {_fmt(sm.median)}" if sm.median_censored else _fmt(sm.median)
            mx = f"> {_fmt(sm.max)}" if sm.max_censored else _fmt(sm.max)
            cells.append(f"{med} ({_fmt(sm.min)}-{mx}), {sm.ok}/{sm.n} ok")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    img = [p for p in images if p.name == "latency-recovery.png"]
    if img:
        lines += ["", f"![recovery vs latency]({os.path.relpath(img[0], out.parent)})", ""]
    samples = doc.leader_kill.samples
    if samples:
        sm = doc.leader_kill.summary
        restarts = sum(1 for s in samples if s.restarted)
        lines += [
            "",
            "**etcd leader killed** (etcd3, 3-member etcd, endpoint list of all members, no proxy; three "
            "nodes training): seconds from SIGKILL of the leader to the next committed training step, median "
            f"{_fmt(sm and sm.median)} s (min {_fmt(sm and sm.min)}, max {_fmt(sm and sm.max)}) over "
            f"{sm.n if sm else len(samples)} kills; workers restarted in {restarts} of them.",
            "",
            "| kill | status | seconds to next step | workers restarted | world sizes after |",
            "|---|---|---|---|---|",
        ]
        for i, s in enumerate(samples):
            lines.append(
                f"| {i + 1} | {s.status} | {_fmt(s.seconds)} | "
                f"{'yes' if s.restarted else 'no'} | {_fmt(s.worlds_after)} |"
            )
    lines.append("")
    return lines


def render_checkpoint(doc: CheckpointDoc) -> list[str]:
    """Per state size: seconds of each way to save, throughput, and the target ratios."""
    lines = [
        "## Checkpoint stall and throughput (`benchmarks/checkpoint.py`)",
        "",
        f"Median of {doc.repeats} repeats per size. Seconds the training loop waits per "
        "checkpoint, durable throughput in MB/s, and the ratios the targets are about.",
        "",
    ]
    keys = [*STALL_SERIES, "raw_write_s", "raw_overwrite_s", "et_durable_s"]
    results = doc.results
    if results:
        lines += [
            "| state MB | " + " | ".join(f"`{k}`" for k in keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        for r in results:
            lines.append(f"| {_fmt(r.size_mb)} | " + " | ".join(_fmt(getattr(r, k)) for k in keys) + " |")
        tp_keys: list[str] = []
        for r in results:
            tp_keys += [k for k in r.throughput_mb_s if k not in tp_keys]
        if tp_keys:
            lines += ["", "| state MB | " + " | ".join(f"{k} MB/s" for k in tp_keys) + " |"]
            lines.append("|---|" + "---|" * len(tp_keys))
            for r in results:
                tp = r.throughput_mb_s
                lines.append(f"| {_fmt(r.size_mb)} | " + " | ".join(_fmt(tp.get(k)) for k in tp_keys) + " |")
    lines += [
        "",
        "| state MB | stall / shm copy (<= 1.5) | durable / raw write (>= 0.8) | durable / DCP (>= 1) "
        "| durable / raw overwrite |",
    ]
    lines.append("|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: r.size_mb):
        ra = r.ratios
        cells = [
            ra.stall_over_shm_copy,
            ra.durable_over_raw_write,
            ra.durable_over_dcp,
            ra.durable_over_raw_overwrite,
        ]
        lines.append(f"| {r.size_mb:g} | " + " | ".join(_fmt(c) for c in cells) + " |")
    lines.append("")
    return lines


def render_figures(name: str, description: str, figures: list[schema.FigureRow]) -> list[str]:
    """A benchmark's own figures table (``overhead.py``, ``recovery.py``) under its description."""
    lines = [f"## {name} (`benchmarks/{name}.py`)", ""]
    if description:
        lines += [description, ""]
    if figures:
        keys: list[str] = []
        for f in figures:
            keys += [k for k in f if k not in keys]
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for f in figures:
            lines.append("| " + " | ".join(_fmt(f.get(k)) for k in keys) + " |")
    lines.append("")
    return lines


def render_torchft(torchft: dict[str, Any] | None) -> list[str]:
    """One line on torchft beside hot recovery: its version and settings, or why it did not run."""
    if torchft is None:
        return ["torchft: not run (`hot.py --torchft-python PATH` runs `benchmarks/torchft_probe.py`).", ""]
    if torchft.get("skipped"):
        return [f"torchft: not measured: {_cell(str(torchft['skipped']))}", ""]
    return [
        f"torchft {torchft.get('torchft')} (`benchmarks/torchft_probe.py`: 3 replica groups of 1 process on "
        f"gloo, lighthouse join timeout {torchft.get('join_timeout_ms')} ms): kill -> next committed step "
        f"{_fmt(torchft.get('kill_s'))} s, joiner's model built -> committed step with it "
        f"{_fmt(torchft.get('join_s'))} s.",
        "",
    ]


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
    p.add_argument(
        "--overhead-args", default="", help="extra arguments for overhead.py, e.g. '--configs 17ms,200ms'"
    )
    p.add_argument("--recovery-args", default="", help="extra arguments for recovery.py, e.g. '--sizes 100'")
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
    command = shown_command([sys.executable, *sys.argv])

    docs: dict[str, Document | None] = {}
    runs: list[RunRecord] = []
    for name in BENCHMARKS:
        path = json_dir / f"{name}.json"
        if name not in selected:
            docs[name], problem = load_doc(name, path) if args.keep_others else (None, "")
            if docs[name] is not None:
                when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
                runs.append(RunRecord(name, "earlier run", detail=f"not re-run: {path} of {when}"))
            else:
                why = f"; earlier run unusable: {problem}" if problem and path.exists() else ""
                runs.append(RunRecord(name, "absent", detail="not selected (--only)" + why))
            continue
        if args.from_json:
            doc, problem = load_doc(name, path)
            docs[name] = doc
            if doc is not None:
                started = getattr(doc, "started", None)
                when = f" (run started {started})" if isinstance(started, str) else ""
                runs.append(RunRecord(name, "earlier run", detail=f"from {path}{when}"))
            elif path.exists():
                print(f"report: {problem}", file=sys.stderr)
                runs.append(RunRecord(name, "failed", detail=problem))
            else:
                runs.append(RunRecord(name, "absent", detail=problem))
            continue
        extra = shlex.split(getattr(args, f"{name}_args", "") or "")
        rec = run_benchmark(name, path, quick=args.quick, timeout=timeout, extra=extra)
        runs.append(rec)
        docs[name], problem = load_doc(name, path)
        if rec.status == "ok" and docs[name] is None:
            print(f"report: {problem}", file=sys.stderr)
            rec.status, rec.detail = "failed", problem
        elif rec.status != "ok" and docs[name] is not None:
            # a benchmark that writes as it goes (rendezvous.py) leaves partial results: show them as such
            rec.detail += "; partial results shown"
            rec.status = f"partial ({rec.status})"

    rdzv, ckpt, latency = (docs.get(n) for n in ("rendezvous", "checkpoint", "rdzv_latency"))
    machine = rdzv.machine.model_dump() if isinstance(rdzv, RendezvousDoc) else machine_info()
    targets = target_table.evaluate_all(docs)
    images: list[Path] = []
    if isinstance(rdzv, RendezvousDoc):
        images += plot_timelines(rdzv, img_dir)
    if isinstance(latency, LatencyDoc) and (img := plot_latency(latency, img_dir)):
        images.append(img)
    if isinstance(ckpt, CheckpointDoc) and (img := plot_stall(ckpt, img_dir)):
        images.append(img)
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
