"""Worker entry point: parse, load the config, configure logging, run; known errors become one line.

torchrun's failure summary names what went wrong in a worker: ``main`` is wrapped in torch's ``@record``, so
an unexpected exception lands in the worker's error file (``TORCHELASTIC_ERROR_FILE``) with its traceback,
and a known error's one line is written there too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train.config import load_job_config
from elastic_train.config.options import OneLineParser, add_job_options, collect_overrides
from elastic_train.errors import ElasticTrainError, is_non_retryable
from elastic_train.log import bind_context, configure_logging
from elastic_train.node import Outcome, WorkerChannel

PROG = "elastic_train.worker"


#: The dedicated options of the worker (see :mod:`elastic_train.config.options`); ``--set`` sets any key.
OPTIONS = ("--checkpoint", "--checkpoint-every", "--resume-from", "--audit", "--steps")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=f"python -m {PROG}", description="One elastic training worker (run by torchrun).")
    p.add_argument("--config", help="job.yaml (default: built-in defaults)")
    add_job_options(p, OPTIONS)
    return p


#: Where torchrun's agent reads a failed worker's error (set by the agent for every worker).
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def report_error(exc: ElasticTrainError, prefix: str = "") -> int:
    """Print a known error as one line and leave it in torchrun's error file; its exit code."""
    line = f"{prefix}{exc}"
    sys.stderr.write(f"{PROG}: error: {line}\n")
    path = os.environ.get(ENV_ERROR_FILE)
    if path:
        # torch's ErrorHandler format; the one line stands in for a traceback in the agent's summary.
        message = f"{type(exc).__name__}: {line}"
        data = {
            "message": {
                "message": message,
                "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
            }
        }
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    return exc.exit_code


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        from elastic_train.train.link import worker_env

        cfg = load_job_config(args.config, collect_overrides(args))
        env = worker_env()
    except ElasticTrainError as exc:
        _report_failure(exc, os.environ.get("RANK", "0"))
        return report_error(exc)
    configure_logging(cfg.logging)
    bind_context(
        run_id=env.run_id or cfg.rendezvous.run_id, rank=env.rank, world_size=env.world_size, round=env.round
    )
    try:
        from elastic_train.worker.run import run_worker

        code = run_worker(cfg, env, started=started)
    except ElasticTrainError as exc:
        _report_failure(exc, env.rank)
        return report_error(exc, f"rank {env.rank}: ")
    except Exception as exc:  # torch's @record and the interpreter show it; the agent learns what it was
        from elastic_train.train.link import process_link

        process_link().report_exit(exc)
        raise
    if code == 0:
        _report(Outcome(env.rank, "finished", step=cfg.train.steps))
    return code


def _report_failure(exc: ElasticTrainError, rank: int | str) -> None:
    """Tell the agent how this worker failed: for good when no restart can fix it (it then ends the job
    instead of retrying), else what it exits with (the start-up failure rule)."""
    if is_non_retryable(exc):
        _report(Outcome(int(rank) if str(rank).isdigit() else 0, "failed", message=str(exc)))
    else:
        from elastic_train.train.link import process_link

        process_link().report_exit(exc, code=exc.exit_code)


def _report(outcome: Outcome) -> None:
    """Leave ``outcome`` for this worker's agent (nothing outside an ``etcd3`` agent)."""
    channel = WorkerChannel.from_environ(os.environ)
    if channel is not None:
        channel.report(outcome)
