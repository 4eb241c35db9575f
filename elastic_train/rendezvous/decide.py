"""Pure decisions of the etcd3 rendezvous: when a round closes, who gets which rank, what counts as a failure.

No I/O here: the handler feeds these functions a view of etcd (live nodes, joiners, the last round) and the
clock, and acts on the answer. Unit tests drive them directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Why a node (re-)joins. "start": first join of this agent; "failure": its own workers failed;
#: "lost": it restarted because a member of its round disappeared; "scale": it restarted because another
#: node waits to join; "excluded": its last attempt was left out of a round (max_nodes reached); "rejoin": its
#: lease expired (a partition, a stop longer than the TTL) and its peers re-formed without it: that round
#: already spent the failure (the peers joined it as "lost"), so coming back spends none.
REASONS = ("start", "failure", "lost", "scale", "excluded", "rejoin")
FAILURE_REASONS = frozenset({"failure", "lost"})

#: Quiet window used instead of ``settle`` when every live node joined a round that follows an earlier one.
ALL_JOINED_SETTLE = 0.05


@dataclass(frozen=True, slots=True)
class Joiner:
    """A node's request to be part of round ``target``."""

    node_id: str
    target: int
    reason: str
    revision: int
    """etcd create revision of the join key: arrival order among newcomers."""
    exit_code: int | None = None
    """With reason "failure": the exit code all of the node's failed workers had (``None``: not one)."""
    error: str = ""
    """With :attr:`exit_code`: the last line those workers wrote to stderr."""
    trained: bool = False
    """The node's workers have committed a step in this run (or resumed past one)."""
    ran_s: float = 0.0
    """With :attr:`exit_code`: the longest those workers' script ran before it exited."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Close the round now (``close``), or look again after at most ``wait`` seconds."""

    close: bool
    wait: float
    why: str


def decide_close(
    *,
    joined: Iterable[str],
    live: Iterable[str],
    min_nodes: int,
    max_nodes: int,
    settle: float,
    quiet_for: float,
    has_previous_round: bool,
    gone: Iterable[str] = (),
    join_window: float | None = None,
    since_first_join: float = 0.0,
) -> Decision:
    """Decide whether the round being formed can close.

    Rules, in order:
      1. ``max_nodes`` joiners: close at once.
      2. fewer than ``min_nodes``: wait.
      3. every live node joined and there was an earlier round (membership is known): close after a short
         quiet window (:data:`ALL_JOINED_SETTLE`, at most ``settle``), so a recovery or scale-up does not pay
         the whole settle window. A node known to be gone (its agent no longer accepts connections although
         its lease has not expired yet) does not count as live.
      4. there was an earlier round and ``join_window`` seconds passed since the first node asked for this
         round: close; a live node that has not asked by then is left for the next round.
      5. otherwise close once no node joined or left for ``settle`` seconds. A node that is alive but does not
         join (a hung or dying member whose lease has not expired yet) is waited for at most that long.

    Args:
        joined: node ids that asked for this round.
        live: node ids whose lease is alive.
        min_nodes / max_nodes: the job's node range.
        settle: quiet window in seconds.
        quiet_for: seconds since the last join or departure.
        has_previous_round: a round closed before in this job.
    """
    joined_set = set(joined)
    n = len(joined_set)
    if n >= max_nodes:
        return Decision(True, 0.0, "max_nodes")
    if n < min_nodes:
        return Decision(False, settle or 0.5, "below_min_nodes")
    window = settle
    if has_previous_round and set(live) - set(gone) <= joined_set:
        window = min(settle, ALL_JOINED_SETTLE)
    if quiet_for >= window:
        return Decision(True, 0.0, "settled")
    if has_previous_round and join_window is not None:
        if since_first_join >= join_window:
            return Decision(True, 0.0, "join_window")
        return Decision(False, min(window - quiet_for, join_window - since_first_join), "settling")
    return Decision(False, window - quiet_for, "settling")


def assign_ranks(previous: list[str], joiners: Iterable[Joiner], max_nodes: int) -> list[str]:
    """Order the members of a new round: rank i is ``result[i]``.

    Survivors of the previous round keep their relative order (rank 0 stays rank 0 while it lives), newcomers
    follow in arrival order (join revision, then node id). At most ``max_nodes`` are taken, survivors first.
    """
    by_id = {j.node_id: j for j in joiners}
    survivors = [n for n in previous if n in by_id]
    kept = set(survivors)
    newcomers = sorted(
        (j for j in by_id.values() if j.node_id not in kept), key=lambda j: (j.revision, j.node_id)
    )
    return (survivors + [j.node_id for j in newcomers])[:max_nodes]


def is_startup_report(j: Joiner) -> bool:
    """The node re-joined because its workers exited before any step, all with one exit code and line."""
    return j.reason == "failure" and j.exit_code is not None and bool(j.error) and not j.trained


def identical_startup_failure(previous: list[str], joiners: Iterable[Joiner]) -> str | None:
    """Why the run should end now: every node failed the same way before the first step, so no restart can
    help (a script's usage error, a missing file every node lacks).

    The rule (docs/operating.md): every member of the last round re-joins because its own workers failed,
    each with the same exit code and the same last stderr line, and none has trained a step in this run.
    A member that has not re-joined yet, or re-joined for another reason, or a node that trained, keeps the
    ordinary restart.

    Returns:
        The message to close the run with (the workers' own line first), or ``None``.
    """
    if not previous:
        return None
    by_id = {j.node_id: j for j in joiners}
    reports = set()
    for member in previous:
        j = by_id.get(member)
        if j is None or not is_startup_report(j):
            return None
        reports.add((j.exit_code, j.error))
    if len(reports) != 1:
        return None
    code, line = reports.pop()
    nodes = "the node" if len(previous) == 1 else f"all {len(previous)} nodes"
    return f"{line} (exit code {code} on {nodes} before the first step; not retried)"


def hold_for_startup_reports(
    *,
    seen_for: float,
    peer_ran_s: float,
    own: tuple[bool, float | None] | None,
    now: float,
    grace: float,
    most: float,
) -> bool:
    """Whether a node leaves its workers running although members re-joined with start-up failure reports.

    Its own script, started with theirs, is likely about to fail the same way; stopping it first would hide
    that, and the run would spend its failure budget on restarts that cannot help. The node holds for
    ``grace`` seconds after it first saw the reports, then for as long as its own script waits to start
    (its fork server was slower), and then until the script has run as long as the reporters' took to fail,
    plus ``grace``. Never longer than ``most`` seconds: a node whose script never starts is restarted.

    Args:
        seen_for: seconds since this node first saw the reports.
        peer_ran_s: the longest any reporter's script ran before it failed.
        own: this node's scripts (``outcome.script_clock``): ``None`` when unknown, else (some still wait to
            start, when the last of the others started).
        now: the time on the clock of ``own``.
        grace: the least hold, and the margin on the reporters' time.
        most: the longest hold.
    """
    if seen_for >= most:
        return False
    if seen_for < grace:
        return True
    if own is None:
        return False
    pending, started = own
    if pending:
        return True
    return started is not None and now - started < peer_ran_s + grace


def count_waiting(
    *,
    my_round: int | None,
    latest_round: int,
    members: list[str],
    live: Iterable[str],
    joins: Mapping[str, Joiner],
    max_nodes: int,
) -> int:
    """What ``num_nodes_waiting()`` reports to a torchrun agent whose workers run round ``my_round``.

    Positive when the agent must restart its worker group: a newer round closed without it, a member of its
    round lost its lease (kill -9, SIGSTOP, network loss), a member asked for the next round (its workers
    failed), or a node waits to join while the round has room (``< max_nodes``).
    """
    if my_round is None:
        return 0
    if latest_round > my_round:
        return 1
    live_set = set(live)
    lost = sum(1 for m in members if m not in live_set)
    member_set = set(members)
    rejoining = sum(1 for j in joins.values() if j.target > my_round and j.node_id in member_set)
    newcomers = 0
    if len(members) < max_nodes:
        newcomers = sum(
            1
            for j in joins.values()
            if j.target > my_round and j.node_id not in member_set and j.node_id in live_set
        )
    return lost + rejoining + newcomers
