"""The environment variables elastic_train's processes pass to each other: one definition each.

An agent or launcher sets them for the workers it starts; the layers that read them import the name from
here, so the writer and the reader can never disagree on the spelling.
"""

from __future__ import annotations

ENV_ROUND = "ELASTIC_TRAIN_RDZV_ROUND"
"""The global rendezvous round of the worker group, exported by the etcd3 handler in the agent."""

ENV_NODE_ID = "ELASTIC_TRAIN_NODE_ID"
"""The node's id in the rendezvous (``elastic-train run``/``local`` set it per agent)."""

ENV_IDENTITY = "ELASTIC_TRAIN_JOB_IDENTITY"
"""The job's identity fingerprint (JSON) an agent checks against the run's record in etcd."""

ENV_OUTCOME_DIR = "ELASTIC_TRAIN_OUTCOME_DIR"
"""Where a worker records that the job finished or failed for good, for its agent to read."""

OUTCOME_TRAINED = "trained"
"""File a worker creates in :data:`ENV_OUTCOME_DIR` once it committed (or resumed past) a step."""

ENV_EVENTS = "ELASTIC_TRAIN_EVENTS"
"""File rank 0 appends progress events to (``elastic-train local`` follows it)."""

ENV_AUDIT_DIR = "ELASTIC_TRAIN_AUDIT_DIR"
"""Directory of the per-step data audit of samplers not given one."""

ENV_SHM_OWNER = "ELASTIC_TRAIN_SHM_OWNER"
"""PID of the process that owns this node's shared-memory snapshots (they outlive the workers, not it)."""

ENV_REFORM_DIR = "ELASTIC_TRAIN_REFORM_DIR"
"""The directory through which an agent and its workers re-form the process group in-process
(:mod:`elastic_train.reform`); unset when hot recovery is off."""

ENV_STANDBY = "ELASTIC_TRAIN_STANDBY"
"""Set by the agent when it starts a joining node's workers on standby
(:mod:`elastic_train.rendezvous.standby`): the seconds they may wait to be admitted to the running job.
They build the model first and form no group of the job's until their agent hands them a round; unset
otherwise."""
ENV_START_BARRIER = "ELASTIC_TRAIN_START_BARRIER"
"""``DIR:N`` (``elastic-train local``): the job's initial nodes enter their first rendezvous together, once
N of them are ready (each leaves a file in DIR), so that nodes started at once on shared cores are not
split across two rounds by an uneven start."""
