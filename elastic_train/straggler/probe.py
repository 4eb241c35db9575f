"""An evicted node's health probe: a fixed piece of work, timed in a process of its own.

A node evicted as slow would otherwise find out whether it is still slow only by rejoining the job on
trial, where a node still slow costs every other node the detection time again (and two re-formations).
The probe lets it look first. The work is SHA-256 hashing on one CPU thread (``--device cpu``) or matrix
products on the node's CUDA device (``--device cuda``), timed in a child of the agent at a lowered CPU
priority (``nice`` 10): as a child of the agent it is held back by what holds the workers back (a
throttled device, a CPU quota, a noisy neighbour, a stop/continue cycle), and while the node trains it
yields the CPU to the workers.

The agent keeps the node's **healthy rates**, the best it measured of each device
(:class:`~elastic_train.rendezvous.slownodes.SlowNodes`): both devices at its start, before its workers use
them, and the CPU again while the node trains in the job (never the GPU there: the workers use it). When
the node is evicted, :func:`probe_verdict` reads its probes against them, device by device:

- At eviction a probe at least ``threshold`` times below a healthy rate sees what slows the node, and the
  node rejoins only once its probes are again within ``clear_below`` of every healthy rate (the detector's
  hysteresis: a probe between the two, as noisy as a node's probes are, keeps it out).
- Otherwise the probe does not see it (a slow link, a slow disk, or no healthy rate): the node rejoins on
  trial after each probation as without a probe; the job's detector stays the judge.

Run by hand (one JSON line: the rate, or ``null`` where the device is absent)::

    python -m elastic_train.straggler.probe --seconds 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from elastic_train.log import get_logger

log = get_logger(__name__)

#: Seconds of timed work in one probe (after a short warm-up); long against a stop/continue cycle.
PROBE_S = 1.0
#: Seconds the probe process may take, start-up (importing torch) included, before it counts as no answer.
PROBE_TIMEOUT = 60.0
#: The devices a probe can time.
DEVICES = ("cpu", "cuda")
#: The probe process's niceness: while the node trains, its workers come first.
NICE = 10


def run_probe(
    device: str = "cpu",
    seconds: float = PROBE_S,
    timeout: float = PROBE_TIMEOUT,
    stop: threading.Event | None = None,
) -> float | None:
    """This node's rate on ``device`` (units of work a second) in a child process; None when the device
    is absent or the probe did not answer (it failed, took longer than ``timeout``, or ``stop`` was set
    meanwhile: the child is then killed): no evidence either way."""
    cmd = [
        sys.executable,
        "-m",
        "elastic_train.straggler.probe",
        "--device",
        device,
        "--seconds",
        f"{seconds:g}",
    ]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        log.warning("straggler_probe_failed", error=str(exc))
        return None
    deadline = time.monotonic() + timeout
    while True:
        try:
            out, err = proc.communicate(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            if (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
                proc.kill()
                proc.communicate()
                if stop is None or not stop.is_set():
                    log.warning("straggler_probe_failed", error=f"no answer within {timeout:g} s")
                return None
    for line in reversed(out.splitlines()):
        try:
            answer = json.loads(line)
            rate = answer["rate"]
            if rate is None:
                return None  # the device is absent
            rate = float(rate)
        except (ValueError, KeyError, TypeError):
            continue
        return rate if rate > 0 else None
    log.warning("straggler_probe_failed", exit_code=proc.returncode, error=err.strip()[-300:])
    return None


def run_probes(devices: list[str], stop: threading.Event | None = None) -> dict[str, float | None]:
    """One probe of each of ``devices``, one after the other."""
    return {d: run_probe(d, stop=stop) for d in devices}


def rounded(rates: Mapping[str, float | None]) -> dict[str, float | None]:
    """``rates`` as events show them."""
    return {d: None if r is None else round(r, 2) for d, r in rates.items()}


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What a node's probe rates say about it."""

    verdict: Literal["slow", "healthy", "blind"]
    """``slow``: it waits and probes again; ``healthy``: it rejoins on trial now; ``blind``: the probe does
    not see what slows it (or no healthy rate is known): it rejoins after its probation, as without one."""
    rates: dict[str, float | None]
    healthy_rates: dict[str, float]
    ratio: float | None
    """How many times slower than in health the node is now, on its slowest device (of those with both)."""
    device: str | None
    """That device."""

    def fields(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "rates": rounded(self.rates),
            "healthy_rates": rounded(self.healthy_rates),
            "ratio": None if self.ratio is None else round(self.ratio, 3),
            "device": self.device,
        }


def probe_verdict(
    *,
    rates: Mapping[str, float | None],
    healthy_rates: Mapping[str, float],
    slow_at: float,
) -> ProbeVerdict:
    """Read a node's probe rates against its healthy rates, device by device: slow when one device is at
    least ``slow_at`` times below its healthy rate, healthy when every device measured is within it.

    Args:
        rates: this probe's rate per device (None: no answer).
        healthy_rates: the best rate per device this node measured in health.
        slow_at: that many times slower is slow: the detector's ``threshold`` at eviction, its
            ``clear_below`` on probation.
    """
    ratios = {d: healthy_rates[d] / r for d, r in rates.items() if r is not None and healthy_rates.get(d)}
    kept, healthy = dict(rates), dict(healthy_rates)
    if not ratios:
        return ProbeVerdict("blind", kept, healthy, None, None)
    device = max(ratios, key=lambda d: ratios[d])
    ratio = ratios[device]
    return ProbeVerdict("slow" if ratio >= slow_at else "healthy", kept, healthy, ratio, device)


def _work(device_name: str, seconds: float) -> dict[str, Any]:
    """Timed work on ``device_name`` for ``seconds`` after a warm-up; its count a second (``rate`` None when
    the device is absent). The CPU's is SHA-256 of 64 KiB blocks on one thread (no torch to import: the
    probe starts in a fraction of a second); the GPU's, 4096 x 4096 matrix products."""
    if device_name == "cpu":
        block = bytes(range(256)) * 256

        def burst() -> int:
            for _ in range(8):
                hashlib.sha256(block).digest()
            return 8

        size = len(block)
    else:
        import torch

        if not torch.cuda.is_available():
            return {"rate": None, "device": "cuda", "error": "no CUDA device"}
        size = 4096
        a = torch.randn(size, size, device="cuda")
        b = torch.randn(size, size, device="cuda")

        def burst() -> int:
            for _ in range(8):
                torch.mm(a, b)
            torch.cuda.synchronize()
            return 8

    warm = time.perf_counter() + min(0.2, seconds / 4)
    while time.perf_counter() < warm:
        burst()
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        done += burst()
    return {"rate": done / elapsed, "device": device_name, "size": size, "seconds": round(elapsed, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=PROBE_S, help="seconds of timed work")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="the device to time")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600:
        parser.error(f"--seconds {args.seconds:g} must be above 0 and at most 600")
    os.nice(NICE)
    print(json.dumps(_work(args.device, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
