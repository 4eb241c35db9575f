"""``python -m elastic_train.worker`` (what torchrun runs).

With a node fork server (``elastic-train run`` starts one), this process is only a stand-in for a worker
forked from a process that already imported torch; see :mod:`elastic_train.worker.forkserver`.
"""

from __future__ import annotations

import os
import sys

from elastic_train.worker.forkserver import ENV_SOCKET, exit_like, run_standin

if os.environ.get(ENV_SOCKET):
    from elastic_train.node import WorkerChannel
    from elastic_train.worker.standin import report_exit

    signalled: list[int] = []
    code = run_standin(os.environ[ENV_SOCKET], sys.argv[1:], on_signal=signalled.append)
    channel = WorkerChannel.from_environ(os.environ)
    if channel is not None and not signalled:  # a worker its agent stopped did not fail
        rank = os.environ.get("RANK", "0")
        report_exit(channel, int(rank) if rank.isdigit() else 0, code, "", None)
    exit_like(code)
else:
    from elastic_train.worker.main import main

    sys.exit(main())
