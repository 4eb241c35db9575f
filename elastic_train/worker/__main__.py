"""``python -m elastic_train.worker`` (what torchrun runs)."""

from __future__ import annotations

import sys

from elastic_train.worker.main import main

sys.exit(main())
