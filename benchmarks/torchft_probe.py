"""torchft on the work of ``hot.py``: 3 replica groups (1 process each) on gloo on loopback, kill -9 of one,
then a new replica group joining; run with an interpreter that has ``torchft-nightly`` (not a dependency of
this project):

    /work/torchft-venv/bin/python benchmarks/torchft_probe.py --json torchft.json

torchft keeps the survivors' processes: a failed all-reduce marks the step as not committed, the next quorum
leaves the dead replica out (after the lighthouse's join timeout), the process group is re-configured in the
same processes, and a joiner fetches the state from a peer. Figures:

- ``kill_s``: the kill -> the first step the survivors commit with 2 participants;
- ``join_s``: the joiner's model built -> the first step committed with 3 participants;
- ``join_start_s``: the joiner's process start -> the same step (its interpreter, torch import, model).

Each replica appends one JSON line per step to ``WORKDIR/replica-N.jsonl`` (time, committed step,
participants); the parent reads them. Loopback only; no fixed ports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPLICAS = 3


def replica(index: int, lighthouse: str, workdir: Path, steps: int, pg_timeout: float) -> None:
    """One replica group of one process: the same kind of tiny model as ``hot.py``'s built-in loop."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    out = open(workdir / f"replica-{index}.jsonl", "a", buffering=1)  # noqa: SIM115
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 1),
    )
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(index)
    out.write(json.dumps({"event": "model_built", "time": time.time()}) + "\n")

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout)),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica-{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
        init_sync=False,
    )
    ddp = DistributedDataParallel(manager, model)
    while manager.current_step() < steps and not (workdir / "stop").exists():
        x = torch.randn(16, 8, generator=gen)
        manager.start_quorum()  # what torchft's OptimizerWrapper.zero_grad does
        inner.zero_grad()
        loss = ((ddp(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        loss.backward()
        committed = manager.should_commit()  # what its OptimizerWrapper.step does
        if committed:
            inner.step()
        record = {
            "time": time.time(),
            "step": manager.current_step(),
            "participants": manager.num_participants(),
            "committed": committed,
        }
        out.write(json.dumps(record) + "\n")
    manager.shutdown(wait=False)


def read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def kill_figure(survivors: list[list[dict[str, Any]]], killed_at: float, step_at_kill: int) -> float | None:
    """Seconds from the kill to the first step a survivor committed with 2 participants after it."""
    times = [
        r["time"]
        for lines in survivors
        for r in lines
        if "step" in r and r["time"] > killed_at and r["step"] > step_at_kill and r.get("participants") == 2
    ]
    return min(times) - killed_at if times else None


def join_figure(
    joiner: list[dict[str, Any]], everyone: list[list[dict[str, Any]]], since: float | None = None
) -> float | None:
    """Seconds from the joiner's model built (or from ``since``: its process start) to the first step
    committed with 3 participants."""
    built = [r["time"] for r in joiner if r.get("event") == "model_built"]
    if not built:
        return None
    if since is not None:
        built = [since]
    times = [
        r["time"]
        for lines in everyone
        for r in lines
        if "step" in r
        and r["time"] > built[0]
        and r.get("participants") == 3
        and r.get("committed") is not False
    ]
    return min(times) - built[0] if times else None


def wait_for(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def steps_of(path: Path) -> int:
    lines = [r for r in read_lines(path) if "step" in r]
    return int(lines[-1]["step"]) if lines else 0


def one_run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    workdir.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    addr = lighthouse.address()
    procs: list[subprocess.Popen[bytes]] = []

    def start(index: int) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            __file__,
            "--replica",
            str(index),
            "--lighthouse",
            addr,
            "--workdir",
            str(workdir),
            "--pg-timeout-s",
            str(args.pg_timeout_s),
        ]
        log = open(workdir / f"replica-{index}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    result: dict[str, Any] = {}
    try:
        for i in range(REPLICAS):
            start(i)
        paths = [workdir / f"replica-{i}.jsonl" for i in range(REPLICAS + 1)]
        if not wait_for(lambda: all(steps_of(p) >= args.kill_step for p in paths[:REPLICAS]), args.timeout):
            return {"error": f"replicas did not reach step {args.kill_step} within {args.timeout:.0f} s"}
        step_at_kill = max(steps_of(p) for p in paths[:REPLICAS])
        killed_at = time.time()
        os.kill(procs[REPLICAS - 1].pid, signal.SIGKILL)
        survivors = paths[: REPLICAS - 1]
        wait_for(lambda: kill_figure([read_lines(p) for p in survivors], killed_at, step_at_kill), 60)
        result["kill_s"] = kill_figure([read_lines(p) for p in survivors], killed_at, step_at_kill)
        time.sleep(1.0)
        started_at = time.time()
        start(REPLICAS)
        joined = [*survivors, paths[REPLICAS]]
        wait_for(
            lambda: join_figure(read_lines(paths[REPLICAS]), [read_lines(p) for p in joined]), args.timeout
        )
        result["join_s"] = join_figure(read_lines(paths[REPLICAS]), [read_lines(p) for p in joined])
        result["join_start_s"] = join_figure(
            read_lines(paths[REPLICAS]), [read_lines(p) for p in joined], started_at
        )
    finally:
        (workdir / "stop").touch()
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        lighthouse.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="torchft-probe", help="replicas' step lines and logs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one repeat")
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--steps", type=int, default=100000, help="a replica's last step (it stops when told)")
    p.add_argument("--join-timeout-ms", type=int, default=100, help="the lighthouse's join timeout")
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, help="the lighthouse's heartbeat timeout (default: torchft's)"
    )
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=5.0,
        help="torchft's gloo collective timeout: a survivor whose all-reduce gets no error from the dead "
        "peer's socket fails the step only after it",
    )
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.replica is not None:
        replica(args.replica, args.lighthouse, Path(args.workdir), args.steps, args.pg_timeout_s)
        return 0
    import torch
    import torchft  # noqa: F401  (fails here, with its reason, when torchft is missing)

    runs = []
    for i in range(1 if args.quick else args.repeats):
        runs.append(one_run(Path(args.workdir) / f"run-{i}", args))
        print(json.dumps(runs[-1]), flush=True)
    kills = [r["kill_s"] for r in runs if r.get("kill_s") is not None]
    joins = [r["join_s"] for r in runs if r.get("join_s") is not None]
    starts = [r["join_start_s"] for r in runs if r.get("join_start_s") is not None]
    from importlib.metadata import version

    doc = {
        "torchft": version("torchft-nightly"),
        "torch": torch.__version__,
        "kill_s": statistics.median(kills) if kills else None,
        "join_s": statistics.median(joins) if joins else None,
        "join_start_s": statistics.median(starts) if starts else None,
        "join_timeout_ms": args.join_timeout_ms,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "pg_timeout_s": args.pg_timeout_s,
        "runs": runs,
        "loadavg": list(os.getloadavg()),
    }
    print(json.dumps(doc), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
