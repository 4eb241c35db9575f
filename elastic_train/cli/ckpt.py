"""``elastic-train ckpt``: list, show, verify, export and remove durable checkpoints.

URL is a run root (``ROOT/RUN_ID``) or one step directory (``ROOT/RUN_ID/step-00000123``); without a step,
``show``/``verify``/``export`` take the newest valid checkpoint.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of :mod:`elastic_train.checkpoint.catalog`, imported (with torch) when run."""

    def run(args: argparse.Namespace) -> int:
        from elastic_train.checkpoint import catalog

        result: int = getattr(catalog, name)(args)
        return result

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ckpt", help="inspect, verify, export and remove durable checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option of the filesystem (e.g. endpoint_url=http://127.0.0.1:9000)",
    )
    ls = sub.add_parser(
        "ls", parents=[opts], help="list checkpoints of a run: step, time, world size, size, validity"
    )
    ls.add_argument("url", help="run root URL (ROOT/RUN_ID)")
    ls.set_defaults(func=_lazy("cmd_ls"))
    show = sub.add_parser("show", parents=[opts], help="print a manifest and a tensor summary")
    show.add_argument("url", help="run root or step directory URL")
    show.add_argument("--json", action="store_true", help="print the raw manifest")
    show.set_defaults(func=_lazy("cmd_show"))
    verify = sub.add_parser("verify", parents=[opts], help="recompute checksums (exit 1 on any problem)")
    verify.add_argument("url", help="run root (every checkpoint) or step directory URL")
    verify.set_defaults(func=_lazy("cmd_verify"))
    export = sub.add_parser("export", parents=[opts], help="write the model state_dict as a plain torch file")
    export.add_argument("url", help="run root or step directory URL")
    export.add_argument(
        "--to", required=True, metavar="FILE", help="output file (torch.load weights_only=True)"
    )
    export.set_defaults(func=_lazy("cmd_export"))
    rm = sub.add_parser("rm", parents=[opts], help="delete one checkpoint (a step directory)")
    rm.add_argument("url", help="step directory URL (ROOT/RUN_ID/step-XXXXXXXX)")
    rm.set_defaults(func=_lazy("cmd_rm"))
