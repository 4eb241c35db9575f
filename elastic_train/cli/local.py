"""``elastic-train local``: the whole elastic job on this machine (embedded etcd, N nodes, faults)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from elastic_train.config import load_job_config
from elastic_train.config.options import add_job_options, collect_overrides, dest
from elastic_train.errors import ConfigError
from elastic_train.launch.faults import KINDS, Fault, parse_fault, spec_form, validate_plan

if TYPE_CHECKING:
    from elastic_train.config import JobConfig
    from elastic_train.launch.local import LocalJob

EPILOG = """examples:
  elastic-train local --nodes 3 --min-nodes 2 --max-nodes 4 --kill-node 1@step=30 --add-node @step=70
  elastic-train local --config examples/job.yaml --hang-node 2@step=50 --summary run.json
  elastic-train local --nodes 3 --kill-node 1@step=20 --add-node @step=40 --entry examples/own_loop.py
  elastic-train local --nodes 3 --slow-node 1@step=20,factor=2,for=15
"""

#: Options that configure the built-in worker only; a script given with --entry takes its own arguments.
WORKER_ONLY = ("--checkpoint", "--checkpoint-every", "--resume-from", "--task", "--seed")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "local",
        help="run a whole elastic job on this machine, with faults on request",
        description="Starts an embedded etcd and N nodes (torchrun agents with their workers) on loopback, "
        "trains, injects the faults asked for, and reports detection/recovery times, steps redone, the "
        "world-size timeline and the exactly-once verdict.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="job.yaml (default: built-in defaults)")
    p.add_argument(
        "--nodes",
        dest="initial_nodes",
        type=int,
        default=3,
        help="nodes started at the beginning (default 3)",
    )
    p.add_argument("--min-nodes", type=int, help="fewest nodes the job trains with")
    p.add_argument("--max-nodes", type=int, help="most nodes the job trains with")
    for kind in KINDS:
        p.add_argument(
            f"--{kind}", action="append", default=[], metavar=spec_form(kind), help=f"inject {kind}"
        )
    p.add_argument("--workdir", help="logs, events, audit (default runs/RUN_ID)")
    p.add_argument("--summary", metavar="FILE", help="write the summary as JSON here")
    p.add_argument("--plot", metavar="FILE", help="write a PNG timeline here (needs the [plot] extra)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    p.add_argument(
        "--etcd-members",
        type=int,
        default=1,
        choices=(1, 3, 5),
        help="members of the job's etcd (3 or 5 for --kill-etcd-leader and --etcd-quorum-loss)",
    )
    add_job_options(p, without=["--endpoint"])
    p.add_argument(
        "--preload",
        metavar="MOD[,MOD]",
        help="modules each node's fork server imports before forking workers (elastic-train run --preload)",
    )
    p.add_argument(
        "--entry",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT|-m MODULE ...",
        help="train your own torchrun script (and its arguments: everything after --entry) instead of the "
        "built-in worker; it uses the elastic_train API, whose sampler writes the audit lines. --steps, "
        "if given, is the number of steps the script trains (for the fault plan and the summary)",
    )
    p.set_defaults(func=run)


def plan_faults(args: argparse.Namespace) -> list[Fault]:
    faults = [parse_fault(kind, spec) for kind in KINDS for spec in getattr(args, kind.replace("-", "_"))]
    return sorted(faults, key=lambda f: f.step)


def run(args: argparse.Namespace) -> int:
    from elastic_train.launch.local import LocalJob, LocalOptions, render_table, write_summary

    faults = plan_faults(args)
    if args.initial_nodes < 1:
        raise ConfigError(f"--nodes {args.initial_nodes}: must be >= 1")
    entry = args.entry
    if entry == []:
        raise ConfigError("--entry: needs a script (or -m MODULE) to run")
    if entry:
        for option in WORKER_ONLY:
            if getattr(args, dest(option), None) is not None:
                raise ConfigError(f"{option}: not used with --entry (pass your script its own arguments)")
    if args.preload:
        from elastic_train.worker.forkserver import ENV_PRELOAD, parse_preload

        try:
            parse_preload(args.preload)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        os.environ[ENV_PRELOAD] = args.preload  # the nodes' `elastic-train run` take it as their --preload
    overrides = collect_overrides(args)
    base = load_job_config(args.config, overrides)
    adds = sum(f.kind == "add-node" for f in faults)
    if "rendezvous.run_id" not in overrides:
        # The time names the run for a reader; the random tail keeps two jobs started in the same second
        # apart (their snapshots in /dev/shm, their runs/<id> directories and durable checkpoints).
        stamp = time.strftime("%Y%m%d-%H%M%S")
        overrides["rendezvous.run_id"] = f"{base.rendezvous.run_id}-{stamp}-{secrets.token_hex(2)}"
    overrides["rendezvous.min_nodes"] = args.min_nodes or (
        base.rendezvous.min_nodes if args.config else max(1, args.initial_nodes - 1)
    )
    overrides["rendezvous.max_nodes"] = args.max_nodes or max(
        base.rendezvous.max_nodes, args.initial_nodes + adds
    )
    workdir = args.workdir or os.path.join("runs", str(overrides["rendezvous.run_id"]))
    if "train.audit_dir" not in overrides and not base.train.audit_dir:
        overrides["train.audit_dir"] = os.path.abspath(os.path.join(workdir, "audit"))
    cfg = load_job_config(args.config, overrides)
    if args.initial_nodes > cfg.rendezvous.max_nodes:
        raise ConfigError(f"--nodes {args.initial_nodes}: more than max nodes ({cfg.rendezvous.max_nodes})")
    steps_known = not entry or args.steps is not None
    validate_plan(
        faults, args.initial_nodes, cfg.train.steps if steps_known else sys.maxsize, args.etcd_members
    )
    if not entry:  # a script keeps its checkpoints where it says
        from elastic_train.checkpoint.preflight import check_settings

        check_settings(cfg.checkpoint, cfg.rendezvous.run_id)

    job = LocalJob(cfg, LocalOptions(config_path=args.config, overrides=overrides, nodes=args.initial_nodes,
                                     faults=faults, workdir=workdir, timeout=args.timeout,
                                     etcd_members=args.etcd_members, entry=entry))  # fmt: skip
    # SIGTERM (a CI timeout, `kill`) ends the job like Ctrl-C does: every node, etcd and the snapshots are
    # cleaned up; the nodes run in sessions of their own and would otherwise train on unwatched
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    summary = job.run()
    if not steps_known:  # a script decides its own length
        summary.steps = summary.completed_steps
    summary.exactly_once = _check_exactly_once(cfg, job, from_meta=bool(entry))
    print()
    print(render_table(summary))
    if args.summary:
        write_summary(summary, args.summary)
        print(f"summary written to {args.summary}")
    plot_path = args.plot or (os.path.splitext(args.summary)[0] + ".png" if args.summary else None)
    if plot_path:
        from elastic_train.launch.plot import plot_timeline

        if plot_timeline(job.step_events, summary, plot_path, t0=job.t0, required=bool(args.plot)):
            print(f"timeline plotted to {plot_path}")
    ok = summary.succeeded and (summary.exactly_once is None or bool(summary.exactly_once.get("ok")))
    if not summary.succeeded:
        status = job.final_status
        if status is not None and status.state == "failed" and status.message:
            where = f"the node logs in {workdir} have the full error"
            sys.stderr.write(f"elastic-train: error: run {job.run_id} failed: {status.message}; {where}\n")
            return 2 if 2 in summary.node_exit_codes.values() else 1
        sys.stderr.write(f"elastic-train: error: the job did not finish; see the node logs in {workdir}\n")
    return 0 if ok else 1


def _check_exactly_once(cfg: JobConfig, job: LocalJob, *, from_meta: bool = False) -> dict[str, Any] | None:
    """The audit verdict; ``from_meta``: the global batch is the one the sampler recorded (a user script)."""
    from elastic_train.train.audit import check_exactly_once

    audit_dir = cfg.train.audit_dir
    if not audit_dir or not os.path.isdir(audit_dir):
        return None
    first = 1 if job.resumed_from_step is None else job.resumed_from_step + 1
    global_batch = None if from_meta else cfg.train.global_batch
    report = check_exactly_once(
        audit_dir, steps=job.completed_step, global_batch=global_batch, first_step=first
    )
    return report.to_json()


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
