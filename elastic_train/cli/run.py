"""``elastic-train run job.yaml``: start this node of an elastic job (torchrun agent + workers)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from elastic_train.cli.options import node_overrides
from elastic_train.config import load_job_config
from elastic_train.config.options import add_job_options, collect_overrides
from elastic_train.errors import ConfigError
from elastic_train.worker.forkserver import ENV_PRELOAD, parse_preload

#: How workers start: ``forkserver`` (forked from a per-node process with torch imported) or ``exec``.
WORKER_STARTS = ("forkserver", "exec")
#: Environment variable holding the default of ``--worker-start``.
ENV_WORKER_START = "ELASTIC_TRAIN_WORKER_START"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run this node of an elastic job (torchrun agent with the etcd3 rendezvous)",
        description="Builds and runs this node's torchrun launch with --rdzv-backend=etcd3. "
        "Start the same command on every node.",
    )
    p.add_argument("config", nargs="?", help="job.yaml (default: built-in defaults)")
    p.add_argument("--nodes", metavar="MIN:MAX", help="node counts (rendezvous.min_nodes/max_nodes)")
    p.add_argument(
        "--local-addr", help="address this node advertises (default: loopback for a loopback etcd)"
    )
    add_job_options(p)
    p.add_argument(
        "--worker-start",
        choices=WORKER_STARTS,
        default=os.environ.get(ENV_WORKER_START, WORKER_STARTS[0]),
        help="forkserver: fork workers from a per-node process that already imported torch (fast restarts); "
        "exec: a fresh interpreter per worker (default: forkserver)",
    )
    p.add_argument(
        "--preload",
        metavar="MOD[,MOD]",
        default=os.environ.get(ENV_PRELOAD, ""),
        help="modules the fork server imports before forking workers (e.g. elastic_train.lightning), so a "
        "restarted worker does not import them again",
    )
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument(
        "--entry",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT|-m MODULE ...",
        help="run your own torchrun training script (and its arguments: everything after --entry) instead of "
        "elastic_train.worker, with the etcd3 rendezvous and fork-server worker starts",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elastic_train.launch import run as launch_run

    try:
        preload = parse_preload(args.preload)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    overrides = collect_overrides(args, node_overrides(args.nodes))
    cfg = load_job_config(args.config, overrides)
    local_addr = args.local_addr or launch_run.default_local_addr(cfg.rendezvous)
    argv = launch_run.torchrun_argv(
        cfg, config_path=args.config, overrides=overrides, local_addr=local_addr, entry=args.entry
    )
    if args.dry_run:
        print(shlex.join([sys.executable, "-m", "torch.distributed.run", *argv]))
        return 0
    launch_run.prepare_environment(cfg, local_addr, os.environ, own_entry=bool(args.entry))
    launch_run.preflight_storage(cfg)
    # The fork server next: forked once this process imported torch and before anything starts a thread
    # (the checkpoint settings' check imports torch, etcd's gRPC channel leaves threads), so that torch is
    # imported once per node and the server's own imports (torch._dynamo, a second or more) run while this
    # process checks etcd and joins: a node that joins a running job trains that much sooner.
    forkserver = (
        launch_run.ForkServerSupervisor(os.environ, preload, fork=True)
        if args.worker_start == "forkserver"
        else None
    )

    def ready() -> None:
        if forkserver is not None and preload:
            from elastic_train.worker.forkserver import CONNECT_WAIT

            # join with the imports done (its worker would make the restarted group wait for them)
            forkserver.wait_ready(CONNECT_WAIT)
        launch_run.start_barrier(os.environ)

    try:
        launch_run.preflight_etcd(cfg)
        if not args.entry:
            from elastic_train.checkpoint.preflight import check_settings

            check_settings(cfg.checkpoint, cfg.rendezvous.run_id)
        return launch_run.launch(argv, before_rendezvous=ready)
    finally:
        if forkserver is not None:
            forkserver.stop()
