"""rdzv-conf parsing, torchrun flags, password sources."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_train.errors import ConfigError
from elastic_train.etcd.config import TLSConfig
from elastic_train.rendezvous.config import RendezvousConfig
from elastic_train.rendezvous.params import config_from_params, parse_params, rdzv_conf, torchrun_args


def params(**conf) -> RendezvousParameters:
    return RendezvousParameters("etcd3", "127.0.0.1:2379", "job-1", 2, 4, local_addr="127.0.0.1", **conf)


def dynamic(**conf):
    return parse_params(params(**conf), backend="etcd3-dynamic")


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
        ({"bogus": "1"}, "unknown key 'bogus' (known: lease_ttl, settle"),
        ({"lease_ttl": "soon"}, "lease_ttl='soon' is not a number"),
        ({"lease_ttl": "0.1"}, "lease_ttl"),
        ({"cert_file": "/c.pem"}, "cert_file/key_file"),
        ({"read_timeout": "abc"}, "rdzv-conf: read_timeout='abc' is not a number"),
        ({"read_timeout": "nan"}, "read_timeout='nan' is not a number"),
        ({"read_timeout": "-1"}, "read_timeout: -1 must be > 0 seconds"),
        ({"state_ttl": "60"}, "state_ttl applies to --rdzv-backend=etcd3-dynamic only"),
        ({"protocol": "ftp"}, "protocol='ftp' must be http or https"),
        ({"protocol": "https"}, "protocol=https needs ca_file (or ca_cert)"),
        ({"protocol": "http", "ca_cert": "/ca.pem"}, "protocol=http contradicts ca_file (TLS); use https"),
        ({"ca_cert": "/a.pem", "ca_file": "/b.pem"}, "ca_cert and ca_file name the same file; give one"),
    ],
)
def test_bad_rdzv_conf_is_one_clear_config_error(conf, needle):
    with pytest.raises(ConfigError) as info:
        config_from_params(params(**conf))
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ({"last_call_timeout": "1.5"}, "last_call_timeout='1.5' is not a whole number"),
        ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt: 0 must be >= 1"),
        ({"state_ttl": "ten"}, "state_ttl='ten' is not a whole number"),
        ({"state_ttl": "5"}, "state_ttl: 5 s must exceed keep_alive_interval (5 s)"),
        ({"state_ttl": "3", "keep_alive_interval": "3"}, "must exceed keep_alive_interval (3 s)"),
        ({"user": "u", "bogus": "x"}, "unknown key 'bogus'"),
    ],
)
def test_bad_etcd3_dynamic_conf_is_one_clear_config_error(conf, needle):
    with pytest.raises(ConfigError) as info:
        dynamic(**conf)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_read_timeout_is_a_store_option_of_both_handlers():
    assert parse_params(params()).store.read_timeout is None  # the handler's own default
    assert parse_params(params(read_timeout="7.5")).store.read_timeout == 7.5
    assert dynamic(read_timeout="120").store.read_timeout == 120.0


def test_etcd3_dynamic_takes_torchs_dynamic_keys_and_state_ttl():
    parsed = dynamic(
        timeout="900", join_timeout="60", last_call_timeout="1", keep_alive_interval="2", state_ttl="30"
    )
    assert parsed.store.state_ttl == 30
    assert parsed.store.dynamic == {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 2}
    assert parsed.ignored == {}
    assert dynamic().store.state_ttl == 7200  # torch's etcd-v2 state TTL
    assert dynamic(timeout="900").ignored == {}  # torchrun always passes it; torch's handler does not read it


def test_torch_keys_without_a_meaning_here_are_ignored_with_a_reason():
    parsed = parse_params(
        params(last_call_timeout="1", keep_alive_interval="1", store_type="tcp", is_host="1")
    )
    assert set(parsed.ignored) == {"last_call_timeout", "keep_alive_interval", "store_type", "is_host"}
    assert "settle" in parsed.ignored["last_call_timeout"]
    assert set(dynamic(store_type="file").ignored) == {"store_type"}
    assert set(dynamic(lease_ttl="2", settle="1", failure_budget="3").ignored) == {
        "lease_ttl",
        "settle",
        "failure_budget",
    }


def test_etcd_v2_tls_names_are_aliases():
    cfg = config_from_params(
        params(protocol="HTTPS", ca_cert="/ca.pem", ssl_cert="/c.pem", ssl_cert_key="/k.pem")
    )
    assert cfg.tls == TLSConfig(ca_file="/ca.pem", cert_file="/c.pem", key_file="/k.pem")
    assert config_from_params(params(protocol="http")).tls is None


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
    assert cfg.read_password() == "from-file"
    monkeypatch.setenv("MY_PW", "from-env")
    assert cfg.read_password() == "from-env"
    assert RendezvousConfig().read_password() is None


def test_user_without_password_is_a_config_error(monkeypatch):
    monkeypatch.delenv("NOPE_PW", raising=False)
    with pytest.raises(ConfigError, match=r"\$NOPE_PW"):
        RendezvousConfig(user="u", password_env="NOPE_PW").read_password()
