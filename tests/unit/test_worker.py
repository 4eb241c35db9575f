"""Worker entry: torchrun env parsing, option overrides, one-line errors, cheap import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.config.options import collect_overrides
from elastic_train.elastic import resolve_backend
from elastic_train.errors import ConfigError
from elastic_train.node import Assignment
from elastic_train.train.env import WorkerEnv
from elastic_train.worker.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def assigned(round_: int) -> Assignment:
    """What an etcd3 agent tells its workers of their round."""
    return Assignment(round=round_, node_rank=0, nodes=1, master_addr="127.0.0.1", master_port=29500)


def test_env_from_torchrun_variables() -> None:
    env = WorkerEnv.from_environ(
        {
            "RANK": "2",
            "WORLD_SIZE": "3",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "4",
            "TORCHELASTIC_RUN_ID": "job-1",
            "MASTER_ADDR": "127.0.0.2",
            "MASTER_PORT": "29500",
        },
        assigned(9),
    )
    assert (env.rank, env.world_size, env.local_rank, env.round, env.restart_count) == (2, 3, 0, 9, 4)
    assert (env.run_id, env.master_addr, env.master_port) == ("job-1", "127.0.0.2", 29500)


def test_group_generation_names_the_worker_group() -> None:
    base = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    single_node = WorkerEnv.from_environ({**base, "LOCAL_WORLD_SIZE": "2"})
    assert single_node.agent_store and single_node.group_generation == "restart-3"
    assert WorkerEnv.from_environ({**base, "LOCAL_WORLD_SIZE": "1"}).group_generation is None
    assert (
        WorkerEnv.from_environ({**base, "LOCAL_WORLD_SIZE": "1"}, assigned(7)).group_generation == "round-7"
    )


def test_env_round_falls_back_to_restart_count_and_defaults_to_single_process() -> None:
    assert (
        WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "3"}).round == 3
    )
    alone = WorkerEnv.from_environ({})
    assert (alone.rank, alone.world_size, alone.run_id, alone.master_port) == (0, 1, None, 0)


@pytest.mark.parametrize(
    ("environ", "message"),
    [({"RANK": "x"}, "RANK='x': expected an integer"), ({"RANK": "3", "WORLD_SIZE": "2"}, "inconsistent")],
)
def test_env_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerEnv.from_environ(environ)


def test_set_wins_over_the_dedicated_options_as_in_the_cli() -> None:
    args = build_parser().parse_args(
        [
            "--set",
            "train.steps=5",
            "--set",
            "train.seed=3",
            "--steps",
            "7",
            "--audit",
            "/a",
            "--checkpoint-every",
            "2",
        ]
    )
    assert collect_overrides(args) == {
        "train.steps": 5,
        "train.seed": 3,
        "train.audit_dir": "/a",
        "checkpoint.every_steps": 2,
    }


def test_worker_takes_only_its_dedicated_options() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--endpoint", "127.0.0.1:2379"])


def test_backend_choice() -> None:
    assert resolve_backend("auto", cuda=False) == "gloo"
    assert resolve_backend("auto", cuda=True) == "nccl"
    assert resolve_backend("gloo", cuda=True) == "gloo"


def run_worker(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_train.worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", **env},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "/nonexistent/job.yaml"], "/nonexistent/job.yaml: no such config file"),
        (["--set", "train.stepz=3"], "train.stepz: unknown key (did you mean steps?)"),
        (["--steps", "0"], "train.steps: 0 must be >= 1"),
    ],
)
def test_bad_config_is_one_line_exit_2(args: list[str], message: str) -> None:
    proc = run_worker(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"elastic_train.worker: error: {message}"]


def test_bad_task_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = run_worker("--set", "train.task=nosuch", "--checkpoint", str(tmp_path))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("elastic_train.worker: error: rank 0: train.task: 'nosuch' is neither a built-in task")
    )


def test_single_process_run_trains_and_checkpoints(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = run_worker(
        "--set",
        "train.task=regression",
        "--set",
        "train.global_batch=8",
        "--set",
        "checkpoint.memory=False",
        "--steps",
        "6",
        "--checkpoint",
        str(tmp_path / "ck"),
        "--audit",
        str(tmp_path / "audit"),
        ELASTIC_TRAIN_EVENTS=str(events),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from elastic_train.train.audit import check_exactly_once
    from elastic_train.train.events import read_events

    kinds = [e["event"] for e in read_events(str(events))]
    assert kinds == ["started", *["step"] * 6, "checkpoint", "done"]
    assert check_exactly_once(str(tmp_path / "audit"), steps=6).ok
    assert (tmp_path / "ck" / "elastic-train" / "step-00000006" / "manifest.json").exists()
    assert '"event": "worker_ready"' in proc.stderr


def test_worker_import_is_cheap() -> None:
    """The entry module must not import heavy optional packages before they are needed."""
    code = (
        "import sys, elastic_train.worker.main; "
        "print(sorted(m for m in ('etcd3', 'grpc', 's3fs') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]"


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, from its source."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value).strip()  # type: ignore[union-attr]
    return docs


def test_docs_config_reference_matches_train_config() -> None:
    import dataclasses

    from elastic_train.train.config import TrainConfig

    text = (ROOT / "docs" / "training.md").read_text()
    table = text.split("## Configuration reference (`train:`)", 1)[1]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0] != "`key`":
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    docs = _field_docs(TrainConfig)
    expected = {}
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        expected[f.name] = (str(default), docs[f.name])
    assert rows == expected
