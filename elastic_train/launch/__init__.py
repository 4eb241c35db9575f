"""Launching: the torchrun command line for one node (`run`) and a whole job on one machine (`local`)."""

from __future__ import annotations

#: Names the node an agent and its workers belong to (node-local resources such as shared memory use it).
#: Set by ``elastic-train run``/``local``; defaults to the host name.
ENV_NODE_ID = "ELASTIC_TRAIN_NODE_ID"
