"""The node contract: what a torchrun agent's ``etcd3`` handler and the workers it starts tell each other.

One directory per agent, named in one environment variable (:data:`~elastic_train.envvars.ENV_NODE_DIR`),
one frozen message type per fact (:mod:`.messages`), each a small JSON file replaced atomically, and two
things that are not files of JSON:

==================  ===============================  =========================================================
message             file                             says
==================  ===============================  =========================================================
agent → workers
:class:`Assignment` ``assignment.json``              where the workers train: the round (its one writer is
                                                     :meth:`AgentChannel.assign`), the node's rank, the
                                                     bootstrap address; the global ranks after an in-process
                                                     round; standby and hot-recovery flags
:class:`Change`     ``change.json``                  the group of round R re-forms: stop at the next step
:class:`Cut`        ``cut.json``                     cut the group's connections (a stopped peer blocks it)
:class:`Ended`      ``ended.json``                   the run ended before the standby workers were admitted
:class:`Fallback`   ``fallback.json``                no assignment comes: torchrun restarts the workers
publish gate        ``gate.sock``                    is round R still current? (:mod:`.gate`)
workers → agent
:class:`Ready`      ``ready-<local rank>.json``      re-forms in-process from round R on
:class:`Request`    ``request-<local rank>.json``    my group of round R broke or stopped: next round please
:class:`Standby`    ``standby-<local rank>.json``    built on standby, admit me
:class:`Outcome`    ``rank-<rank>.json``             finished at a step, failed for good, or exited (code,
                                                     error line, exception type and where)
:class:`ScriptStart` ``start-<rank>.json``           the stand-in's script waits to start, or started at T
:class:`Trained`    ``trained.json``                 a step was committed (or resumed past) in round R
:class:`Finished`   ``finished-<local rank>.json``   training ended: the final checkpoint committed at a step
:class:`Stats`      ``stats-<pid>.json``             figures for the agent's metrics: steps/s, snapshot and
                                                     durable write seconds (at most once a second,
                                                     :mod:`.stats`)
step beat           ``beat-<pid>``                   steps finished, mapped into memory (:mod:`.beat`)
==================  ===============================  =========================================================

No torch and no etcd here: the agent's layer (rendezvous) and the workers' (train, worker) import only this
package to talk to each other. Everything read from the directory is validated before use.
"""

from __future__ import annotations

from elastic_train.node.beat import Beat, Beats
from elastic_train.node.channel import AgentChannel, WorkerChannel
from elastic_train.node.gate import CURRENT, STALE, UNKNOWN, GateServer, Link
from elastic_train.node.messages import (
    Assignment,
    Change,
    Cut,
    Ended,
    Fallback,
    Finished,
    Outcome,
    Ready,
    Request,
    ScriptStart,
    Standby,
    Stats,
    Trained,
    seconds,
)
from elastic_train.node.stats import StatsCounter

__all__ = [
    "CURRENT",
    "STALE",
    "UNKNOWN",
    "AgentChannel",
    "Assignment",
    "Beat",
    "Beats",
    "Change",
    "Cut",
    "Ended",
    "Fallback",
    "Finished",
    "GateServer",
    "Link",
    "Outcome",
    "Ready",
    "Request",
    "ScriptStart",
    "Standby",
    "Stats",
    "StatsCounter",
    "Trained",
    "WorkerChannel",
    "seconds",
]
