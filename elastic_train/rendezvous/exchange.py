"""A round's store, and its rank exchange when the round formed in-process: the agents of the round assign
their workers' global ranks as torchrun's own path does, without waiting on a member that is gone.

Every agent hosts a TCPStore for its whole life and advertises its port; a round's store is its rank 0's,
behind a prefix of the round's own (:class:`RoundStores`), for torchrun's path and the hot path alike.

After an in-process round the hot path (:mod:`elastic_train.rendezvous.hot`) runs torchrun's rank exchange
through the round's store (:class:`~elastic_train.torchcompat.TorchrunAgent`): every agent of the round takes
part, also one that restarts its workers or joins through torchrun's path, and torchrun's record of the
worker group becomes the new round's (its exit barrier then waits for this round's nodes). Before it blocks
in the exchange, an agent waits without blocking until every other agent wrote its part, watching the ones
that have not: a member whose lease expired, whose agent's store port refuses connections
(:mod:`elastic_train.rendezvous.probe`), or that asks for a newer round abandons the round at once
(:class:`RoundAbandoned`); the next one forms in-process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic_train.rendezvous.probe import probe_node
from elastic_train.rendezvous.protocol import Participant
from elastic_train.rendezvous.records import RoundResult
from elastic_train.torchcompat import TorchrunAgent, WorkerSlot, role_info_key

#: Seconds the agents of a round formed in-process get to exchange their workers' ranks (all of them are at
#: it already). A member found gone meanwhile abandons the round at once; past this, the restart path.
ASSIGN_TIMEOUT = 10.0
#: Seconds between two probes of a member of the forming round that has not written its rank information.
PROBE_EVERY = 0.1
#: Seconds of waiting for a member's part before its agent is probed, in a round of more than SCAN_ALWAYS
#: agents (a live member writes in milliseconds; probing N members at once is N connections per agent).
PROBE_AFTER = 0.5
#: Missing parts an agent looks up one by one at every look; above, one by one every SCAN_EVERY seconds once
#: a part is PROBE_AFTER seconds late.
SCAN_ALWAYS = 32
SCAN_EVERY = 0.25
#: Keys asked in one request when looking for the missing parts.
SCAN_CHUNK = 64
#: Extra seconds between two looks per agent of the round (at most MAX_SPACING): rank 0's store serves all.
SPACING_PER_AGENT = 0.00005
MAX_SPACING = 0.1


def missing_parts(store: Any, keys: dict[int, str]) -> dict[int, str]:
    """The ``keys`` not in ``store``: asked by chunks of :data:`SCAN_CHUNK` (one request for a chunk whose
    keys are all there), key by key within a chunk that is not."""
    items = list(keys.items())
    out: dict[int, str] = {}
    for at in range(0, len(items), SCAN_CHUNK):
        chunk = items[at : at + SCAN_CHUNK]
        if len(chunk) > 1 and store.check([k for _, k in chunk]):
            continue
        out.update((i, k) for i, k in chunk if not store.check([k]))
    return out


class RoundAbandoned(Exception):
    """A member of the round just formed is gone before the agents exchanged their workers' ranks."""


class RoundStores:
    """The store of each round this node takes part in.

    Args:
        server: this agent's own TCPStore (the store of a round whose rank 0 this node is).
        addr: the address this node's workers bootstrap at.
        timeout: the stores' timeout.
        node_id: this node.
    """

    def __init__(self, server: Any, addr: str, timeout: timedelta, node_id: str) -> None:
        self.server, self.addr, self.timeout, self.node_id = server, addr, timeout, node_id
        self._clients: dict[tuple[str, int], Any] = {}

    def bootstrap(self, result: RoundResult) -> tuple[Any, Any]:
        """The round's store (rank 0's, behind the round's own prefix) and the workers' bootstrap address
        (a fresh ``MASTER_PORT`` on rank 0 every round).

        Raises:
            RuntimeError: rank 0's store cannot be reached, or the round record names none.
        """
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

        rank0 = result.members[0]
        if rank0 == self.node_id:
            base = self.server
        else:
            node = result.nodes.get(rank0) or {}
            host, port = node.get("addr"), node.get("store_port")
            if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
                raise RuntimeError(f"round {result.round} names no store for its rank 0 ({node!r})")
            base = self._clients.get((host, port))
            if base is None:
                base = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
                self._clients[(host, port)] = base
        store = dist.PrefixStore(f"elastic_train/round/{result.round}/", base)
        return store, RendezvousStoreInfo.build(result.rank, store, local_addr=self.addr)


def exchange_ranks(
    agent: TorchrunAgent,
    participant: Participant,
    result: RoundResult,
    store: Any,
    info: Any,
    pause: Callable[[], None],
) -> list[WorkerSlot]:
    """Assign this node's workers their global ranks in round ``result`` and make torchrun's record of the
    worker group the round's; returns the workers' places, by local rank.

    Args:
        agent: torchrun's agent and worker group.
        participant: this node in the run.
        result: the round.
        store: the round's store (on its rank 0).
        info: the round's bootstrap address (``master_addr``, ``master_port``).
        pause: called between two looks at the members (waits a moment; raises to stop waiting).

    Raises:
        RoundAbandoned: a member of the round is gone before it wrote its part (:func:`await_members`).
        RuntimeError: not every member wrote its part within :data:`ASSIGN_TIMEOUT`.
    """
    from torch.distributed.elastic.utils.store import store_timeout

    await_members(agent, participant, result, store, pause)
    with store_timeout(store, ASSIGN_TIMEOUT):
        workers = agent.assign_ranks(store, result.rank, result.world_size)
    agent.adopt_round(result.rank, result.world_size, store, info.master_addr, info.master_port)
    return workers


def await_members(
    agent: TorchrunAgent, participant: Participant, result: RoundResult, store: Any, pause: Callable[[], None]
) -> None:
    """Wait, without blocking in the store, until every other agent of the round wrote its part of
    torchrun's rank exchange: then the exchange does not wait on a dead member (torch's blocking get would
    hold the hot path for :data:`ASSIGN_TIMEOUT`, then the restart path).

    Raises:
        RoundAbandoned: a member that has not written its part is gone: its lease expired, its store port
            refuses connections (its agent died), or it asks for a newer round; or the round's store (on rank
            0) is unreachable.
        RuntimeError: not every member wrote within :data:`ASSIGN_TIMEOUT`.
    """
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        return  # torch's fast path: no exchange through the store
    # what the exchange writes first, written here so that the members waiting here see it; then a count
    # of the parts written: a look is one O(1) request to rank 0's store, whatever the round's size
    parts = f"elastic_train/parts/{result.round}"
    try:
        agent.write_role_info(store, result.rank)
        # counted once per agent, also when the round is awaited again (the hot path handed it to torchrun's)
        if store.add(f"{parts}/{result.rank}", 1) == 1:
            store.add(parts, 1)
    except RuntimeError as exc:
        raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
    keys = {i: role_info_key(i) for i in range(result.world_size) if i != result.rank}
    waiting = {result.members[i]: i for i in keys}  # whom this agent may wait for, by node
    started = time.monotonic()
    deadline = started + ASSIGN_TIMEOUT
    probed: dict[int, float] = {}
    scanned = -1.0
    # every agent of the round asks rank 0's store: a large round looks less often; which parts are missing
    # (to probe their agents) is asked key by key only once they are late (PROBE_AFTER), in chunks
    spacing = min(MAX_SPACING, SPACING_PER_AGENT * result.world_size)
    while True:
        now = time.monotonic()
        try:
            if store.add(parts, 0) >= result.world_size:
                return
            if len(keys) <= SCAN_ALWAYS or (now - started >= PROBE_AFTER and now - scanned >= SCAN_EVERY):
                scanned = now
                keys = missing_parts(store, keys)
                waiting = {result.members[i]: i for i in keys}
        except RuntimeError as exc:
            raise RoundAbandoned(f"the round's store on rank 0 is unreachable: {exc}") from exc
        if not keys:
            return
        for node in participant.lost_members() & waiting.keys():
            raise RoundAbandoned(f"member {node} (rank {waiting[node]}) lost its lease")
        for node in participant.asking_beyond(result.round) & waiting.keys():
            raise RoundAbandoned(f"member {node} (rank {waiting[node]}) asks for a newer round")
        small = result.world_size <= SCAN_ALWAYS  # a few probes: at once, as soon as a part is missing
        if scanned >= started and (small or now - started >= PROBE_AFTER):
            for i in keys:
                node = result.members[i]
                if now - probed.get(i, 0.0) >= PROBE_EVERY:
                    probed[i] = now
                    if probe_node(result.nodes.get(node)) == "refused":
                        raise RoundAbandoned(
                            f"member {node} (rank {i}): its agent is gone (store port refused)"
                        )
        if now > deadline:
            raise RuntimeError(
                f"rank(s) {sorted(keys)} of round {result.round} did not exchange ranks within "
                f"{ASSIGN_TIMEOUT:g} s"
            )
        if spacing > 0:
            time.sleep(spacing)
        pause()
