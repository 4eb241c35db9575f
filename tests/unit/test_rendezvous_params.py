"""rdzv-conf parsing, torchrun flags, password sources."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_train.errors import ConfigError
from elastic_train.rendezvous.config import RendezvousConfig, TLSConfig
from elastic_train.rendezvous.params import config_from_params, rdzv_conf, read_password, torchrun_args


def params(**conf) -> RendezvousParameters:
    return RendezvousParameters("etcd3", "127.0.0.1:2379", "job-1", 2, 4, local_addr="127.0.0.1", **conf)


def test_rdzv_conf_keys_become_config_values():
    cfg = config_from_params(
        params(lease_ttl="2", settle="0.5", timeout="900", failure_budget="3", ca_file="/ca.pem", user="u")
    )
    assert (cfg.lease_ttl, cfg.settle, cfg.join_timeout, cfg.failure_budget) == (2.0, 0.5, 900.0, 3)
    assert cfg.tls == TLSConfig(ca_file="/ca.pem") and cfg.user == "u"
    assert (cfg.min_nodes, cfg.max_nodes, cfg.run_id) == (2, 4, "job-1")


def test_explicit_join_timeout_wins_over_torchruns_timeout():
    assert config_from_params(params(timeout="900", join_timeout="60")).join_timeout == 60.0


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ({"last_call_timeout": "1"}, "unknown key 'last_call_timeout'"),
        ({"lease_ttl": "soon"}, "lease_ttl='soon' is not a number"),
        ({"lease_ttl": "0.1"}, "lease_ttl"),
        ({"cert_file": "/c.pem"}, "cert_file/key_file"),
    ],
)
def test_bad_rdzv_conf_is_one_clear_config_error(conf, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        config_from_params(params(**conf))


def test_invalid_run_id_is_refused():
    with pytest.raises(ConfigError, match="run_id"):
        config_from_params(RendezvousParameters("etcd3", "h:1", "../etc", 1, 1))


def test_torchrun_args_round_trip_without_secrets():
    cfg = RendezvousConfig(
        endpoint="10.0.0.1:2379",
        run_id="r1",
        min_nodes=2,
        max_nodes=8,
        nproc_per_node=2,
        settle=0.5,
        user="bob",
    )
    args = torchrun_args(cfg)
    assert args[:5] == [
        "--nnodes=2:8",
        "--nproc-per-node=2",
        "--rdzv-backend=etcd3",
        "--rdzv-endpoint=10.0.0.1:2379",
        "--rdzv-id=r1",
    ]
    conf = dict(kv.split("=", 1) for kv in args[5].removeprefix("--rdzv-conf=").split(","))
    assert conf == rdzv_conf(cfg)
    assert "password" not in conf and conf["settle"] == "0.5" and conf["user"] == "bob"
    back = config_from_params(RendezvousParameters("etcd3", cfg.endpoint, cfg.run_id, 2, 8, **conf))
    assert (back.settle, back.user, back.failure_budget) == (0.5, "bob", cfg.failure_budget)


def test_password_from_env_then_file(tmp_path, monkeypatch):
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    cfg = RendezvousConfig(user="u", password_env="MY_PW", password_file=str(f))
    monkeypatch.delenv("MY_PW", raising=False)
    assert read_password(cfg) == "from-file"
    monkeypatch.setenv("MY_PW", "from-env")
    assert read_password(cfg) == "from-env"
    assert read_password(RendezvousConfig()) is None


def test_user_without_password_is_a_config_error(monkeypatch):
    monkeypatch.delenv("NOPE_PW", raising=False)
    with pytest.raises(ConfigError, match=r"\$NOPE_PW"):
        read_password(RendezvousConfig(user="u", password_env="NOPE_PW"))
