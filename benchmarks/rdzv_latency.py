"""Recovery time versus network delay to the rendezvous service, and the etcd leader-kill figure.

``recovery``: real torchrun agents (``--nnodes=2:4 --nproc-per-node=1``, the tiny gloo DDP worker of
:mod:`bench_worker`) reach their rendezvous service through ``tests/netproxy.py``, a loopback TCP proxy that
delays each direction by 0, 25, 50 or 100 ms. Three nodes train, one is killed with SIGKILL (agent and
workers), and the sample is the time from the kill to the first step at world size 2. Configurations:

- ``etcd3``: ours, etcd v3 behind the proxy;
- ``etcd-v2-tuned``: torch's etcd-v2 backend (etcd's v2 API behind the proxy), last call 1 s, keep-alive
  1 s x 3;
- ``c10d-tuned``: torch's c10d backend, same tuning, with its TCPStore in a separate process behind the proxy
  (``is_host=false`` on every agent: the store is a remote service like etcd, and every node may be killed).

Only rendezvous traffic is delayed; the workers' gloo traffic and our per-round bootstrap store stay on
loopback.

``leader_kill``: ``etcd3`` against a 3-member etcd (endpoint list, no proxy); while three nodes train, the
etcd leader is killed with SIGKILL, and the sample is the time from the kill to the next committed training
step, with whether the workers were restarted for it.

    .venv/bin/python benchmarks/rdzv_latency.py --repeats 2 --json out.json

JSON (``--json FILE``, rewritten after every job; ``complete`` is false until the last one)::

    {"benchmark": "rdzv_latency", "schema": 1, "command", "machine", "loadavg_end", "started", "seconds",
     "complete", "settings": {delays_ms, repeats, cap, nnodes, step_interval},
     "configs": [{name, backend, rdzv_conf, description}],
     "recovery": {CONFIG: {DELAY_MS: {"samples": [{status, seconds, cap, detail, phases}], "summary"}}},
     "leader_kill": {"samples": [{status, seconds, restarted, world_after, detail}], "summary": {...}}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    CONFIGS,
    OURS,
    BackendConfig,
    Job,
    Outcome,
    format_ratio,
    machine_info,
    phases,
    speedup,
    summarize,
)

from elastic_train import procs
from elastic_train.etcd.server import EtcdCluster
from elastic_train.net import free_port

PROXY = str(Path(__file__).resolve().parent.parent / "tests" / "netproxy.py")
DELAYS_MS = (0, 25, 50, 100)
QUICK_DELAYS_MS = (0, 100)
CONFIG_NAMES = ("etcd3", "etcd-v2-tuned", "c10d-tuned")


def _helper(cmd: list[str], ready: str, timeout: float = 60.0) -> subprocess.Popen[str]:
    """Start a helper process and wait for a line starting with ``ready`` on its stdout."""
    proc = subprocess.Popen(
        procs.tied(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(ready):
            return proc
    procs.kill_tree(proc.pid)
    raise RuntimeError(f"{cmd[1:3]} did not start")


STORE_SERVER = (
    "import sys, time\n"
    "from datetime import timedelta\n"
    "from torch.distributed import TCPStore\n"
    "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, multi_tenant=True, wait_for_workers=False,\n"
    "             timeout=timedelta(seconds=600))\n"
    "print('ready', flush=True)\n"
    "time.sleep(1e9)\n"
)


class ProxiedJob(Job):
    """A :class:`Job` whose agents reach etcd (or the c10d store) through a latency proxy process."""

    def __init__(self, config: BackendConfig, delay_ms: float, **kw: Any) -> None:
        if config.backend == "c10d":
            config = dataclasses.replace(config, rdzv_conf={**config.rdzv_conf, "is_host": "false"})
        super().__init__(config, **kw)
        self.delay_ms = delay_ms
        self.proxy_port = free_port()
        self.helpers: list[subprocess.Popen[str]] = []

    def __enter__(self) -> ProxiedJob:
        super().__enter__()
        try:
            if self.config.endpoint_kind == "tcpstore":
                self.helpers.append(
                    _helper([sys.executable, "-c", STORE_SERVER, str(self.store_port)], "ready")
                )
                target = self.store_port
            else:
                target = self.etcd.client_port
            proxy = [sys.executable, PROXY, "--target", f"127.0.0.1:{target}"]
            proxy += ["--delay-ms", str(self.delay_ms), "--listen-port", str(self.proxy_port)]
            self.helpers.append(_helper(proxy, "ready"))
        except BaseException:
            self.close()
            raise
        return self

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.proxy_port}"

    def store_host(self) -> str | None:
        return None  # the store is the helper process: any node may be the victim

    def close(self) -> None:
        super().close()
        for p in self.helpers:
            procs.kill_tree(p.pid)
            p.wait(timeout=10)


class ClusterJob(Job):
    """A :class:`Job` of ``etcd3`` agents on a 3-member etcd (the endpoint list of all members)."""

    def __init__(self, config: BackendConfig, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.etcd.stop()  # the single member made by Job is never started; only its directory goes
        self.etcd = EtcdCluster(3)  # type: ignore[assignment]


def recovery_sample(job: Job, cap: float) -> dict[str, Any]:
    """Train at 3, kill -9 one node, time to the first step at world 2 (with where the time went)."""
    t0 = time.time()
    job.add_nodes(3)
    launch = job.wait_world(3, t0, cap)
    if launch.status != "ok":
        return Outcome("not_run", cap=cap, detail=f"launch: {launch.status}: {launch.detail}").to_json()
    job.wait_steps(3, 5, time.time(), cap)
    t_kill = job.kill_node(job.pick_victim())
    out = job.wait_world(2, t_kill, cap).to_json()
    out["phases"] = phases(job.reader.records, 2, t_kill)
    return out


def leader_kill_sample(job: ClusterJob, cap: float) -> dict[str, Any]:
    """Train at 3, kill the etcd leader, time to the next rank-0 step; were workers restarted?"""
    t0 = time.time()
    job.add_nodes(3)
    launch = job.wait_world(3, t0, cap)
    if launch.status != "ok":
        return {"status": "not_run", "detail": f"launch: {launch.status}: {launch.detail}"}
    job.wait_steps(3, 5, time.time(), cap)
    cluster: EtcdCluster = job.etcd  # type: ignore[assignment]
    leader = cluster.leader()
    t_kill = time.time()
    cluster.kill(leader)
    deadline = t_kill + cap
    first: float | None = None
    while time.time() < deadline:
        job.reader.poll()
        steps = [
            r
            for r in job.reader.records
            if r.get("event") == "step" and r.get("rank") == 0 and float(r["time"]) >= t_kill
        ]
        if steps and first is None:
            first = min(float(r["time"]) for r in steps)
        # keep watching a few seconds after the first step: a restart (lost leases) would show up then
        if first is not None and time.time() - t_kill > 10:
            break
        time.sleep(0.1)
    job.reader.poll()
    restarted = any(r.get("event") == "start" and float(r["time"]) >= t_kill for r in job.reader.records)
    worlds = sorted(
        {
            int(r["world_size"])
            for r in job.reader.records
            if r.get("event") == "step" and float(r["time"]) >= t_kill
        }
    )
    if first is None:
        return {"status": "timeout", "cap": cap, "restarted": restarted, "detail": job.diagnosis()}
    return {
        "status": "ok",
        "seconds": round(first - t_kill, 3),
        "cap": cap,
        "restarted": restarted,
        "worlds_after": worlds,
        "leader": leader,
    }


def _span(sm: dict[str, Any]) -> str:
    """``"1.705 (1.519-1.891), 2/2 ok"``, a censored figure as ``> cap``."""

    def fig(v: Any, censored: bool) -> str:
        return ("> " if censored else "") + (f"{v:.4g}" if isinstance(v, float) else str(v))

    med, lo, hi = (
        fig(sm["median"], sm["median_censored"]),
        fig(sm["min"], False),
        fig(sm["max"], sm["max_censored"]),
    )
    return f"{med} ({lo}-{hi}), {sm['ok']}/{sm['n']} ok"


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (its samples and summaries) with what the report shows: seconds per backend and delay with
    each baseline's ratio to etcd3 at that delay, and the leader-kill samples."""
    st = doc["settings"]
    cells = {
        name: {float(d): c["summary"] for d, c in per.items() if c.get("summary") and c["summary"]["n"]}
        for name, per in doc["recovery"].items()
    }
    delays = sorted({d for per in cells.values() for d in per})
    figures = []
    for name, per in cells.items():
        row: dict[str, Any] = {"backend": name}
        for d in delays:
            sm = per.get(d)
            ours = cells.get(OURS, {}).get(d)
            ratio = speedup(sm, ours) if sm and ours and name != OURS else None
            row[f"{d:g} ms"] = (
                "-"
                if sm is None
                else _span(sm) + (f"<br>etcd3 {format_ratio(ratio)} faster" if ratio else "")
            )
        figures.append(row)
    tables = []
    samples = doc["leader_kill"]["samples"]
    if samples:
        sm = doc["leader_kill"].get("summary") or summarize(samples)
        restarts = sum(1 for s in samples if s.get("restarted"))
        caption = (
            "**etcd leader killed** (etcd3, 3-member etcd, endpoint list of all members, no proxy; three "
            "nodes training): seconds from SIGKILL of the leader to the next committed training step, "
            f"median {sm['median']} s (min {sm['min']}, max {sm['max']}) over {sm['n']} kills; workers "
            f"restarted in {restarts} of them."
        )
        rows = [
            {"kill": i + 1, "status": s["status"], "seconds to next step": s.get("seconds"),
             "workers restarted": "yes" if s.get("restarted") else "no",
             "world sizes after": s.get("worlds_after")}
            for i, s in enumerate(samples)
        ]  # fmt: skip
        tables.append({"caption": caption, "rows": rows})
    return doc | {
        "title": "Recovery vs network latency",
        "description": (
            "Three torchrun agents (`--nnodes=2:4`) reach their rendezvous service through "
            "`tests/netproxy.py`, a loopback proxy that delays each direction by the one-way delay "
            "below; one node is killed with SIGKILL and the figure is the time to the first step at "
            f"world size 2 (median over {st['repeats']} repeats, min-max in brackets, cap "
            f"{st['cap']:g} s). c10d's TCPStore runs as a separate process behind the proxy "
            "(`is_host=false`), like etcd. Only rendezvous traffic is delayed; the workers' gloo "
            "traffic stays on loopback. The 0 ms column goes through the proxy too. Load average at "
            f"the start and end: {doc['machine']['loadavg']}, {doc.get('loadavg_end')} (a loaded "
            "machine slows the baselines most: their recovery restarts workers, which import torch "
            "again)."
        ),
        "figures": figures,
        "tables": tables,
        "targets": doc.get("targets", []),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write results here (rewritten after every job)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--leader-repeats", type=int, default=3)
    p.add_argument("--cap", type=float, default=60.0, help="seconds a sample may take")
    p.add_argument(
        "--delays", default=None, help="comma-separated one-way delays in ms (default 0,25,50,100)"
    )
    p.add_argument("--configs", default=",".join(CONFIG_NAMES))
    p.add_argument("--quick", action="store_true", help="one repeat, delays 0 and 100 ms, one leader kill")
    args = p.parse_args(argv)
    delays = (
        [float(d) for d in args.delays.split(",")]
        if args.delays
        else list(QUICK_DELAYS_MS if args.quick else DELAYS_MS)
    )
    repeats = 1 if args.quick else args.repeats
    leader_repeats = 1 if args.quick else args.leader_repeats
    configs = [CONFIGS[n] for n in args.configs.split(",")]
    started = time.time()
    doc: dict[str, Any] = {
        "benchmark": "rdzv_latency",
        "schema": 1,
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "complete": False,
        "settings": {
            "delays_ms": delays,
            "repeats": repeats,
            "leader_repeats": leader_repeats,
            "cap": args.cap,
            "nnodes": "2:4",
            "step_interval": 0.1,
        },
        "configs": [c.to_json() for c in configs],
        "recovery": {c.name: {f"{d:g}": {"samples": []} for d in delays} for c in configs},
        "leader_kill": {"samples": []},
    }

    def save() -> None:
        doc["seconds"] = round(time.time() - started, 1)
        doc["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        for per_delay in doc["recovery"].values():
            for cell in per_delay.values():
                cell["summary"] = summarize(cell["samples"])
        lk = doc["leader_kill"]
        lk["summary"] = summarize(lk["samples"])
        lk["restarts"] = sum(1 for s in lk["samples"] if s.get("restarted"))
        if args.json:
            Path(args.json).write_text(json.dumps(summary(doc), indent=1) + "\n", encoding="utf-8")

    for rep in range(repeats):
        for d in delays:
            for c in configs:
                with ProxiedJob(c, d) as job:
                    sample = recovery_sample(job, args.cap)
                doc["recovery"][c.name][f"{d:g}"]["samples"].append(sample)
                print(f"[{rep + 1}/{repeats}] {c.name} delay {d:g} ms: {sample}", flush=True)
                save()
    for rep in range(leader_repeats):
        with ClusterJob(CONFIGS["etcd3"]) as cjob:
            sample = leader_kill_sample(cjob, args.cap)
        doc["leader_kill"]["samples"].append(sample)
        print(f"[{rep + 1}/{leader_repeats}] leader kill: {sample}", flush=True)
        save()
    doc["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
