"""Failed etcd calls classified by cause, on the detail texts gRPC really produces (collected against real
etcd, a silent port, a port whose SYNs are dropped, and TLS mismatches on loopback)."""

from __future__ import annotations

import grpc
import pytest

from elastic_train.etcd.causes import PARTITION_SILENCE, Cause, classify, describe, is_tls_error, is_transient

U, D = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
LAST = "failed to connect to all addresses; last error: "
IP = LAST + "UNKNOWN: ipv4:127.0.0.1:1: "


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "cause"),
    [
        (U, IP + "Failed to connect to remote host: Connection refused", Cause.REFUSED),
        (U, IP + "tcp handshaker shutdown", Cause.NO_ANSWER),
        (U, IP + "connection attempt timed out before receiving SETTINGS frame",
         Cause.NO_ANSWER),
        (U, LAST + "UNAVAILABLE: ipv4:127.0.0.1:1: Handshake read failed (Endpoint closing)",
         Cause.NO_ANSWER),
        (U, IP + "Failed to connect to remote host: getsockopt(SO_ERROR): "
         "Connection timed out", Cause.NO_ANSWER),
        (U, LAST + "UNKNOWN: ipv4:10.0.0.1:2379: Failed to connect to remote host: No route to host",
         Cause.NO_ANSWER),
        (D, "Deadline Exceeded", Cause.NO_ANSWER),
        (U, LAST + "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", Cause.CLOSED),
        (U, LAST + "UNAVAILABLE: ipv4:127.0.0.1:1: Handshake read failed (Socket closed)", Cause.CLOSED),
        (grpc.StatusCode.UNKNOWN, "Stream removed", Cause.CLOSED),
        (U, "DNS resolution failed for etcd-0.etcd:2379", Cause.UNRESOLVED),
        (U, "etcdserver: no leader", Cause.NOT_SERVING),
        (U, "etcdserver: request timed out", Cause.NOT_SERVING),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests", Cause.OVERLOADED),
        (U, IP + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
         "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
         "certificate: OK", Cause.TLS),
        (U, "Peer name etcd-0 is not in peer certificate", Cause.TLS),
        (U, "Handshake failed with fatal error SSL_ERROR_SSL: error:10000410:SSL routines:OPENSSL_internal:"
         "SSLV3_ALERT_HANDSHAKE_FAILURE", Cause.TLS),
        (U, "Trying to connect an http1.x server", Cause.NOT_GRPC),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", Cause.AUTH),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password",
         Cause.AUTH),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", Cause.PERMISSION),
        (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted", Cause.OTHER),
    ],
)  # fmt: skip
def test_cause(code: grpc.StatusCode, details: str, cause: Cause) -> None:
    exc = Failed(code, details)
    assert classify(exc) is cause
    transient = cause in (
        Cause.REFUSED, Cause.NO_ANSWER, Cause.CLOSED, Cause.UNRESOLVED, Cause.NOT_SERVING, Cause.OVERLOADED
    )  # fmt: skip
    assert is_transient(exc) is transient
    assert is_tls_error(exc) is (cause is Cause.TLS)


def test_not_an_rpc_error_is_permanent() -> None:
    assert classify(ValueError("x")) is Cause.OTHER and not is_transient(ValueError("x"))


def test_silence_names_a_partition_and_never_advises_a_timeout() -> None:
    shutdown = Failed(U, IP + "tcp handshaker shutdown")
    for exc in (shutdown, Failed(D, "Deadline Exceeded")):
        long = describe(exc, "etcd-0:2379", silent_for=PARTITION_SILENCE + 1.2)
        assert long == "no answer from etcd at etcd-0:2379 for 4 s; partitioned from it, or down?"
        short = describe(exc, "etcd-0:2379", silent_for=0.5)
        assert short == "no answer from etcd at etcd-0:2379 in time (partitioned from it, down, or slow?)"
        for line in (long, short):
            assert "TLS" not in line and "rpc_timeout" not in line and "lease_ttl" not in line


def test_a_certificate_failure_names_the_tls_settings() -> None:
    exc = Failed(U, "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED")
    assert describe(exc, "e:1").startswith(
        "TLS handshake with etcd at e:1 failed (check ca_file/cert_file/key_file)"
    )
