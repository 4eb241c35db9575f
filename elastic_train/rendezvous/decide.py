"""Pure decisions of the etcd3 rendezvous: when a round closes, who gets which rank, what counts as a failure.

No I/O here: the handler feeds these functions a view of etcd (live nodes, joiners, the last round) and the
clock, and acts on the answer. Unit tests drive them directly.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from operator import attrgetter

from elastic_train.node import Outcome, seconds
from elastic_train.torchcompat import WorkerExit

#: Why a node (re-)joins. "start": first join of this agent; "failure": its own workers failed;
#: "lost": it restarted because a member of its round disappeared; "scale": it restarted because another
#: node waits to join; "excluded": its last attempt was left out of a round (max_nodes reached); "rejoin": its
#: lease expired (a partition, a stop longer than the TTL) and its peers re-formed without it: that round
#: already spent the failure (the peers joined it as "lost"), so coming back spends none.
REASONS = ("start", "failure", "lost", "scale", "excluded", "rejoin")
FAILURE_REASONS = frozenset({"failure", "lost"})


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
    """With :attr:`exit_code`: the script's own error line (``""``: none known)."""
    trained: bool = False
    """The node's workers have committed a step in the round they failed in."""
    ran_s: float = 0.0
    """With :attr:`exit_code`: the longest those workers' script ran before it exited."""
    signature: str = ""
    """With :attr:`exit_code`: what makes two failures the same one (:class:`ExitReport`)."""
    asked_at: float | None = None
    """Unix time (the node's clock) the node asked: where a recovery starts (``None``: not said)."""


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
      3. every live node joined and there was an earlier round (membership is known): close at once, so a
         recovery or scale-up does not pay the settle window. A node not registered yet has nothing to wait
         for here: it joins the next round, as it would after any quiet window. A node known to be gone (its
         agent no longer accepts connections although its lease has not expired yet) does not count as
         live.
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
    joined_set = joined if isinstance(joined, AbstractSet) else set(joined)  # a large job's: no copy
    n = len(joined_set)
    if n >= max_nodes:
        return Decision(True, 0.0, "max_nodes")
    if n < min_nodes:
        return Decision(False, settle or 0.5, "below_min_nodes")
    if has_previous_round and set(live) - set(gone) <= joined_set:
        return Decision(True, 0.0, "all_joined")
    window = settle
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
        (j for j in by_id.values() if j.node_id not in kept), key=attrgetter("revision", "node_id")
    )
    return (survivors + [j.node_id for j in newcomers])[:max_nodes]


def ranks_before(previous_rank: Mapping[str, int], a: Joiner, b: Joiner) -> bool:
    """Whether :func:`assign_ranks` puts joiner ``a`` before joiner ``b`` (``previous_rank``: each member of
    the previous round by its rank there): survivors first in their previous order, then newcomers by join
    revision and node id. O(1): a node that is not in a picture of the forming round yet can tell whether it
    would come before the picture's first node (and so may be the one to close the round)."""
    ra, rb = previous_rank.get(a.node_id), previous_rank.get(b.node_id)
    if ra is not None or rb is not None:
        return rb is None or (ra is not None and ra < rb)
    return (a.revision, a.node_id) < (b.revision, b.node_id)


@dataclass(frozen=True, slots=True)
class ExitReport:
    """How all the failed workers of a node's group ended, when they ended alike."""

    code: int
    """Their exit code (negative: the signal that killed them)."""
    line: str
    """The script's own error line (an exception's ``Type: message``, the last stderr line), or ``""``."""
    signature: str
    """What makes two failures the same one: the exception's type and where it was raised when the worker
    said, else the error line (``""``: the exit code alone)."""
    ran_s: float = 0.0
    """The longest any of them ran before it exited (0 when unknown)."""


#: Python's exit status for any uncaught exception, one that a peer's failure caused included: alone, without
#: the exception or a line, it names no failure.
GENERIC_EXIT = 1


def exit_report(outcomes: Iterable[Outcome]) -> ExitReport | None:
    """The node's report when the exited workers of its group all failed the same way (the same non-zero
    exit code and signature); ``None`` otherwise (none exited, they differ, or the exit code is all there
    is and it is :data:`GENERIC_EXIT`)."""
    outcomes = list(outcomes)
    if any(o.state == "restarting" for o in outcomes):  # left for the restart path: nothing failed
        return None
    exited = [o for o in outcomes if o.state == "exited"]
    signatures = {(o.code, f"{o.kind} at {o.where}" if o.kind else o.message.strip()) for o in exited}
    if len(signatures) != 1:
        return None
    code, signature = signatures.pop()
    if not code or (code == GENERIC_EXIT and not signature):
        return None
    line = next((o.message.strip() for o in exited if o.message.strip()), "")
    return ExitReport(code, line, signature, max(seconds(o.ran_s) for o in exited))


def torchrun_report(exits: Iterable[WorkerExit]) -> ExitReport | None:
    """The node's report from torchrun's own record of its failed workers (a script that tells its agent
    nothing, under plain torchrun): the same exit code and error-file line on every one, else ``None`` (also
    for :data:`GENERIC_EXIT` without a line)."""
    signatures = {(e.exit_code, e.message) for e in exits}
    if len(signatures) != 1:
        return None
    code, line = signatures.pop()
    if not code or (code == GENERIC_EXIT and not line):
        return None
    return ExitReport(code, line, line)


def exit_ran_s(outcomes: Iterable[Outcome]) -> float:
    """The longest any exited worker's script ran before it exited (0 when none says)."""
    return max((seconds(o.ran_s) for o in outcomes if o.state == "exited"), default=0.0)


def is_startup_report(j: Joiner) -> bool:
    """The node re-joined because its workers exited before the round's first step, all alike."""
    return j.reason == "failure" and bool(j.exit_code) and not j.trained


def how_exited(code: int) -> str:
    """``exit code 2``, or ``signal SIGSEGV`` for a negative code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def identical_startup_failure(previous: list[str], joiners: Iterable[Joiner]) -> str | None:
    """Why the run should end now: every node failed the same way before the first step of the round, so
    no restart can help (a script's usage error, a missing file every node lacks, an exception in the first
    step).

    The rule (docs/operating.md): every member of the last round re-joins because its own workers failed,
    each with the same exit code and the same failure (the exception's type and where it was raised, else
    the error line, else the exit code alone), and none has trained a step in that round. A member that has
    not re-joined yet, or re-joined for another reason, or a node that trained, keeps the ordinary restart.

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
        reports.add((j.exit_code, j.signature or j.error))
    if len(reports) != 1:
        return None
    code, _ = reports.pop()
    assert code is not None
    line = next((by_id[m].error for m in previous if by_id[m].error), "") or (
        f"the workers exited with {how_exited(code)}"
    )
    nodes = "the node" if len(previous) == 1 else f"all {len(previous)} nodes"
    return f"{line} ({how_exited(code)} on {nodes} before the first step; not retried)"


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
        own: this node's scripts (``AgentChannel.script_clock``): ``None`` when unknown, else (some still
            wait to start, when the last of the others started).
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
