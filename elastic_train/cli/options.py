"""Command-line options shared by ``run`` and ``local``, mapped onto dotted config keys."""

from __future__ import annotations

import argparse
from typing import Any

from elastic_train.config import parse_override
from elastic_train.errors import ConfigError

#: option dest → config key it overrides
OPTION_KEYS: dict[str, str] = {
    "endpoint": "rendezvous.endpoint",
    "run_id": "rendezvous.run_id",
    "nproc_per_node": "rendezvous.nproc_per_node",
    "checkpoint": "checkpoint.url",
    "checkpoint_every": "checkpoint.every_steps",
    "resume_from": "checkpoint.resume_from",
    "audit": "train.audit_dir",
    "steps": "train.steps",
    "task": "train.task",
    "seed": "train.seed",
}


def add_job_options(p: argparse.ArgumentParser, *, endpoint: bool = True) -> None:
    """Options that override job.yaml keys (validated by the same strict loader)."""
    if endpoint:
        p.add_argument("--endpoint", help="etcd HOST:PORT[,HOST:PORT] (rendezvous.endpoint)")
    p.add_argument("--run-id", help="job identity shared by all nodes (rendezvous.run_id)")
    p.add_argument("--nproc-per-node", type=int, help="workers per node (rendezvous.nproc_per_node)")
    p.add_argument("--checkpoint", metavar="URL", help="checkpoint root, any fsspec URL (checkpoint.url)")
    p.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="durable checkpoint cadence")
    p.add_argument("--resume-from", metavar="URL", help="start from this checkpoint (run root or step dir)")
    p.add_argument("--audit", metavar="DIR", help="write per-step sample indices of every rank here")
    p.add_argument("--steps", type=int, help="optimizer steps to train (train.steps)")
    p.add_argument("--task", help="built-in task (regression, charlm) or module:function (train.task)")
    p.add_argument("--seed", type=int, help="seed for every random choice (train.seed)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set checkpoint.keep_last=5 (repeatable)",
    )


def parse_nodes(text: str) -> tuple[int, int]:
    """``"2:4"`` → (2, 4); ``"3"`` → (3, 3).

    Raises:
        ConfigError: not N or MIN:MAX with 1 <= MIN <= MAX.
    """
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ConfigError(f"--nodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ConfigError(f"--nodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def collect_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted-key overrides from the parsed options, ``--set`` last (it wins)."""
    overrides: dict[str, Any] = {}
    for dest, key in OPTION_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    nodes = getattr(args, "nodes", None)
    if nodes:
        overrides["rendezvous.min_nodes"], overrides["rendezvous.max_nodes"] = parse_nodes(nodes)
    for text in args.sets:
        key, value = parse_override(text)
        overrides[key] = value
    return overrides
