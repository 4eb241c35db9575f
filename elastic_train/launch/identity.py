"""What an ``elastic-train run``/``local`` node announces as its run's identity: the job settings every node
must share, read from the job config (the rendezvous compares them: :mod:`elastic_train.rendezvous.identity`).
"""

from __future__ import annotations

import os
from typing import Any

from elastic_train.config import JobConfig


def _canonical_url(url: str) -> str:
    """A checkpoint URL as nodes must agree on it: local paths absolute, no trailing slash."""
    if "://" not in url:
        url = os.path.abspath(url)
    return url.rstrip("/") or url


def job_settings(cfg: JobConfig) -> dict[str, Any]:
    """The settings of a job config that every node of the run must share, in comparison order."""
    rdzv, train = cfg.rendezvous, cfg.train
    return {
        "checkpoint.url": _canonical_url(cfg.checkpoint.url),
        "rendezvous.min_nodes": rdzv.min_nodes,
        "rendezvous.max_nodes": rdzv.max_nodes,
        "rendezvous.nproc_per_node": rdzv.nproc_per_node,
        "rendezvous.failure_budget": rdzv.failure_budget,
        "rendezvous.failure_window": rdzv.failure_window,
        "train.task": train.task,
        "train.task_args": train.task_args,
        "train.global_batch": train.global_batch,
        "train.seed": train.seed,
        "train.steps": train.steps,
        # how every rank splits and reduces a step: ranks that differ make the collectives disagree
        "train.shares": train.shares,
        "train.fsdp": train.fsdp,
        "train.mixed_precision": train.mixed_precision,
    }
