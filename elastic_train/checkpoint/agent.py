"""The checkpoint tiers' one contact with the worker's agent: its round, the heartbeat, the publish gate.

- **The heartbeat while waiting** (:meth:`Agent.beat`): waiting on this worker's own durable writer counts
  as progress (the training loop's step boundary beats for every step, :mod:`elastic_train.train.link`); the
  agent tells a node whose collectives make progress from one blocked in a collective whose peers went away.
- **The publish gate** (:meth:`Agent.may_publish`): a durable checkpoint is made visible only while the
  agent confirms that this worker group's rendezvous round is still the run's current one
  (docs/checkpoints.md, "Stale writers").

Outside an agent (plain processes, other rendezvous backends) there is no round, nothing is counted and
every publish is allowed. Nothing else in :mod:`elastic_train.checkpoint` knows how a worker talks to its
agent (:mod:`elastic_train.node.gate`).
"""

from __future__ import annotations

from collections.abc import Callable

from elastic_train.log import get_logger
from elastic_train.node.gate import CURRENT, STALE, Link

log = get_logger(__name__)


class Agent:
    """The worker's agent, as the checkpoint tiers see it.

    Args:
        link: the worker's link to its agent (default: from the environment).
    """

    def __init__(self, link: Link | None = None) -> None:
        self.link = link if link is not None else Link.from_env()
        #: The heartbeat: count one unit of progress (a store into a mapped page).
        self.beat: Callable[[], None] = self.link.beat

    @property
    def round(self) -> int | None:
        """The worker group's rendezvous round (None outside one)."""
        return self.link.round

    def may_publish(self, step: int, *, final: bool) -> bool:
        """The publish gate: whether the checkpoint of ``step`` may be made visible now (always, outside an
        agent). The final checkpoint is published unless the round is known to be stale: the job's result
        is not held back by a coordination service that does not answer."""
        answer = self.link.may_publish()
        if answer == CURRENT:
            return True
        if final and answer != STALE:
            # If this world were stale, the later world's lineage record still keeps this checkpoint from
            # being the newest.
            log.warning("checkpoint_final_unconfirmed", step=step, round=self.round)
            return True
        log.warning(
            "checkpoint_stale" if answer == STALE else "checkpoint_unconfirmed",
            step=step,
            round=self.round,
            reason="a newer round formed without this world"
            if answer == STALE
            else "etcd did not confirm this round in time; the memory tier goes on, a later save retries",
        )
        return False
