"""Run the benchmarks in benchmarks/ and write docs/benchmarks.md from the documents they write.

    .venv/bin/python benchmarks/report.py --out docs/benchmarks.md            # what `make bench` runs
    .venv/bin/python benchmarks/report.py --quick --out /tmp/b.md             # a fast check of the pipeline
    .venv/bin/python benchmarks/report.py --from-json docs/benchmarks --out docs/benchmarks.md   # re-render

Each benchmark is run as ``python benchmarks/NAME.py --json FILE [--quick]`` (its output goes to
``NAME.log`` beside the JSON) and writes one document that carries its own measurements and how to show
them::

    {"benchmark": NAME, "title": "...", "description": "markdown",
     "figures": [ROW, ...],                                   # its main table: one flat mapping per row
     "tables": [{"caption": "markdown", "rows": [ROW, ...]}],  # more tables or notes (optional)
     "targets": [{"name", "threshold", "figure", "status", "why"}], ...}   # and its raw data

Every benchmark measures its baselines (torchrun's own rendezvous backends, raw I/O, torch DCP, a plain DDP
loop, the restart path) in the same run, and its rows carry the ratios. A benchmark that is absent, fails or
times out, or whose document is not of that shape or has no figures (it measured nothing), is "not run" with
the reason. The page ends with a hand-written section (:data:`KEPT`) that every rewrite keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
#: Benchmarks that take extra arguments from the command line (``--NAME-args``).
EXTRA_ARGS = ("rendezvous", "overhead", "recovery")
#: A target's keys, as the targets table shows them.
TARGET_KEYS = ("name", "threshold", "figure", "status", "why")
#: The heading of the hand-written section that closes the page (tools outside `make bench`, figures of
#: retired probes): a rewrite of the page keeps it, from this heading to the end, as it is.
KEPT = "## Not in `make bench`"


#: Before each command block of the report: tests/docs runs every documented command unless told why not.
SKIP_MARKER = (
    '<!-- doc-test: skip="a benchmark run: minutes to half an hour of a quiet machine (make bench)" -->'
)
#: Before the command that wrote the report (with --from-json it runs nothing, but rewrites the page).
REPORT_MARKER = '<!-- doc-test: skip="the command that wrote this page: it rewrites docs/benchmarks.md" -->'


def shown_command(argv: list[str]) -> str:
    """A command line as the report shows it: the interpreter as ``python``, paths of this checkout relative,
    so that the page names no directory of the machine it was made on."""
    root = str(HERE.parent) + os.sep
    words = [
        "python" if n == 0 and os.path.basename(a).startswith("python") else a for n, a in enumerate(argv)
    ]
    return " ".join(shlex.quote(w.replace(root, "")) for w in words)


@dataclass(slots=True)
class RunRecord:
    """How one benchmark script ran."""

    name: str
    status: str
    """``ok``, ``absent``, ``failed``, ``timeout``, ``partial (…)`` or ``earlier run``."""
    command: str = ""
    seconds: float = 0.0
    detail: str = ""


def run_benchmark(name: str, json_path: Path, *, quick: bool, timeout: float, extra: list[str]) -> RunRecord:
    """Run ``benchmarks/NAME.py --json FILE``; its output goes to ``NAME.log`` next to the JSON and its tail
    is echoed. On timeout the script gets SIGTERM (so it can clean up its processes), SIGKILL 60 s later."""
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
    print("\n".join(kept[-40:]), flush=True)
    if timed_out:
        return RunRecord(name, "timeout", shown, seconds, f"over {timeout:.0f} s")
    if proc.returncode != 0 or not json_path.exists():
        last = kept[-1:] or [""]
        return RunRecord(name, "failed", shown, seconds, f"exit {proc.returncode}: {last[0][:300]}")
    return RunRecord(name, "ok", shown, seconds)


def load_doc(name: str, path: Path) -> tuple[dict[str, Any] | None, str]:
    """Benchmark ``name``'s document from ``path``: (the document, "") or (None, why it is not usable)."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, f"no {path}"
    except (OSError, ValueError) as exc:
        return None, f"{path}: {exc}"
    problem = _problem(name, doc)
    return (None, f"{path}: {problem}") if problem else (doc, "")


def _problem(name: str, doc: Any) -> str:
    """What is wrong with the shape of a document (empty when nothing)."""
    if not isinstance(doc, dict) or doc.get("benchmark") != name:
        return f"not a document of the {name} benchmark"
    if not _rows(doc.get("figures")):
        return "no figures: the benchmark measured nothing"
    for i, table in enumerate(doc.get("tables", [])):
        if not isinstance(table, dict) or not isinstance(table.get("caption", ""), str):
            return f"tables[{i}] is not a table"
        if "rows" in table and not _rows(table["rows"]):
            return f"tables[{i}]: rows are not a list of mappings"
    targets = doc.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, dict) and "name" in t for t in targets):
        return "targets are not a list of named targets"
    if not isinstance(doc.get("description", ""), str):
        return "description is not text"
    return ""


def _rows(rows: Any) -> bool:
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) for r in rows)


# ---------------------------------------------------------------------------------------------------------
# Markdown


def render(
    docs: Mapping[str, dict[str, Any] | None],
    runs: list[RunRecord],
    *,
    command: str,
    machine: Mapping[str, Any] | None = None,
) -> str:
    """The whole of docs/benchmarks.md as a string (``machine``: where benchmarks that record none ran)."""
    earlier = any(r.status == "earlier run" for r in runs)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `benchmarks/report.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        + (
            "The benchmarks marked *earlier run* were not run by this command: their figures come from the "
            "JSON of an earlier run"
            if earlier
            else "Every figure below comes from one run of this command"
        )
        + "; each benchmark measures its baselines (torchrun's own `c10d` and `etcd-v2` rendezvous, defaults "
        "and tuned; raw I/O; a plain DDP loop) in the same run.",
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
        "python benchmarks/report.py --out docs/benchmarks.md --only hot --keep-others",
        "```",
        "",
    ]
    recorded = (d.get("machine") for d in docs.values() if d)
    machine = next((m for m in recorded if isinstance(m, dict)), machine)
    if machine:
        lines += ["## Machine", "", *table([{"": k, " ": v} for k, v in machine.items()])]
        lines += [
            "",
            "A busy or shared machine inflates every figure that includes process start-up (importing torch) "
            "for all backends alike; ratios are more stable than absolute seconds.",
            "",
        ]
    targets = [dict.fromkeys(TARGET_KEYS, "") | t for d in docs.values() if d for t in d["targets"]]
    for t in targets:
        t["status"] = {"met": "**met**", "missed": "**MISSED**"}.get(
            t["status"], t["status"] or "not measured"
        )
    lines += ["## Targets", "", *table(targets, TARGET_KEYS), ""]
    rows = [
        {
            "benchmark": r.name,
            "status": f"not run ({r.status})" if r.status in ("failed", "timeout") else r.status,
            "seconds": f"{r.seconds:.0f}" if r.command else "-",
            "command / reason": " - ".join(x for x in (f"`{r.command}`" if r.command else "", r.detail) if x),
        }
        for r in runs
    ]
    lines += ["## Benchmarks run", "", *table(rows), ""]
    for name in BENCHMARKS:
        doc = docs.get(name)
        if doc is None:
            continue
        lines += [f"## {doc.get('title', name)} (`benchmarks/{name}.py`)", ""]
        if doc.get("description"):
            lines += [doc["description"], ""]
        lines += [*table(doc["figures"]), ""]
        for extra in doc.get("tables", []):
            if extra.get("caption"):
                lines += [extra["caption"], ""]
            if extra.get("rows"):
                lines += [*table(extra["rows"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def table(rows: list[dict[str, Any]], keys: tuple[str, ...] | None = None) -> list[str]:
    """A markdown table of ``rows`` (columns: ``keys``, or every key in the order first seen)."""
    if keys is None:
        seen: dict[str, None] = {}
        for r in rows:
            seen.update(dict.fromkeys(r))
        keys = tuple(seen)
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return out


def cell(v: Any) -> str:
    """A value as a table cell: floats to 4 significant digits, nothing for None."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run the benchmarks and write docs/benchmarks.md.")
    p.add_argument("--out", default="docs/benchmarks.md", help="markdown file to write")
    p.add_argument("--json-dir", default=None, help="where the raw JSON goes (default: <out dir>/benchmarks)")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--from-json", default=None, help="do not run anything: render from the JSON in this dir")
    p.add_argument(
        "--keep-others",
        action="store_true",
        help="with --only: render the benchmarks not selected from their JSON of an earlier run",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds per benchmark (default 10800, quick 600)"
    )
    for name in EXTRA_ARGS:
        p.add_argument(f"--{name}-args", default="", help=f"extra arguments for {name}.py, e.g. '--quick'")
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
    json_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (600.0 if args.quick else 10800.0)
    selected = args.only.split(",") if args.only else list(BENCHMARKS)
    docs: dict[str, dict[str, Any] | None] = {}
    runs: list[RunRecord] = []
    for name in BENCHMARKS:
        path = json_dir / f"{name}.json"
        if args.from_json or (name not in selected and args.keep_others):
            docs[name], problem = load_doc(name, path)
            if docs[name] is not None:
                runs.append(RunRecord(name, "earlier run", detail=f"from {path}"))
            else:
                runs.append(RunRecord(name, "failed" if path.exists() else "absent", detail=problem))
            continue
        if name not in selected:
            runs.append(RunRecord(name, "absent", detail="not selected (--only)"))
            continue
        extra = shlex.split(getattr(args, f"{name}_args", ""))
        rec = run_benchmark(name, path, quick=args.quick, timeout=timeout, extra=extra)
        runs.append(rec)
        docs[name], problem = load_doc(name, path)
        if rec.status == "ok" and docs[name] is None:
            rec.status, rec.detail = "failed", problem
        elif rec.status != "ok" and docs[name] is not None:
            # a benchmark that writes as it goes (rendezvous.py) leaves partial results: shown as such
            rec.status, rec.detail = f"partial ({rec.status})", rec.detail + "; partial results shown"
    for rec in runs:
        if rec.status == "failed":
            print(f"report: {rec.name}: {rec.detail}", file=sys.stderr)
    command = shown_command([sys.executable, *sys.argv])
    machine = None
    if any(r.command for r in runs):  # something ran here
        sys.path.insert(0, str(HERE))
        from harness import machine_info

        machine = machine_info()
    text = render(docs, runs, command=command, machine=machine)
    old = out.read_text(encoding="utf-8") if out.exists() else ""
    if (at := old.find("\n" + KEPT)) >= 0:
        text += old[at:]
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    for d in docs.values():
        for t in d["targets"] if d else []:
            print(f"  {t.get('status') or 'not measured':<13} {t['name']}: {t.get('figure', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
