"""Lightning under faults: ElasticStrategy against plain Lightning + DistributedSampler, paired in one run.

Both variants train examples/lightning_train.py's model and data (benchmarks/lightning_worker.py) as
``elastic-train local --entry`` jobs of 3 nodes x 1 worker on loopback with the same fault plan: kill -9 of
node 1 at step ``--kill-step``, a node joining at ``--join-step``, every step slowed by ``--delay`` s so the
faults land while it trains.

- ``elastic``: ``ElasticStrategy``, the fork server preloading Lightning
  (``--preload elastic_train.lightning``), global batch ``G``;
- ``plain``: ``strategy="ddp"`` with ``num_nodes`` from torchrun's environment, Lightning's
  ``DistributedSampler`` with a per-rank batch of ``G / 3`` (so ``G`` at the starting world size),
  ``ModelCheckpoint`` writing last.ckpt every 10 steps and ``ckpt_path="last"``. It runs under the same fork
  server (torch preloaded, Lightning not): a plain torchrun start would add torch's import to each restart.

Measured per fault: seconds from the fault (kill; the joining node's start) to the first step of the new
round (``elastic-train local``'s summary), steps redone; per run, from the audit lines (one per step and
rank with the indices trained), samples never trained and trained twice over the run's surviving
trajectory (for every step, the last round that trained it), against ``epochs x dataset`` expected.

    PYTHONPATH=. .venv/bin/python benchmarks/lightning.py --json lightning.json
    PYTHONPATH=. .venv/bin/python benchmarks/lightning.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from entry_faults import HERE, add_fault_args, figures, report, run_pairs, run_variant, targets

WORKER = HERE / "lightning_worker.py"
WHY_MISSED = "see the lightning section (machine load)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--samples", type=int, default=240, help="dataset size")
    p.add_argument("--global-batch", type=int, default=24, help="G (plain: G / 3 per rank)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs")
    p.add_argument("--quick", action="store_true", help="one pair (the default)")
    add_fault_args(p, kill_step=10, join_step=20)
    args = p.parse_args(argv)
    if args.global_batch % 3:
        p.error("--global-batch: must be a multiple of 3 (the plain variant's per-rank batch is G / 3)")

    def entry(kind: str, workdir: Path, audit: Path) -> list[str]:
        batch = args.global_batch if kind == "elastic" else args.global_batch // 3
        return [
            str(WORKER), kind, str(args.delay), *([str(audit)] if kind == "plain" else []),
            "--float64", "--epochs", str(args.epochs), "--samples", str(args.samples),
            "--batch-size", str(batch), "--checkpoint", str(workdir / "ck"), "--root", str(workdir / "pl"),
        ]  # fmt: skip

    def run(kind: str, work: Path) -> dict:
        return run_variant(kind, args, work, entry, preload="elastic_train.lightning", env={})

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="et-lightning-") as scratch:
        runs = run_pairs(args, Path(args.keep or scratch), 1 if args.quick else args.repeats, run)
    load_end = os.getloadavg()
    report(runs, "Lightning", WHY_MISSED)
    if args.json:
        doc = {
            "benchmark": "lightning",
            "title": "PyTorch Lightning under a kill and a join",
            "description": (
                f"3 nodes x 1 worker on loopback (examples/lightning_train.py's model, float64, "
                f"{args.samples} samples x {args.epochs} epochs, global batch {args.global_batch}, "
                f"+{args.delay} s per step): kill -9 of node 1 after step {args.kill_step}, a node joins "
                f"after step {args.join_step}; elastic = ElasticStrategy under `local --preload "
                "elastic_train.lightning --entry`, plain = strategy='ddp' + DistributedSampler + last.ckpt "
                "every 10 steps under the same harness (fork server, Lightning not preloaded). Load average "
                f"at start {[round(x, 2) for x in load_start]}, at end {[round(x, 2) for x in load_end]} "
                f"on {os.cpu_count()} cores."
            ),
            "loadavg": [list(load_start), list(load_end)],
            "runs": runs,
            "figures": figures(runs),
            "targets": targets(runs, "Lightning", WHY_MISSED),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
