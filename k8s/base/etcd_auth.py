"""etcd authentication for an elastic_train job, set up idempotently (runs in the elastic-train image).

``ensure`` (the etcd pod's sidecar, talking to its own member on loopback) makes sure that:

* the ``root`` user exists with the root password, holds the ``root`` role,
* the training user exists with the training password and holds a role of the same name with read-write
  permission on the job's keys (``--prefix``; default: the whole keyspace of this dedicated etcd),
* authentication is enabled,

then writes ``--ready-file`` (the sidecar's readiness) and checks again every ``--interval`` seconds, so a
rotated training password is applied without a restart. Running it any number of times, on any member, at
the same time, is safe. Changing the root password once auth is on is done by hand (``etcdctl user passwd
root``, then update the Secret), because the old one is needed to log in.

``wait`` (the training pods' init container) returns as soon as the training user can log in and read, and
fails with one line after ``--timeout`` seconds.

Passwords come from the environment only (``ETCD_ROOT_PASSWORD``, ``ETCD_TRAINING_PASSWORD``) and are never
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import etcd3
import grpc
from etcd3 import etcdrpc

ROOT = "root"
RPC_TIMEOUT = 5.0


class SetupError(Exception):
    """A problem a retry will not fix by itself (wrong root password, missing environment variable)."""


def log(event: str, **fields: Any) -> None:
    """One JSON line on stderr."""
    sys.stderr.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
    sys.stderr.flush()


def env_password(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise SetupError(f"environment variable {name} is empty or unset")
    return value


def range_end(prefix: str) -> tuple[bytes, bytes]:
    """``(key, range_end)`` covering every key starting with ``prefix`` ('' = all keys)."""
    if not prefix:
        return b"\0", b"\0"
    key = prefix.encode()
    end = bytearray(key)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return key, b"\0"
    end[-1] += 1
    return key, bytes(end)


def details(exc: grpc.RpcError) -> str:
    return (exc.details() or "") if hasattr(exc, "details") else str(exc)


class Session:
    """Raw v3 auth/KV calls against one endpoint, with an optional auth token."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.client = etcd3.client(host=host, port=int(port), timeout=RPC_TIMEOUT)
        self.metadata: tuple[tuple[str, str], ...] | None = None

    def close(self) -> None:
        self.client.close()

    def call(self, method: Callable[..., Any], request: Any) -> Any:
        return method(request, RPC_TIMEOUT, metadata=self.metadata)

    def login(self, user: str, password: str) -> None:
        resp = self.client.authstub.Authenticate(
            etcdrpc.AuthenticateRequest(name=user, password=password), RPC_TIMEOUT
        )
        self.metadata = (("token", resp.token),)

    def password_ok(self, user: str, password: str) -> bool | None:
        """Whether ``user`` can log in with ``password``; ``None`` when auth is not enabled (no change)."""
        try:
            self.client.authstub.Authenticate(
                etcdrpc.AuthenticateRequest(name=user, password=password), RPC_TIMEOUT
            )
            return True
        except grpc.RpcError as exc:
            text = details(exc)
            if "authentication is not enabled" in text:
                return None
            if "authentication failed" in text:
                return False
            raise

    def tolerate(self, method: Callable[..., Any], request: Any, *already: str) -> bool:
        """Call; True if done now, False if etcd says it was already so (one of ``already`` in the error)."""
        try:
            self.call(method, request)
            return True
        except grpc.RpcError as exc:
            if any(text in details(exc) for text in already):
                return False
            raise


def ensure_once(session: Session, user: str, prefix: str, root_password: str, training_password: str) -> bool:
    """Make the auth state right, changing nothing that already is; True when auth was enabled by this call.

    Every change to users, roles or permissions bumps etcd's auth revision and makes clients re-authenticate,
    so each item is read first and written only when it differs.
    """
    auth = session.client.authstub
    enabled = session.password_ok(ROOT, root_password)
    if enabled is False:
        raise SetupError(
            "auth is enabled but the root password from the Secret is rejected "
            "(change it with `etcdctl user passwd root` first)"
        )
    if enabled:
        session.login(ROOT, root_password)
    for name, password in ((ROOT, root_password), (user, training_password)):
        added = session.tolerate(
            auth.UserAdd, etcdrpc.AuthUserAddRequest(name=name, password=password), "user name already exists"
        )
        if not added and not (enabled and session.password_ok(name, password)):
            session.call(
                auth.UserChangePassword, etcdrpc.AuthUserChangePasswordRequest(name=name, password=password)
            )
            log("password_set", user=name)
    key, end = range_end(prefix)
    for role in (ROOT, user):
        session.tolerate(auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=role), "role name already exists")
        roles = session.call(auth.UserGet, etcdrpc.AuthUserGetRequest(name=role)).roles
        if role not in roles:
            session.call(auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=role, role=role))
    perms = session.call(auth.RoleGet, etcdrpc.AuthRoleGetRequest(role=user)).perm
    readwrite = etcdrpc.auth_pb2.Permission.READWRITE
    if not any(p.permType == readwrite and p.key == key and p.range_end == end for p in perms):
        perm = etcdrpc.auth_pb2.Permission(permType=readwrite, key=key, range_end=end)
        session.call(auth.RoleGrantPermission, etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=perm))
    if enabled:
        return False
    return session.tolerate(auth.AuthEnable, etcdrpc.AuthEnableRequest(), "already enabled")


def can_login(session: Session, user: str, password: str, prefix: str) -> None:
    """Log in as ``user`` and read under ``prefix`` (raises grpc.RpcError if either fails)."""
    session.login(user, password)
    key, end = range_end(prefix)
    session.call(session.client.kvstub.Range, etcdrpc.RangeRequest(key=key, range_end=end, limit=1))


def cmd_ensure(args: argparse.Namespace) -> int:
    root_password = env_password("ETCD_ROOT_PASSWORD")
    training_password = env_password("ETCD_TRAINING_PASSWORD")
    if args.user == ROOT:
        raise SetupError("the training user must not be root")
    while True:
        session = Session(args.endpoint)
        try:
            enabled_now = ensure_once(session, args.user, args.prefix, root_password, training_password)
            can_login(session, args.user, training_password, args.prefix)
            if args.ready_file:
                with open(args.ready_file, "w", encoding="utf-8") as f:
                    f.write("ok\n")
            log("auth_ensured", endpoint=args.endpoint, user=args.user, enabled_now=enabled_now)
            delay = args.interval
        except (grpc.RpcError, SetupError) as exc:
            if args.ready_file and os.path.exists(args.ready_file):
                os.unlink(args.ready_file)
            message = str(exc) if isinstance(exc, SetupError) else details(exc)
            log("auth_not_ensured", endpoint=args.endpoint, error=message)
            if args.interval <= 0:
                sys.stderr.write(f"etcd_auth: error: {message}\n")
                return 1
            delay = min(args.interval, 5.0)
        finally:
            session.close()
        if args.interval <= 0:
            return 0
        time.sleep(delay)


def cmd_wait(args: argparse.Namespace) -> int:
    password = env_password("ETCD_TRAINING_PASSWORD")
    deadline = time.monotonic() + args.timeout
    last = ""
    while True:
        session = Session(args.endpoint)
        try:
            can_login(session, args.user, password, args.prefix)
            log("etcd_ready", endpoint=args.endpoint, user=args.user)
            return 0
        except grpc.RpcError as exc:
            text = details(exc)
            if text != last:
                log("etcd_not_ready", endpoint=args.endpoint, error=text)
                last = text
        finally:
            session.close()
        if time.monotonic() >= deadline:
            sys.stderr.write(
                f"etcd_auth: error: user {args.user!r} could not log in to etcd at {args.endpoint} "
                f"within {args.timeout:g} s ({last})\n"
            )
            return 1
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="etcd_auth", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func in (("ensure", cmd_ensure), ("wait", cmd_wait)):
        p = sub.add_parser(name)
        p.add_argument("--endpoint", default="127.0.0.1:2379", help="etcd HOST:PORT")
        p.add_argument("--user", default="elastic-train", help="training user (and role) name")
        p.add_argument(
            "--prefix", default="", help="key prefix the training user may read and write ('' = all)"
        )
        p.set_defaults(func=func)
        if name == "ensure":
            p.add_argument("--ready-file", default=None, help="written after a successful check")
            p.add_argument("--interval", type=float, default=60.0, help="seconds between checks (0: once)")
        else:
            p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SetupError as exc:
        sys.stderr.write(f"etcd_auth: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
