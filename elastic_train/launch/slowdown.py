"""The driver of a ``slow-node`` fault: holds the processes under a node's agent stopped (SIGSTOP) for
``1 - 1/factor`` of every period and continued (SIGCONT) for the rest, so that whatever runs on the node runs
``1/factor`` of the time, as on slow hardware; the agent itself is left alone (a slow node keeps its lease).

It runs as a process of its own (``elastic-train local`` starts one per slowed node), not as a thread of the
process that runs the job: there, each file a walk of ``/proc`` reads waits for the interpreter lock, which
the job's other threads hold, and a walk took 0.1-0.3 s on a busy machine, time in which the workers ran
free and the node was slowed far less than its factor. The cycle keeps to its clock: each hold lasts its
share of the period from the moment the SIGSTOPs went out, and each walk of the node's processes (to stop
one started since, such as a restarted worker or the agent's health probe, from its first period) starts as
long before the next hold as the last walk took.

    python -m elastic_train.launch.slowdown AGENT_PID --factor 2 --period 0.1 [--for SECONDS]

It ends after ``--for`` seconds, when the agent is gone, or on SIGTERM/SIGINT, with every process it held
continued, and prints one JSON line: ``pids`` (every process it held), ``stopped_s`` (the time they were
held; ``elastic-train local`` stops the driver while its node hangs, and a hang that began during a hold
counts toward it) and ``ended_s`` (the time it ran). While the agent itself is stopped (a hung node) it
holds and continues nothing: a hung node's processes stay stopped.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

import psutil

from elastic_train.procs import signal_all, tree


def agent_state(pid: int) -> str | None:
    """The agent's psutil status, or None once it is gone (a zombie counts as gone)."""
    try:
        status = str(psutil.Process(pid).status())
    except psutil.Error:
        return None
    return None if status == psutil.STATUS_ZOMBIE else status


def cycle(
    agent: int, factor: float, period: float, span: float | None, ending: threading.Event
) -> dict[str, Any]:
    """Slow the processes under ``agent`` until ``span`` seconds passed (None: for good), the agent is gone
    or ``ending`` is set. Returns the report (see the module docstring)."""
    if factor <= 1.0 or period <= 0.0:
        raise ValueError(f"factor {factor} must be > 1 and period {period} > 0")
    hold = period * (1.0 - 1.0 / factor)
    t0 = time.monotonic()
    pids: set[int] = set()
    held_s = 0.0
    walk_s = 0.0
    held: list[psutil.Process] = []
    continued: list[psutil.Process] = []  # the processes of the last hold
    try:
        while not ending.is_set() and (span is None or time.monotonic() - t0 < span):
            state = agent_state(agent)
            if state is None:
                break
            if state == psutil.STATUS_STOPPED:  # a hung node: nothing to slow
                # a hang that stopped the processes right before the last SIGCONT found the agent still
                # running: they are stopped again, as the rest of the hung node is
                signal_all(continued, signal.SIGSTOP)
                continued = []
                ending.wait(period)
                continue
            walked = time.monotonic()
            workers = tree(agent)[1:]
            walk_s = time.monotonic() - walked
            pids |= {p.pid for p in workers}
            stopped = time.monotonic()
            held = workers
            signal_all(held, signal.SIGSTOP)
            ending.wait(max(0.0, stopped + hold - time.monotonic()))
            if agent_state(agent) != psutil.STATUS_STOPPED:  # hung meanwhile: its processes stay held
                signal_all(held, signal.SIGCONT)
                continued = held
            held = []
            held_s += time.monotonic() - stopped
            # the next hold starts a period after this one (a late one is not made up), its walk before it
            ending.wait(max(0.0, stopped + period - walk_s - time.monotonic()))
    finally:
        if held and agent_state(agent) != psutil.STATUS_STOPPED:
            signal_all(held, signal.SIGCONT)
    return {"pids": sorted(pids), "stopped_s": round(held_s, 2), "ended_s": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.launch.slowdown", description=__doc__)
    parser.add_argument("agent", type=int, help="PID of the node's agent")
    parser.add_argument("--factor", type=float, required=True, help="slow-down factor (> 1)")
    parser.add_argument("--period", type=float, required=True, help="seconds of one stop/continue cycle")
    parser.add_argument(
        "--for", dest="span", type=float, default=None, help="seconds to slow (default: until ended)"
    )
    args = parser.parse_args(argv)
    ending = threading.Event()
    # the signals are taken by a thread of their own: a handler that set the event could run while the main
    # thread holds the event's lock (in its wait) and deadlock on it
    ends = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, ends)

    def take_signals() -> None:
        signal.sigwait(ends)
        ending.set()

    threading.Thread(target=take_signals, daemon=True).start()
    try:
        report = cycle(args.agent, args.factor, args.period, args.span, ending)
    except ValueError as e:
        print(f"slowdown: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
