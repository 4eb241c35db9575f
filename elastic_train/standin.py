"""``python -m elastic_train.standin [-m MODULE | SCRIPT] ARGS...``: run any torchrun worker fast.

What torchrun starts when ``elastic-train run --entry ...`` launches a user's own training script. With
this node's fork server (started by ``elastic-train run``) the script runs in a process forked from one that
already imported torch; without one it simply runs here. Either way the script sees itself as ``__main__``
with its own ``sys.argv``, exactly as under plain torchrun.
"""

from __future__ import annotations

import os
import sys

from elastic_train.worker.forkserver import ENV_SOCKET, exit_like, run_entry, run_standin


def split_entry(args: list[str]) -> tuple[list[str], list[str]]:
    """``["-m", "pkg.train", "--lr", "1"]`` → (["-m", "pkg.train"], ["--lr", "1"]); a script is one item."""
    if not args:
        sys.stderr.write("usage: python -m elastic_train.standin [-m MODULE | SCRIPT] ARGS...\n")
        raise SystemExit(2)
    if args[0] == "-m":
        if len(args) < 2:
            sys.stderr.write("elastic_train.standin: -m needs a module name\n")
            raise SystemExit(2)
        return args[:2], args[2:]
    return args[:1], args[1:]


def main() -> None:
    entry, argv = split_entry(sys.argv[1:])
    socket_path = os.environ.get(ENV_SOCKET)
    exit_like(run_standin(socket_path, argv, entry) if socket_path else run_entry(entry, argv))


if __name__ == "__main__":
    main()
