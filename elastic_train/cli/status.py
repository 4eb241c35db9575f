"""``elastic-train status``: live view of a job's rendezvous from etcd."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from elastic_train.cli.etcd import add_tls_options, tls_from_args
from elastic_train.errors import ConfigError
from elastic_train.etcd.config import DEFAULT_PASSWORD_ENV
from elastic_train.rendezvous.config import RendezvousConfig

if TYPE_CHECKING:
    from elastic_train.etcd.client import Etcd
    from elastic_train.rendezvous.status import JobStatus


#: Seconds between two refreshes of ``status --watch``.
WATCH_INTERVAL = 2.0
#: What a terminal is sent before each refresh: cursor home, clear the screen.
CLEAR = "\x1b[H\x1b[2J"

#: States in which no node holds the run: its members are the last round's, none of them "lost".
ENDED = ("finished", "failed", "stopped")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show a run: state (waiting, running, finished, failed), round, members, failures"
    )
    p.add_argument("--endpoint", required=True, help="etcd HOST:PORT[,HOST:PORT...]")
    p.add_argument("--run-id", required=True, help="the job's run id (--rdzv-id)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--user", default=None, help="etcd user (password from --password-env or --password-file)")
    p.add_argument("--password-env", default=DEFAULT_PASSWORD_ENV, help="env var holding the password")
    p.add_argument("--password-file", default=None, help="file holding the password")
    add_tls_options(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per etcd request")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=WATCH_INTERVAL,
        metavar="SECONDS",
        help=f"refresh the view every SECONDS (default {WATCH_INTERVAL:g}) until Ctrl-C",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elastic_train.rendezvous.connect import open_etcd
    from elastic_train.rendezvous.status import read_status

    tls = tls_from_args(args)
    try:
        cfg = RendezvousConfig(
            endpoint=args.endpoint,
            run_id=args.run_id,
            user=args.user,
            password_env=args.password_env,
            password_file=args.password_file,
            tls=tls,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch:g}: the refresh interval must be > 0 seconds")
    with open_etcd(cfg, timeout=args.timeout, connect_timeout=args.timeout) as etcd:
        if args.watch is not None:
            warn_of_release(etcd)
            return watch(lambda: read_status(etcd, args.run_id), args.watch, as_json=args.json)
        st = read_status(etcd, args.run_id)
        if st.exists:  # a run id etcd does not know is the one error line
            warn_of_release(etcd)
    if not st.exists:
        if args.json:
            print(json.dumps(st.to_json(), indent=2))
        sys.stderr.write(f"elastic-train: error: no such run: {args.run_id} (no key of it in etcd)\n")
        return 1
    if args.json:
        print(json.dumps(st.to_json(), indent=2))
        return 0
    for line in render(st):
        print(line)
    return 0


def warn_of_release(etcd: Etcd) -> None:
    """One ``elastic-train: warning:`` line on stderr when the etcd read runs a release that loses data in
    crashes (below etcd's production minimum); nothing when it does not, or does not say. Shown with a
    run's view, not with the error of a run id etcd does not know."""
    from elastic_train.etcd.errors import EtcdError
    from elastic_train.etcd.releases import release_warning

    try:
        line = release_warning(etcd.server_version(), etcd.member)
    except EtcdError:
        return  # the view that follows reports an etcd that stopped answering
    if line is not None:
        sys.stderr.write(f"elastic-train: warning: {line}\n")


def watch(
    read: Callable[[], JobStatus],
    interval: float,
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    times: int | None = None,
) -> int:
    """Print the run's view every ``interval`` seconds until Ctrl-C (or ``times`` views); status 0.

    On a terminal each view replaces the last; otherwise (a pipe, a log) views follow each other, each
    under a line with the time. ``--json`` prints one JSON object per line. An etcd error is shown in place
    of a view, and the next refresh tries again.
    """
    from elastic_train.etcd.errors import EtcdError

    stream = out or sys.stdout
    tty = stream.isatty()
    shown = 0
    try:
        while times is None or shown < times:
            if shown:
                time.sleep(interval)
            shown += 1
            try:
                st = read()
            except EtcdError as exc:
                lines = [f"elastic-train: error: {exc} (retrying every {interval:g} s)"]
            else:
                if as_json:
                    stream.write(json.dumps(st.to_json()) + "\n")
                    stream.flush()
                    continue
                lines = render(st) if st.exists else [f"no such run: {st.run_id} (yet)"]
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            head = f"{CLEAR}every {interval:g}s, at {stamp} (Ctrl-C stops)" if tty else f"--- {stamp}"
            stream.write("\n".join([head, *lines]) + "\n")
            stream.flush()
    except KeyboardInterrupt:
        pass
    return 0


def budget_line(st: JobStatus) -> str:
    """``failures: 2 in the last 1h of a budget of 10 (8 left), 5 in all; clean leaves: 3 (not counted)``."""
    from elastic_train.rendezvous.budget import window_text

    budget = "?" if st.failure_budget is None else str(st.failure_budget)
    left = "?" if st.failures_left is None else str(st.failures_left)
    if st.failure_window:
        counted = f"{st.failures_in_window} in the last {window_text(st.failure_window)}"
        total = f", {st.failures_used} in all"
    else:
        counted, total = f"{st.failures_used} over the run's life", ""
    return (
        f"failures: {counted} of a budget of {budget} ({left} left){total}; "
        f"clean leaves: {st.leaves} (not counted)"
    )


def render(st: JobStatus) -> list[str]:
    """The text form of a run's status."""
    when = time.strftime(" on %Y-%m-%d %H:%M:%S UTC", time.gmtime(st.closed_at)) if st.closed_at else ""
    if st.state == "finished":
        at = f" at step {st.finished_step}" if st.finished_step is not None else ""
        head = f"run {st.run_id}: finished{at}{when}, round {st.round}"
    elif st.state == "failed":
        head = f"run {st.run_id}: failed{when}: {st.message or 'no reason recorded'}"
    else:
        head = f"run {st.run_id}: {st.state}, round {st.round}, world size {st.world_size}"
    lines = [head, budget_line(st)]
    # Once a run ended (or all its nodes left) no member holds a lease any more: that is not a loss, and
    # nothing can wait for a round; the members shown are the last round's.
    ended = st.state in ENDED
    if ended and st.members:
        lines.append(f"last round (world size {st.world_size}; its nodes have left):")
    for m in st.members:
        lost = "" if m.alive or ended else "  (lost)"
        lines.append(f"  rank {m.rank}: {m.node} {m.addr or '-'}{lost}")
    if not ended:
        lines.append(f"waiting: {', '.join(st.waiting) if st.waiting else 'none'}")
    if st.stragglers and not ended:
        lines.append("slow nodes:")
        lines += [f"  {s.line()}" for s in st.stragglers]
    if st.unreadable:
        lines.append(f"unreadable keys: {', '.join(st.unreadable)}")
    if st.identity:
        shown = ", ".join(f"{k}={v}" for k, v in st.identity.items())
        lines.append(f"identity {st.fingerprint or '?'}: {shown}")
    if st.state == "stopped":
        lines.append(
            "no node holds the run and it did not finish: start it again to resume from its checkpoints"
        )
    if st.state == "failed":
        url = st.identity.get("checkpoint.url") or "CHECKPOINT_URL"
        lines.append(f"to continue: start a new run with --run-id NEW_ID --resume-from {url}/{st.run_id}")
    return lines
