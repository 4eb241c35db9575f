"""Config loading: good files load; every kind of bad input is one precise ConfigError."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_train.config import JobConfig, apply_overrides, from_dict, load_job_config, parse_override
from elastic_train.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_example_job_loads() -> None:
    cfg = load_job_config(str(ROOT / "examples" / "job.yaml"))
    assert isinstance(cfg, JobConfig)
    assert cfg.rendezvous.run_id == "demo"
    assert (cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes) == (2, 4)
    assert cfg.train.task == "charlm"


def test_defaults_without_file() -> None:
    cfg = load_job_config(None, environ={})
    assert cfg == JobConfig()


def test_nested_values_and_types(tmp_path: Path) -> None:
    cfg = load_job_config(
        write(
            tmp_path,
            """
            rendezvous: {endpoint: "127.0.0.2:2379", lease_ttl: 2, tls: {ca_file: /ca.pem}}
            train: {task_args: {hidden: 8}, steps: 7}
            """,
        ),
        environ={},
    )
    assert cfg.rendezvous.lease_ttl == 2.0 and isinstance(cfg.rendezvous.lease_ttl, float)
    assert cfg.rendezvous.tls is not None and cfg.rendezvous.tls.ca_file == "/ca.pem"
    assert cfg.train.task_args == {"hidden": 8}
    assert cfg.train.steps == 7


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("checkpoint: {keep_lastt: 3}", "checkpoint.keep_lastt: unknown key (did you mean keep_last?)"),
        ("trian: {}", "trian: unknown key (did you mean train?)"),
        ("train: {steps: ten}", "train.steps: expected an integer, got 'ten' (str)"),
        ("train: {steps: 0}", "train.steps: 0 must be >= 1"),
        ("train: {steps: 1.5}", "train.steps: expected an integer, got 1.5 (float)"),
        ("train: {mixed_precision: fp8}", "train.mixed_precision: 'fp8' is not one of none, bfloat16"),
        ("train: {mixed_precision: bfloat16}", "train.mixed_precision: bfloat16 needs fsdp: true"),
        ("checkpoint: {async_write: 1}", "checkpoint.async_write: expected a boolean, got 1 (int)"),
        ("checkpoint: {on_error: ignore}", "checkpoint.on_error: 'ignore' is not one of retry, log, fatal"),
        ("rendezvous: {min_nodes: 3, max_nodes: 2}", "rendezvous.max_nodes: 2 must be >= min_nodes (3)"),
        ("rendezvous: {run_id: 'a/b'}", "rendezvous.run_id: 'a/b' is invalid"),
        ("rendezvous: {endpoint: 'h:x'}", "rendezvous.endpoint: etcd endpoint 'h:x': port 'x' is not"),
        ("rendezvous: {tls: {cert_file: c.pem}}", "rendezvous.tls.cert_file/key_file: give both or neither"),
        ("rendezvous: []", "rendezvous: expected a mapping, got [] (list)"),
        ("logging: {level: loud}", "logging.level: 'loud' is not one of debug, info, warning, error"),
        ("- just\n- a list", "expected a mapping at the top level, got list"),
        ("train: {steps: [1, 2", "malformed YAML at line"),
    ],
)
def test_bad_input_is_one_precise_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job_config(write(tmp_path, text), environ={})
    text_out = str(info.value)
    assert message in text_out
    assert "\n" not in text_out


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_job_config("/nonexistent/job.yaml")


def test_precedence_file_env_cli(tmp_path: Path) -> None:
    path = write(tmp_path, "checkpoint: {url: from-file, every_steps: 5}\nrendezvous: {run_id: file-id}")
    env = {"ELASTIC_TRAIN_CHECKPOINT_URL": "from-env", "ELASTIC_TRAIN_RUN_ID": "env-id"}
    cfg = load_job_config(path, {"checkpoint.url": "from-cli"}, environ=env)
    assert cfg.checkpoint.url == "from-cli"
    assert cfg.checkpoint.every_steps == 5
    assert cfg.rendezvous.run_id == "env-id"


def test_overrides_are_validated_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint.every_steps: -1 must be >= 0"):
        load_job_config(None, {"checkpoint.every_steps": -1}, environ={})
    with pytest.raises(ConfigError, match="train.stepz: unknown key"):
        load_job_config(None, {"train.stepz": 3}, environ={})


def test_parse_override() -> None:
    assert parse_override("train.steps=12") == ("train.steps", 12)
    assert parse_override("checkpoint.url=s3://b/x") == ("checkpoint.url", "s3://b/x")
    assert parse_override("train.task_args={hidden: 4}") == ("train.task_args", {"hidden": 4})
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override("train.steps")


def test_apply_overrides_does_not_mutate() -> None:
    data = {"train": {"steps": 1}}
    out = apply_overrides(data, {"train.steps": 2, "checkpoint.url": "x"})
    assert data == {"train": {"steps": 1}}
    assert out == {"train": {"steps": 2}, "checkpoint": {"url": "x"}}
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides({"train": 3}, {"train.steps": 2})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        from_dict(JobConfig, [1, 2])


def test_cli_reports_usage_error_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "invalid choice" in proc.stderr


def test_yaml_aliases_used_normally_still_work(tmp_path) -> None:
    from elastic_train.config.loader import safe_load_bounded

    job = tmp_path / "job.yaml"
    job.write_text("x-args: &args {n_samples: 64}\ntrain: {task: regression, task_args: *args, steps: 7}\n")
    data = safe_load_bounded(job.read_text())
    assert data["train"]["task_args"] == {"n_samples": 64}
    job.write_text("train: {task: regression, task_args: &args {n_samples: 64}, steps: 7}\n")
    assert load_job_config(str(job)).train.task_args == {"n_samples": 64}
    doc = "defaults: &d {every_steps: 5}\nother: *d\n"
    assert safe_load_bounded(doc) == {"defaults": {"every_steps": 5}, "other": {"every_steps": 5}}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            )
            + "train: {steps: 1}\n",
            "aliases expand to more than",
        ),
        ("a: &a [1, *a]\n", "refers to a value that contains it"),
    ],
)
def test_yaml_alias_bombs_are_refused_fast(tmp_path, text: str, needle: str) -> None:
    import time

    job = tmp_path / "job.yaml"
    job.write_text(text)
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=needle):
        load_job_config(str(job))
    assert time.perf_counter() - t < 1.0


def test_an_oversized_config_file_is_refused_unread(tmp_path) -> None:
    from elastic_train.config.loader import MAX_CONFIG_BYTES

    job = tmp_path / "job.yaml"
    job.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        load_job_config(str(job))
