"""An evicted node's health probe: a fixed piece of work, timed in a process of its own.

A node evicted as slow would otherwise find out whether it is still slow only by rejoining the job on
trial, where a node still slow costs every other node the detection time again (and two re-formations).
The probe lets it look first: the agent runs :func:`run_probe` once its workers have trained a while in
the job (the node's **healthy rate**, the best it measured), again when it is evicted, and during its
probation. :func:`probe_verdict` reads the rates:

- At eviction the probe is at least ``threshold`` times slower than the healthy rate: the probe sees what
  slows the node (a throttled device, a CPU shared with a noisy neighbour, processes held stopped), and
  the node rejoins only once a probe is again within ``threshold`` of the healthy rate.
- Otherwise the probe does not see it (a slow link, a slow disk, or no healthy rate was measured): the node
  rejoins on trial after each probation as without a probe; the job's detector stays the judge.

The work is matrix products on the node's device: CUDA when the probe process sees one (the node's workers
are stopped while it is on probation, so the device is its own), else one CPU thread. It runs in a child of
the agent, as the workers do, so what holds the workers back (a cgroup's CPU quota, a stop/continue cycle)
holds it back too. Run by hand::

    python -m elastic_train.straggler.probe --seconds 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

from elastic_train.log import get_logger

log = get_logger(__name__)

#: Seconds of timed work in one probe (after a short warm-up); long against a stop/continue cycle.
PROBE_S = 1.0
#: Seconds the probe process may take, start-up (importing torch) included, before it counts as no answer.
PROBE_TIMEOUT = 60.0


def run_probe(seconds: float = PROBE_S, timeout: float = PROBE_TIMEOUT) -> float | None:
    """This node's rate (matrix products a second) in a child process; None when the probe did not answer
    (it failed, or took longer than ``timeout``): no evidence either way."""
    cmd = [sys.executable, "-m", "elastic_train.straggler.probe", "--seconds", f"{seconds:g}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("straggler_probe_failed", error=str(exc))
        return None
    for line in reversed(out.stdout.splitlines()):
        try:
            rate = float(json.loads(line)["rate"])
        except (ValueError, KeyError, TypeError):
            continue
        return rate if rate > 0 else None
    log.warning("straggler_probe_failed", exit_code=out.returncode, error=out.stderr.strip()[-300:])
    return None


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What a probe rate says about an evicted node."""

    verdict: Literal["slow", "healthy", "blind"]
    """``slow``: it waits and probes again; ``healthy``: it rejoins on trial now; ``blind``: the probe does
    not see what slows it (or no healthy rate is known): it rejoins after its probation, as without one."""
    rate: float | None
    healthy_rate: float | None
    ratio: float | None
    """The healthy rate over this one (how many times slower the node is now)."""

    def fields(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "rate": None if self.rate is None else round(self.rate, 2),
            "healthy_rate": None if self.healthy_rate is None else round(self.healthy_rate, 2),
            "ratio": None if self.ratio is None else round(self.ratio, 3),
        }


def probe_verdict(
    *, rate: float | None, healthy_rate: float | None, threshold: float, sees: bool
) -> ProbeVerdict:
    """Read a probe rate against the node's healthy rate.

    Args:
        rate: this probe's rate (None: it did not answer).
        healthy_rate: the best rate this node measured while it trained in the job (None: none measured).
        threshold: the detector's ``threshold``: that many times slower is slow.
        sees: whether the probe at eviction found the node slow (it sees the cause); for the probe at
            eviction itself, pass True.
    """
    if rate is None or healthy_rate is None or not sees:
        return ProbeVerdict("blind", rate, healthy_rate, None)
    ratio = healthy_rate / rate
    return ProbeVerdict("slow" if ratio >= threshold else "healthy", rate, healthy_rate, ratio)


def _work(seconds: float) -> dict[str, Any]:
    """Matrix products for ``seconds`` after a warm-up; their count a second."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        device, n, batch = torch.device("cuda"), 4096, 8
    else:
        torch.set_num_threads(1)
        device, n, batch = torch.device("cpu"), 128, 4
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def burst() -> None:
        for _ in range(batch):
            torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize()

    warm = time.perf_counter() + min(0.2, seconds / 4)
    while time.perf_counter() < warm:
        burst()
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        burst()
        done += batch
    return {"rate": done / elapsed, "device": str(device), "size": n, "seconds": round(elapsed, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=PROBE_S, help="seconds of timed work")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600:
        parser.error(f"--seconds {args.seconds:g} must be above 0 and at most 600")
    print(json.dumps(_work(args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
