"""Command-line options that set job config keys, shared by ``elastic-train run``/``local`` and the worker.

One table (:data:`OPTIONS`) maps each dedicated option to the config key it sets, and
:func:`collect_overrides` turns parsed options into dotted-key overrides with one precedence for every
command: the dedicated options first, then every ``--set KEY=VALUE`` in order, so ``--set`` wins over a
dedicated option for the same key (``--steps 7 --set train.steps=5`` trains 5 steps). The overrides are
validated by the same strict loader as job.yaml.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_train.config.loader import parse_override


class OneLineParser(argparse.ArgumentParser):
    """argparse that exits with code 2 and one line on a usage error (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


@dataclass(frozen=True, slots=True)
class Option:
    """A dedicated command-line option for one config key."""

    flag: str
    """``--checkpoint-every``."""
    key: str
    """The dotted config key it sets (``checkpoint.every_steps``)."""
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return dest(self.flag)


def dest(flag: str) -> str:
    """The attribute argparse stores ``flag`` under (``--checkpoint-every`` → ``checkpoint_every``)."""
    return flag.removeprefix("--").replace("-", "_")


#: Every dedicated option, in ``--help`` order.
OPTIONS: tuple[Option, ...] = (
    Option("--endpoint", "rendezvous.endpoint", "etcd HOST:PORT[,HOST:PORT] (rendezvous.endpoint)"),
    Option("--run-id", "rendezvous.run_id", "job identity shared by all nodes (rendezvous.run_id)"),
    Option(
        "--nproc-per-node", "rendezvous.nproc_per_node", "workers per node (rendezvous.nproc_per_node)", int
    ),
    Option(
        "--checkpoint", "checkpoint.url", "checkpoint root, any fsspec URL (checkpoint.url)", metavar="URL"
    ),
    Option(
        "--checkpoint-every",
        "checkpoint.every_steps",
        "durable checkpoint every N steps (checkpoint.every_steps)",
        int,
        "N",
    ),
    Option(
        "--resume-from",
        "checkpoint.resume_from",
        "start from this checkpoint, a run root or step dir (checkpoint.resume_from)",
        metavar="URL",
    ),
    Option(
        "--audit",
        "train.audit_dir",
        "write per-step sample indices of every rank here (train.audit_dir)",
        metavar="DIR",
    ),
    Option("--steps", "train.steps", "optimizer steps to train (train.steps)", int, "N"),
    Option("--task", "train.task", "built-in task (regression, charlm) or module:function (train.task)"),
    Option("--seed", "train.seed", "seed for every random choice (train.seed)", int),
)
_BY_FLAG = {o.flag: o for o in OPTIONS}


def add_job_options(
    p: argparse.ArgumentParser, flags: Iterable[str] | None = None, *, without: Iterable[str] = ()
) -> None:
    """Add the dedicated options named by ``flags`` (default: all of :data:`OPTIONS`) except those
    ``without``, and ``--set``."""
    chosen = OPTIONS if flags is None else tuple(_BY_FLAG[flag] for flag in flags)
    skip = set(without)
    chosen = tuple(o for o in chosen if o.flag not in skip)
    for o in chosen:
        p.add_argument(o.flag, dest=o.dest, type=o.type, metavar=o.metavar, help=o.help)
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, value in YAML syntax, e.g. --set checkpoint.keep_last=5 "
        "(repeatable; wins over the dedicated options)",
    )


def collect_overrides(args: argparse.Namespace, derived: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Dotted-key overrides from parsed options: the dedicated options, then ``derived`` (keys a command
    computes from options of its own, e.g. ``--nodes``), then every ``--set`` in order (it wins).

    Raises:
        ConfigError: a ``--set`` is not ``KEY=VALUE`` with a YAML value.
    """
    overrides: dict[str, Any] = {}
    for o in OPTIONS:
        value = getattr(args, o.dest, None)
        if value is not None:
            overrides[o.key] = value
    overrides.update(derived or {})
    for text in args.sets:
        key, value = parse_override(text)
        overrides[key] = value
    return overrides
