"""Recovery time against state size: kill -9 of a node and a node joining, with where the time goes.

For each state size (default about 10 MB, 100 MB and 1 GB: the charlm task plus a frozen ballast
parameter, :mod:`recovery_task`) and each recovery path (``hot``: the default, survivors keep their worker
processes and the state they hold; ``restart``: ``rendezvous.hot=false``, every worker restarts and restores
from shared memory) one ``elastic-train local`` job runs 3 nodes of one worker each on loopback, kills node 1
(agent and worker, SIGKILL) and later adds a node. From the job's event stream and the nodes'
JSON logs each fault's time to training again is split into:

- ``detect``: the fault → the first surviving agent joining a new rendezvous round;
- ``rendezvous``: → the last agent holding its rank in the new round;
- ``worker start``: → the last worker ready to restore (process start, imports, process group, task);
- ``restore``: → the last worker done restoring (newest snapshot found, broadcast from its holder, loaded);
- ``first step``: → the first optimizer step of the new round completes.

The loopback TCP bandwidth is measured in the same run (two sockets, 256 MiB per repeat); the target is
restore <= 1.3 x (state bytes / that bandwidth) with one receiver from 100 MB on, and the state received at
>= 0.9 x that bandwidth, on each path. A size whose processes and snapshots would not fit in the free
memory is skipped with the reason.

    PYTHONPATH=. .venv/bin/python benchmarks/recovery.py --json recovery.json
    PYTHONPATH=. .venv/bin/python benchmarks/recovery.py --sizes 10 --quick
    PYTHONPATH=. .venv/bin/python benchmarks/recovery.py --sizes 1000 --paths hot --keep-logs /tmp/rec-logs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = 1.3
#: Received bytes per second over the loopback bandwidth, one receiver.
RATE_TARGET = 0.9
#: The targets hold from this state size on (below, the restore's fixed part dominates).
MIN_MB = 100.0
#: Bytes of memory one worker needs per byte of state: the model, three shared-memory slots and the snapshot
#: a new worker maps, with margin (a restored state lands in the model itself, without a buffer of its own).
MEMORY_FACTOR = 4.5
#: Memory left to the rest of the machine when deciding whether a size fits.
HEADROOM = 4 << 30
PHASES = ("detect", "rendezvous", "worker_start", "restore", "first_step")


def loopback_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Median bytes/s of one TCP stream over 127.0.0.1 (sender and receiver threads of this process)."""
    chunk = memoryview(bytearray(8 << 20))
    results = []
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]

            def send(port: int = port) -> None:
                with socket.create_connection(("127.0.0.1", port)) as s:
                    left = nbytes
                    while left:
                        n = min(left, len(chunk))
                        s.sendall(chunk[:n])
                        left -= n

            sender = threading.Thread(target=send)
            sender.start()
            conn, _ = server.accept()
            sink = memoryview(bytearray(8 << 20))
            t = time.perf_counter()
            got = 0
            with conn:
                while got < nbytes:
                    n = conn.recv_into(sink)
                    if not n:
                        break
                    got += n
            results.append(got / (time.perf_counter() - t))
            sender.join()
    return statistics.median(results)


def _ts(record: dict[str, Any]) -> float | None:
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def read_logs(workdir: Path) -> list[dict[str, Any]]:
    """Every JSON log line of every node (agents and workers), with ``t`` (unix seconds) and ``node_log``."""
    out = []
    for path in sorted(workdir.glob("node-*.log")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            t = _ts(rec)
            if t is not None:
                rec["t"], rec["node_log"] = t, path.stem
                out.append(rec)
    return out


def breakdown(
    fault: dict[str, Any], events: list[dict[str, Any]], logs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Phase durations of one fault (pure: from the summary's fault, the event stream and the logs)."""
    if fault.get("resumed_s") is None or fault.get("fired_round") is None:
        return {"error": "did not train again"}
    after = [e for e in events if e.get("event") == "step" and (e.get("round") or 0) > fault["fired_round"]]
    if not after:
        return {"error": "no step after the fault"}
    first = after[0]
    resumed_at, new_round = float(first["time"]), first["round"]
    if any(r.get("event") == "restore_nothing_found" and r.get("round") == new_round for r in logs):
        # it trained again, from step 0: the state was lost, not recovered (no recovery time to report)
        return {"error": "restored nothing: trained again from step 0"}
    fired_at = resumed_at - float(fault["resumed_s"])
    new_node = fault.get("extra", {}).get("new_node")
    joiner = f"node-{new_node}" if new_node is not None else None
    joins = [
        r["t"]
        for r in logs
        if r.get("event") == "rendezvous_join" and r["t"] >= fired_at and r["node_log"] != joiner
        and r.get("reason") != "start"
    ]  # fmt: skip
    # the round is complete on a node when its agent holds its rank: started workers (rendezvous_complete) or
    # workers kept on the hot path (hot_round)
    done = [
        r["t"]
        for r in logs
        if r.get("event") in ("rendezvous_complete", "hot_round") and r.get("round") == new_round
    ]
    ready = [r for r in logs if r.get("event") == "worker_ready" and r.get("round") == new_round]
    restored = [r for r in logs if r.get("event") == "restored" and r.get("round") == new_round]
    if not (joins and done and ready):
        return {"error": "log events missing"}
    detected, rdzv_done = min(joins), max(done)
    restore_start = max(r["t"] - float(r.get("restore_s", 0.0)) for r in ready)
    restore_end = max(r["t"] for r in ready)
    marks = [fired_at, detected, rdzv_done, restore_start, restore_end, resumed_at]
    out: dict[str, Any] = {p: round(b - a, 3) for p, a, b in zip(PHASES, marks, marks[1:], strict=False)}
    out["total"] = round(resumed_at - fired_at, 3)
    out["restore_max_s"] = max(float(r.get("restore_s", 0.0)) for r in ready)
    out["world_size"] = first.get("world_size")
    out["source"] = fault.get("source")
    out["state_bytes"] = max((int(r.get("bytes", 0)) for r in restored), default=None)
    # Inside the restore: finding the newest snapshot (and agreeing on it), the broadcast, the rest (loading
    # the state into model and optimizer), as the slowest rank logged them.
    for key in ("find_s", "broadcast_s"):
        out[key] = max((float(r[key]) for r in restored if key in r), default=None)
    # Ranks the state was sent to: the joiner, and a survivor whose newest snapshot is a step behind (its
    # worker was stopped before it sealed the step the other survivor did).
    out["receivers"] = max((int(r["receivers"]) for r in restored if "receivers" in r), default=None)
    return out


def run_size(mb: float, args: argparse.Namespace, work: Path, path: str) -> dict[str, Any]:
    """One job at ``mb`` MiB of ballast on recovery ``path`` (``hot``, ``restart``): kill node 1, then add a
    node; the two faults' breakdowns."""
    workdir = work / f"state-{mb:g}MB-{path}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    kill_at, add_at = args.kill_step, args.kill_step + args.gap_steps
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--task", "recovery_task:build",
        "--set", f"train.task_args.ballast_mb={mb}",
        # hot: survivors keep their processes and hash the state they hold in place, a joiner receives it;
        # restart: every worker starts anew and lands its own snapshot, or receives it from a holder
        "--set", f"rendezvous.hot={'true' if path == 'hot' else 'false'}",
        "--nodes", "3", "--min-nodes", "1", "--max-nodes", "4",
        "--steps", str(add_at + args.tail_steps),
        "--kill-node", f"1@step={kill_at}",
        "--add-node", f"@step={add_at}",
        "--checkpoint", str(workdir / "ckpt"), "--checkpoint-every", "0",
        "--workdir", str(workdir), "--summary", str(workdir / "summary.json"),
        "--timeout", str(args.timeout),
    ]  # fmt: skip
    print(f"== {mb:g} MB, {path}: {' '.join(cmd[2:])}", flush=True)
    t = time.time()
    proc = subprocess.run(
        cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout + 120
    )
    took = time.time() - t
    summary_path = workdir / "summary.json"
    if not summary_path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"state_mb": mb, "path": path, "error": f"exit {proc.returncode}: {' | '.join(tail)[:300]}"}
    if args.keep_logs:  # the job's logs, events and summary (not its checkpoints, snapshots or etcd data)
        shutil.copytree(
            workdir, Path(args.keep_logs) / workdir.name, ignore=shutil.ignore_patterns("ckpt", "etcd"),
            dirs_exist_ok=True,
        )  # fmt: skip
    summary = json.loads(summary_path.read_text())
    from elastic_train.train.events import read_events

    events = read_events(str(workdir / "events.jsonl"))
    logs = read_logs(workdir)
    faults = {f["kind"]: breakdown(f, events, logs) for f in summary.get("faults", [])}
    print(
        f"   {took:.0f} s, {'ok' if summary.get('succeeded') else 'FAILED'}: {json.dumps(faults)}", flush=True
    )
    return {
        "state_mb": mb,
        "path": path,
        "succeeded": summary.get("succeeded"),
        "faults": faults,
        "seconds": round(took, 1),
    }


#: How a path is named in the targets' names.
PATH_NAMES = {"hot": "hot recovery (the default)", "restart": "restart path"}


def targets(runs: list[dict[str, Any]], bandwidth: float) -> list[dict[str, Any]]:
    """The restore targets, per recovery path measured (a run without ``path`` is a restart-path run): with
    one receiver and at least :data:`MIN_MB` of state, the whole restore (find and verify the newest
    snapshot, receive, load into model and optimizer) within :data:`TARGET` x state bytes / loopback
    bandwidth, and the state received at >= :data:`RATE_TARGET` x that bandwidth. A rank that holds the
    chosen step lands its own snapshot (or, on the hot path, hashes the state it holds in place), so after a
    kill nothing is sent (reported, not a receive); the joiner of the join is the one receiver. Other sizes
    are reported."""
    paths = sorted({r.get("path", "restart") for r in runs}) or [""]
    out: list[dict[str, Any]] = []
    for path in paths:
        out += _path_targets([r for r in runs if r.get("path", "restart") == path], bandwidth, path)
    return out


def _path_targets(runs: list[dict[str, Any]], bandwidth: float, path: str) -> list[dict[str, Any]]:
    suffix = f", {PATH_NAMES.get(path, path)}" if path else ""
    name = f"restore vs state size / loopback bandwidth, one receiver{suffix}"
    rate_name = f"receive rate of the restored state, one receiver{suffix}"
    rows, rates, others = [], [], []
    for r in runs:
        for kind, b in (r.get("faults") or {}).items():
            if not b.get("state_bytes") or b.get("restore") is None:
                continue
            ideal = b["state_bytes"] / bandwidth
            ratio = b["restore"] / ideal
            text = f"{r['state_mb']:g} MB {kind}: {b['restore']:.2f} s = {ratio:.2f}x"
            if not b.get("broadcast_s"):
                text += " (own snapshots, nothing sent)"
            elif (b.get("receivers") or 1) > 1:
                text += f" ({b['receivers']} receivers: a survivor was a step behind)"
            if b.get("broadcast_s") and r["state_mb"] >= MIN_MB:
                rows.append((ratio, text))
                rate = b["state_bytes"] / b["broadcast_s"] / bandwidth
                rates.append((rate, f"{r['state_mb']:g} MB: {rate:.2f}x ({b['broadcast_s']:.2f} s)"))
            else:
                others.append(text)
    threshold = f"<= {TARGET}x, >= {MIN_MB:g} MB (loopback {bandwidth / 1e6:.0f} MB/s)"
    return [
        {
            "name": name,
            "threshold": threshold,
            "figure": ", ".join(t for _, t in rows) or "not measured",
            "status": ("met" if max(x for x, _ in rows) <= TARGET else "missed") if rows else "not measured",
            "why": ("also measured: " + ", ".join(others)) if others else "",
        },
        {
            "name": rate_name,
            "threshold": f">= {RATE_TARGET}x loopback bandwidth, >= {MIN_MB:g} MB",
            "figure": ", ".join(t for _, t in rates) or "not measured",
            "status": ("met" if min(x for x, _ in rates) >= RATE_TARGET else "missed")
            if rates
            else "not measured",
            "why": "bytes / (decision agreed -> every byte landed in its tensor)",
        },
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000", help="ballast sizes in MiB, comma-separated")
    p.add_argument("--kill-step", type=int, default=20, help="kill node 1 after this step")
    p.add_argument("--gap-steps", type=int, default=20, help="steps between the kill and the join")
    p.add_argument("--tail-steps", type=int, default=800, help="steps after the join (it takes seconds)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="10 MB only")
    p.add_argument("--paths", default="hot,restart", help="recovery paths, comma-separated: hot, restart")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--keep-logs", metavar="DIR", help="copy each job's logs, events and summary here")
    args = p.parse_args(argv)
    sizes = [10.0] if args.quick else [float(s) for s in args.sizes.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or any(x not in PATH_NAMES for x in paths):
        p.error(f"--paths: a comma-separated list of {', '.join(PATH_NAMES)}")
    load_start = os.getloadavg()
    bandwidth = loopback_bandwidth()
    print(f"loopback TCP: {bandwidth / 1e6:.0f} MB/s", flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="et-recovery-") as tmp:
        for mb in sizes:
            for path in paths:
                need = 3 * MEMORY_FACTOR * mb * (1 << 20) + HEADROOM
                free = min(psutil.virtual_memory().available, psutil.disk_usage("/dev/shm").free)
                if need > free:
                    why = (
                        f"skipped: needs about {need / 2**30:.1f} GiB of memory ({HEADROOM >> 30} GiB left "
                        f"to the rest of the machine), {free / 2**30:.1f} GiB free"
                    )
                    print(f"== {mb:g} MB, {path}: {why}", flush=True)
                    runs.append({"state_mb": mb, "path": path, "error": why})
                    continue
                runs.append(run_size(mb, args, Path(tmp), path))
    figures = []
    for r in runs:
        for kind, b in (r.get("faults") or {}).items():
            row: dict[str, Any] = {"state MB": r["state_mb"], "path": r.get("path"), "fault": kind}
            if "error" in b:
                row["error"] = b["error"]
            else:
                row.update({p: b[p] for p in PHASES})
                row["total s"] = b["total"]
                row["world"] = b["world_size"]
                row["source"] = b["source"]
                ideal = (b["state_bytes"] or 0) / bandwidth
                row["state / bandwidth s"] = ideal
                row["restore / ideal"] = b["restore"] / ideal if ideal else None
                row["of which find s"] = b.get("find_s")
                row["of which broadcast s"] = b.get("broadcast_s")
                row["receivers"] = b.get("receivers")
            figures.append(row)
        if "error" in r:
            figures.append({"state MB": r["state_mb"], "path": r.get("path"), "error": r["error"]})
    if args.json:
        doc = {
            "benchmark": "recovery",
            "title": "Recovery against state size",
            "description": (
                "3 nodes x 1 worker on loopback (charlm + frozen ballast, memory tier every step): "
                "kill -9 of node 1, then a 4th node joins, on each recovery path (hot: the default, "
                "survivors keep their processes; restart: rendezvous.hot=false). Seconds per phase (see "
                "benchmarks/recovery.py); "
                f"loopback TCP {bandwidth / 1e6:.0f} MB/s measured in this run; load average at start "
                f"{list(load_start)}, at end {list(os.getloadavg())}."
            ),
            "loopback_bytes_per_s": bandwidth,
            "runs": runs,
            "figures": figures,
            "targets": targets(runs, bandwidth),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
