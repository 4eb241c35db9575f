"""The environment variables elastic_train's processes pass to each other: one definition each.

An agent or launcher sets them for the workers it starts; the layers that read them import the name from
here, so the writer and the reader can never disagree on the spelling.
"""

from __future__ import annotations

ENV_NODE_DIR = "ELASTIC_TRAIN_NODE_DIR"
"""The directory through which a torchrun agent's ``etcd3`` handler and the workers it starts talk
(:mod:`elastic_train.node`: the round a worker trains in, in-process re-formation, outcomes, step beats, the
publish gate); unset outside such an agent."""

ENV_NODE_ID = "ELASTIC_TRAIN_NODE_ID"
"""The node's id in the rendezvous (``elastic-train run``/``local`` set it per agent)."""

ENV_IDENTITY = "ELASTIC_TRAIN_JOB_IDENTITY"
"""The job's identity fingerprint (JSON) an agent checks against the run's record in etcd."""

ENV_EVENTS = "ELASTIC_TRAIN_EVENTS"
"""File rank 0 appends progress events to (``elastic-train local`` follows it)."""

ENV_AUDIT_DIR = "ELASTIC_TRAIN_AUDIT_DIR"
"""Directory of the per-step data audit of samplers not given one."""

ENV_SHM_OWNER = "ELASTIC_TRAIN_SHM_OWNER"
"""PID of the process that owns this node's shared-memory snapshots (they outlive the workers, not it)."""

ENV_START_BARRIER = "ELASTIC_TRAIN_START_BARRIER"
"""``DIR:N`` (``elastic-train local``): the job's initial nodes enter their first rendezvous together, once
N of them are ready (each leaves a file in DIR), so that nodes started at once on shared cores are not
split across two rounds by an uneven start."""
