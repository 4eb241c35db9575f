"""``python -m elastic_train`` is ``elastic-train``."""

from __future__ import annotations

import sys

from elastic_train.cli.main import main

sys.exit(main())
