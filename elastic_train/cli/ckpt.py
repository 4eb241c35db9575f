"""``elastic-train ckpt``: list, show, verify, export and remove durable checkpoints.

URL is a checkpoint root (``ls`` lists its runs), a run root (``ROOT/RUN_ID``) or one step directory
(``ROOT/RUN_ID/step-00000123``); without a step, ``show``/``verify``/``export`` take the newest valid
checkpoint.
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
        "ls",
        parents=[opts],
        help="list the checkpoints of a run (step, time, world size, size, validity; exit 1 if one is "
        "invalid), or the runs of a checkpoint root with their newest valid step",
    )
    ls.add_argument("url", help="checkpoint root (ROOT), run root (ROOT/RUN_ID) or step directory")
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
        "--to",
        required=True,
        metavar="FILE",
        help="output file outside the checkpoint store (torch.load weights_only=True)",
    )
    export.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    export.set_defaults(func=_lazy("cmd_export"))
    rm = sub.add_parser(
        "rm",
        parents=[opts],
        help="delete one checkpoint (a step directory); asks on a terminal, else needs --yes",
    )
    rm.add_argument("url", help="step directory URL (ROOT/RUN_ID/step-XXXXXXXX)")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    rm.add_argument(
        "--force",
        action="store_true",
        help="also remove the newest valid checkpoint of the run, or a step directory without a manifest",
    )
    rm.set_defaults(func=_lazy("cmd_rm"))
