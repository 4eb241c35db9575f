"""Hugging Face Trainer under faults: ElasticTrainer against a plain Trainer, paired in one run.

Both variants train examples/hf_train.py's model and data (benchmarks/hf_probe.py) as
``elastic-train local --entry`` jobs of 3 nodes x 1 worker on loopback with the same fault plan: kill -9 of
node 1 after step ``--kill-step``, a node joining after step ``--join-step``, every step slowed by
``--delay`` s so the faults land while it trains.

- ``elastic``: ``ElasticTrainer``, the fork server preloading transformers (``--preload elastic_train.hf``),
  global batch ``G``;
- ``plain``: ``transformers.Trainer`` with a per-device batch of ``G / 3`` (so ``G`` at the starting world
  size), its ``save_steps`` checkpoints every ``--save-steps`` steps and
  ``train(resume_from_checkpoint=get_last_checkpoint(...))``. It runs under the same fork server (torch
  preloaded, transformers not): a plain torchrun start would add torch's import to each restart.

Measured per fault: seconds from the fault (kill; the joining node's start) to the first step of the new
round (``elastic-train local``'s summary), seconds the job went without a step around it, steps redone; per
run, from the audit lines (one per step and rank with the indices trained), samples never trained and trained
twice over the run's surviving trajectory (for every step, the last round that trained it), per epoch,
against ``epochs x dataset`` expected. Prints a table and writes JSON.

    python benchmarks/hf.py --json docs/benchmarks/hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from entry_faults import HERE, add_fault_args, figures, report, run_pairs, run_variant, targets

PROBE = HERE / "hf_probe.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--samples", type=int, default=256, help="dataset size")
    p.add_argument("--global-batch", type=int, default=24, help="G (plain: G / 3 per device)")
    p.add_argument("--save-steps", type=int, default=10, help="the Trainer's own checkpoint every N steps")
    add_fault_args(p, kill_step=15, join_step=30)
    args = p.parse_args(argv)
    if args.global_batch % 3:
        p.error("--global-batch: must be a multiple of 3 (the plain variant's per-device batch is G / 3)")

    def entry(kind: str, workdir: Path, audit: Path) -> list[str]:
        return [
            str(PROBE), kind, str(args.delay), *([str(audit)] if kind == "plain" else []),
            "--epochs", str(args.epochs), "--samples", str(args.samples),
            "--global-batch", str(args.global_batch), "--batch-size", str(args.global_batch // 3),
            "--save-steps", str(args.save_steps), "--output-dir", str(workdir / "out"),
        ]  # fmt: skip

    def run(kind: str, work: Path) -> dict:
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        return run_variant(kind, args, work, entry, preload="elastic_train.hf", env=env)

    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="et-hf-") as scratch:
        runs = run_pairs(args, Path(args.keep or scratch), 1, run)
    load_end = os.getloadavg()
    report(runs, "HF Trainer")
    if args.json:
        doc = {
            "benchmark": "hf",
            "started": started,
            "description": (
                f"3 nodes x 1 worker on loopback (examples/hf_train.py's GPT-2, {args.samples} sequences x "
                f"{args.epochs} epochs, global batch {args.global_batch}, +{args.delay} s per step): kill -9 "
                f"of node 1 after step {args.kill_step}, a node joins after step {args.join_step}; elastic = "
                "ElasticTrainer under `local --preload elastic_train.hf --entry`, plain = "
                f"transformers.Trainer with save_steps={args.save_steps} and resume_from_checkpoint under "
                "the same harness (fork server, transformers not preloaded). Load average at start "
                f"{[round(x, 2) for x in load_start]}, at end {[round(x, 2) for x in load_end]} on "
                f"{os.cpu_count()} cores."
            ),
            "loadavg": [list(load_start), list(load_end)],
            "runs": runs,
            "figures": figures(runs),
            "targets": targets(runs, "HF Trainer"),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
