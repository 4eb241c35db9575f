"""The checkpoint manager's old import path of the worker's link to its agent (:mod:`elastic_train.node`).

Kept only while ``elastic_train/checkpoint/manager.py`` imports it; it goes when that module imports
``elastic_train.node.gate`` instead.
"""

from __future__ import annotations

from elastic_train.node.gate import CURRENT, STALE, UNKNOWN
from elastic_train.node.gate import Link as AgentLink

__all__ = ["CURRENT", "STALE", "UNKNOWN", "AgentLink"]
