"""Why a call to etcd failed, read from gRPC's error, and the one line that says so.

gRPC reports almost every connection problem as ``UNAVAILABLE`` with a free-text detail, so the cause is read
from that text. What decides is whether waiting or another member can cure it:

- **transient** (retried up to ``connect_timeout``, failed over to the next member): the network or etcd
  itself — connection refused, no answer (timed out, gRPC's "tcp handshaker shutdown", no SETTINGS frame, a
  handshake cut by an endpoint closing), a connection reset, an unresolved name, etcd without a leader or
  overloaded, a deadline exceeded;
- **permanent** (one line at once): what only the operator can fix — a certificate or key that does not
  verify (:data:`Cause.TLS`), a wrong user or password, a missing permission, a malformed request.

A handshake the server ends by closing the connection is transport trouble too; :func:`connect
<elastic_train.etcd.client.connect>` asks the member directly whether it speaks the other protocol (TLS
against plain text or the reverse) and only then calls it a TLS mismatch.
"""

from __future__ import annotations

import enum

import grpc

#: Seconds without any answer from etcd after which a failed call is reported as a likely partition.
PARTITION_SILENCE = 3.0


class Cause(enum.Enum):
    """What a failed etcd call ran into."""

    REFUSED = "connection refused"
    NO_ANSWER = "no answer"
    CLOSED = "connection closed by the other end"
    UNRESOLVED = "host name not resolved"
    NOT_SERVING = "etcd cannot serve requests"
    OVERLOADED = "etcd is overloaded"
    TLS = "TLS certificate or key"
    NOT_GRPC = "not an etcd (gRPC) endpoint"
    AUTH = "authentication"
    PERMISSION = "permission"
    OTHER = "other"


#: Causes that waiting, or another member of the endpoint list, may cure.
TRANSIENT = frozenset(
    {Cause.REFUSED, Cause.NO_ANSWER, Cause.CLOSED, Cause.UNRESOLVED, Cause.NOT_SERVING, Cause.OVERLOADED}
)

# Only what a certificate, a key or the TLS settings cause: verification failures and TLS alerts. Generic
# words ("handshake", "ssl") are not enough: gRPC's "tcp handshaker shutdown" is a TCP connect that timed out,
# and "Handshake read failed (Endpoint closing)" a handshake that got no answer.
_TLS_WORDS = ("certificate", "ssl_error_ssl", "wrong_version_number", "peer name", "alert", "tsi_protocol")
_AUTH_WORDS = ("authentication failed", "invalid auth token")
_NO_ANSWER_WORDS = (
    "timed out",
    "timeout",
    "deadline",
    "handshaker shutdown",
    "endpoint closing",
    "unreachable",
    "no route",
    "settings frame",
)
_CLOSED_WORDS = ("reset", "socket closed", "stream removed", "broken pipe", "connection closed", "eof")


def code_of(exc: BaseException) -> grpc.StatusCode | None:
    """gRPC's status code of a failed call (``None`` for anything else)."""
    return exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None


def details_of(exc: BaseException) -> str:
    """gRPC's detail text of a failed call (empty for anything else)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        return (exc.details() or "").strip()
    return ""


def classify(exc: BaseException) -> Cause:
    """The cause of a failed etcd call (see the module docstring)."""
    code = code_of(exc)
    low = details_of(exc).lower()
    if code is None:
        return Cause.OTHER
    if code == grpc.StatusCode.UNAUTHENTICATED or any(w in low for w in _AUTH_WORDS):
        return Cause.AUTH
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in low:
        return Cause.PERMISSION
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "too many requests" in low:
        return Cause.OVERLOADED
    if "etcdserver:" in low:  # etcd's own answer: no leader, request timed out, shutting down ...
        return Cause.NOT_SERVING if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
            else Cause.OTHER  # fmt: skip
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Cause.NO_ANSWER
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        return Cause.OTHER
    if code == grpc.StatusCode.UNAVAILABLE and any(w in low for w in _TLS_WORDS):
        return Cause.TLS
    if "http1.x" in low:
        return Cause.NOT_GRPC
    if "refused" in low:
        return Cause.REFUSED
    if "dns" in low or "resolve" in low or "name or service" in low:
        return Cause.UNRESOLVED
    if any(w in low for w in _NO_ANSWER_WORDS):
        return Cause.NO_ANSWER
    if any(w in low for w in _CLOSED_WORDS):
        return Cause.CLOSED
    return Cause.NO_ANSWER if code == grpc.StatusCode.UNAVAILABLE else Cause.OTHER


def is_transient(exc: BaseException) -> bool:
    """True for errors that waiting or another member may cure: etcd down, starting, leaderless, slow or cut
    off from this node. Wrong credentials, missing permissions, certificate failures and malformed requests
    are not: retrying them only hides the problem."""
    return classify(exc) in TRANSIENT


def is_tls_error(exc: BaseException) -> bool:
    """A certificate or key that does not verify, or a TLS alert from the server."""
    return classify(exc) is Cause.TLS


def not_sent(exc: BaseException) -> bool:
    """True when the failed request certainly never reached etcd (no connection), so resending a write to
    another member cannot apply it twice. etcd's own errors (``etcdserver: ...``) may follow a proposal."""
    low = details_of(exc).lower()
    return code_of(exc) == grpc.StatusCode.UNAVAILABLE and (
        "failed to connect" in low or "connection refused" in low or "no address" in low
    )


def wait_reason(exc: BaseException) -> str:
    """A few words on why etcd is not usable yet, for the "waiting for etcd" line."""
    cause = classify(exc)
    low = details_of(exc).lower()
    if cause is Cause.NOT_SERVING:
        if "no leader" in low:
            return "etcd has no leader (quorum lost or an election in progress)"
        return f"etcd cannot serve requests ({details_of(exc).splitlines()[0][:120]})"
    if cause is Cause.NO_ANSWER:
        return "no answer in time"
    if cause in TRANSIENT:
        return cause.value
    text = details_of(exc) or (code.name if (code := code_of(exc)) is not None else type(exc).__name__)
    return text.splitlines()[0][:160]


def describe(
    exc: BaseException, where: str, user: str | None = None, *, silent_for: float | None = None
) -> str:
    """One line that says what went wrong talking to etcd (never includes credentials).

    Args:
        exc: the failed call's error.
        where: the endpoint (list) for the message.
        user: the etcd user, for authentication messages.
        silent_for: seconds since etcd last answered this client (``None``: not known). Past
            :data:`PARTITION_SILENCE` a call that got no answer is reported as a likely partition.
    """
    cause = classify(exc)
    details = details_of(exc)
    low = details.lower()
    if cause is Cause.NO_ANSWER:
        if silent_for is not None and silent_for >= PARTITION_SILENCE:
            return f"no answer from etcd at {where} for {silent_for:.0f} s; partitioned from it, or down?"
        return f"no answer from etcd at {where} in time (partitioned from it, down, or slow?)"
    if cause is Cause.TLS:
        return f"TLS handshake with etcd at {where} failed (check ca_file/cert_file/key_file): {details}"
    if cause is Cause.NOT_GRPC:
        return f"{where} is not an etcd client endpoint (it speaks HTTP/1; is the port right?)"
    if cause is Cause.NOT_SERVING or cause is Cause.OVERLOADED:
        return f"etcd at {where} cannot serve requests: {wait_reason(exc)}"
    if cause in TRANSIENT:
        return f"cannot reach etcd at {where} (is it running? is the endpoint right?): {wait_reason(exc)}"
    if cause is Cause.AUTH:
        return f"etcd authentication failed at {where} for user {user!r} (wrong user name or password?)"
    if cause is Cause.PERMISSION:
        return f"etcd user {user!r} is not permitted this operation at {where} ({details})"
    code = code_of(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in low:
        return f"etcd at {where} requires authentication: set rdzv-conf user and a password"
    if code is not None:
        return f"etcd request to {where} failed: {code.name}: {details}"
    return f"etcd request to {where} failed: {type(exc).__name__}: {exc}"
