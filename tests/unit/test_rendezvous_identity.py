"""Job identity: which settings are shared, how a refusal names the first differences, untrusted input."""

from __future__ import annotations

import json

import pytest

from elastic_train.config import load_job_config
from elastic_train.launch.identity import job_settings
from elastic_train.rendezvous.identity import JobIdentity, torchrun_settings


def identity(**overrides: object) -> JobIdentity:
    return JobIdentity(job_settings(load_job_config(None, {"checkpoint.url": "s3://a/ckpt", **overrides})))


def test_same_config_same_fingerprint_and_local_paths_are_absolute(tmp_path, monkeypatch) -> None:
    assert identity().fingerprint == identity().fingerprint
    monkeypatch.chdir(tmp_path)
    local = JobIdentity(job_settings(load_job_config(None, {"checkpoint.url": "ck/"})))
    assert local.settings["checkpoint.url"] == str(tmp_path / "ck")
    # settings that do not have to agree (logging, cadence, audit) leave the fingerprint alone
    assert (
        identity(**{"checkpoint.every_steps": 7, "train.log_every": 3}).fingerprint == identity().fingerprint
    )


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            {"checkpoint.url": "s3://b/ckpt"},
            "checkpoint.url=s3://a/ckpt; this node has checkpoint.url=s3://b/ckpt",
        ),
        ({"rendezvous.max_nodes": 2}, "rendezvous.max_nodes=1; this node has rendezvous.max_nodes=2"),
        ({"train.task_args": {"n": 1}}, 'train.task_args={}; this node has train.task_args={"n": 1}'),
        ({"train.shares": "speed"}, "train.shares=even; this node has train.shares=speed"),
        ({"train.fsdp": True}, "train.fsdp=false; this node has train.fsdp=true"),
        (
            {"train.fsdp": True, "train.mixed_precision": "bfloat16"},
            "train.fsdp=false, train.mixed_precision=none; "
            "this node has train.fsdp=true, train.mixed_precision=bfloat16",
        ),
        (
            {"checkpoint.url": "s3://b/ckpt", "train.seed": 9, "train.steps": 5},
            "checkpoint.url=s3://a/ckpt, train.seed=0; "
            "this node has checkpoint.url=s3://b/ckpt, train.seed=9",
        ),
    ],
)
def test_refusal_names_the_first_differences_in_order(overrides: dict, line: str) -> None:
    theirs, mine = identity(), identity(**overrides)
    assert theirs.fingerprint != mine.fingerprint
    assert theirs.refusal("job-42", mine) == f"run job-42 is training with {line}"


def test_long_values_are_shortened_and_unset_settings_named() -> None:
    theirs = JobIdentity(torchrun_settings(1, 2, None))
    mine = JobIdentity(torchrun_settings(1, 2, 4))
    assert theirs.refusal("r", mine) == (
        "run r is training with rendezvous.nproc_per_node=(unset); this node has rendezvous.nproc_per_node=4"
    )
    long = identity(**{"checkpoint.url": "s3://" + "x" * 200})
    assert len(identity().refusal("r", long)) < 250 and "…" in identity().refusal("r", long)


@pytest.mark.parametrize("raw", [b"\xff", b"[1]", b'{"settings": [1]}', b"{}", b'{"settings": {"1": 2}'])
def test_an_identity_read_back_from_etcd_is_untrusted(raw: bytes) -> None:
    with pytest.raises(ValueError):
        JobIdentity.decode(raw)


def test_round_trip_through_etcd_value_and_environment() -> None:
    ident = identity()
    assert JobIdentity.decode(ident.encode(time=1.0, node="n")).fingerprint == ident.fingerprint
    assert json.loads(ident.encode())["fingerprint"] == ident.fingerprint
    assert JobIdentity.from_json(ident.to_json()) == ident
