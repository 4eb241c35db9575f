"""``python -m elastic_train.worker`` (what torchrun runs).

With a node fork server (``elastic-train run`` starts one), this process is only a stand-in for a worker
forked from a process that already imported torch; see :mod:`elastic_train.worker.forkserver`.
"""

from __future__ import annotations

import os
import sys

from elastic_train.worker.forkserver import ENV_SOCKET, exit_like, run_standin

if os.environ.get(ENV_SOCKET):
    exit_like(run_standin(os.environ[ENV_SOCKET], sys.argv[1:]))
else:
    from elastic_train.worker.main import main

    sys.exit(main())
