"""``elastic-train example-config``: print the demo job's job.yaml, the starting point of a job of one's own.

The file ships inside the package (``elastic_train/examples/job.yaml``), so a node installed from a wheel has
it as a checkout does: ``elastic-train example-config > job.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources

#: The demo job's config, relative to the package.
EXAMPLE = "examples/job.yaml"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "example-config",
        help="print the demo job's job.yaml (elastic-train example-config > job.yaml)",
        description="Print the demo job's config: a small character-level language model on 2-4 nodes.",
    )
    p.set_defaults(func=run)


def example_config() -> str:
    """The text of the packaged example job.yaml."""
    return resources.files("elastic_train").joinpath(EXAMPLE).read_text(encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(example_config())
    return 0
