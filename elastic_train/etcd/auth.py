"""etcd authentication for a job's dedicated etcd, set up idempotently (``elastic-train etcd auth``).

:func:`ensure` (on Kubernetes the etcd pod's sidecar, talking to its own member on loopback) makes sure that:

* the ``root`` user exists with the root password and holds the ``root`` role,
* the training user exists with the training password and holds a role of the same name with read-write
  permission on the job's keys (``prefix``; default: the whole keyspace of this dedicated etcd),
* authentication is enabled,

then writes a ready file (the sidecar's readiness) and checks again every ``interval`` seconds, so a rotated
training password is applied without a restart. Running it any number of times, on any member, at the same
time, is safe. Changing the root password once auth is on is done by hand (``etcdctl user passwd root``, then
update the Secret), because the old one is needed to log in.

:func:`wait_for_login` (the training pods' init container) returns as soon as the training user can log in
and read, and fails with one line after ``timeout`` seconds.

Passwords come from the environment only (:data:`ENV_ROOT_PASSWORD`, :data:`ENV_TRAINING_PASSWORD`) and are
never printed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from etcd3 import etcdrpc

from elastic_train.errors import ConfigError, ElasticTrainError
from elastic_train.etcd.client import Etcd, connect, rpc_details
from elastic_train.etcd.config import TLSConfig
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.keys import prefix_range
from elastic_train.log import get_logger

log = get_logger(__name__)

#: etcd's administrator user and role.
ROOT = "root"
#: Environment variable holding the root password.
ENV_ROOT_PASSWORD = "ETCD_ROOT_PASSWORD"
#: Environment variable holding the training user's password.
ENV_TRAINING_PASSWORD = "ETCD_TRAINING_PASSWORD"
#: Deadline of each etcd request.
RPC_TIMEOUT = 5.0
#: Longest pause before :func:`ensure` tries again after a failed check.
RETRY_PAUSE = 5.0
#: Seconds between two login attempts of :func:`wait_for_login`.
WAIT_PAUSE = 1.0


def env_password(name: str) -> str:
    """The password in environment variable ``name``.

    Raises:
        ConfigError: the variable is empty or unset.
    """
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(f"environment variable {name} is empty or unset")
    return value


def _password_ok(etcd: Etcd, user: str, password: str) -> bool | None:
    """Whether ``user`` can log in with ``password``; ``None`` when auth is not enabled (no change)."""
    try:
        etcd.unary(etcd.raw.authstub.Authenticate, etcdrpc.AuthenticateRequest(name=user, password=password))
        return True
    except EtcdError as exc:
        text = rpc_details(exc)
        if "authentication is not enabled" in text:
            return None
        if "authentication failed" in text:
            return False
        raise


def _tolerate(etcd: Etcd, method: Any, request: Any, *already: str) -> bool:
    """Call; True if done now, False if etcd says it was already so (one of ``already`` in the error)."""
    try:
        etcd.unary(method, request, idempotent=False)
        return True
    except EtcdError as exc:
        if any(text in rpc_details(exc) for text in already):
            return False
        raise


def ensure_once(
    endpoint: str,
    user: str,
    prefix: str,
    root_password: str,
    training_password: str,
    *,
    tls: TLSConfig | None = None,
) -> bool:
    """Make the auth state right, changing nothing that already is; True when auth was enabled by this call.

    Every change to users, roles or permissions bumps etcd's auth revision and makes clients re-authenticate,
    so each item is read first and written only when it differs.

    Raises:
        ConfigError: auth is on and the root password is rejected.
        EtcdError: etcd is unreachable or refused a request.
    """
    with connect(endpoint, tls=tls, timeout=RPC_TIMEOUT) as anonymous:
        enabled = _password_ok(anonymous, ROOT, root_password)
    if enabled is False:
        raise ConfigError(
            "auth is enabled but the root password from the Secret is rejected "
            "(change it with `etcdctl user passwd root` first)"
        )
    # Logged in as root once auth is on; before, every request is allowed without a login.
    login, password = (ROOT, root_password) if enabled else (None, None)
    with connect(endpoint, tls=tls, user=login, password=password, timeout=RPC_TIMEOUT) as etcd:
        auth = etcd.raw.authstub
        for name, password in ((ROOT, root_password), (user, training_password)):
            added = _tolerate(
                etcd,
                auth.UserAdd,
                etcdrpc.AuthUserAddRequest(name=name, password=password),
                "user name already exists",
            )
            if not added and not (enabled and _password_ok(etcd, name, password)):
                etcd.unary(
                    auth.UserChangePassword,
                    etcdrpc.AuthUserChangePasswordRequest(name=name, password=password),
                    idempotent=False,
                )
                log.info("password_set", user=name)
        for role in (ROOT, user):
            _tolerate(etcd, auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=role), "role name already exists")
            if role not in etcd.unary(auth.UserGet, etcdrpc.AuthUserGetRequest(name=role)).roles:
                etcd.unary(
                    auth.UserGrantRole,
                    etcdrpc.AuthUserGrantRoleRequest(user=role, role=role),
                    idempotent=False,
                )
        key, end = prefix_range(prefix)
        readwrite = etcdrpc.auth_pb2.Permission.READWRITE
        perms = etcd.unary(auth.RoleGet, etcdrpc.AuthRoleGetRequest(role=user)).perm
        if not any(p.permType == readwrite and p.key == key and p.range_end == end for p in perms):
            perm = etcdrpc.auth_pb2.Permission(permType=readwrite, key=key, range_end=end)
            etcd.unary(
                auth.RoleGrantPermission,
                etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=perm),
                idempotent=False,
            )
        if enabled:
            return False
        return _tolerate(etcd, auth.AuthEnable, etcdrpc.AuthEnableRequest(), "already enabled")


def check_login(
    endpoint: str, user: str, password: str, prefix: str, *, tls: TLSConfig | None = None
) -> None:
    """Log in as ``user`` and read under ``prefix``.

    Raises:
        EtcdError: either failed (auth not enabled yet, no such user, wrong password, no permission, down).
    """
    key, end = prefix_range(prefix)
    with connect(endpoint, tls=tls, user=user, password=password, timeout=RPC_TIMEOUT) as etcd:
        etcd.unary(etcd.raw.kvstub.Range, etcdrpc.RangeRequest(key=key, range_end=end, limit=1))


def ensure(
    endpoint: str,
    user: str,
    prefix: str,
    *,
    tls: TLSConfig | None = None,
    ready_file: str | None = None,
    interval: float = 60.0,
) -> None:
    """Set auth up and check it again every ``interval`` seconds, forever (``interval`` <= 0: once).

    A failed check removes ``ready_file`` and is tried again after at most :data:`RETRY_PAUSE` seconds (etcd
    may still be starting); a successful one writes it.

    Raises:
        ConfigError: a password variable is unset, or the training user is root.
        ElasticTrainError: with ``interval`` <= 0, the check failed (one line, no password).
    """
    root_password = env_password(ENV_ROOT_PASSWORD)
    training_password = env_password(ENV_TRAINING_PASSWORD)
    if user == ROOT:
        raise ConfigError("the training user must not be root")
    while True:
        try:
            enabled_now = ensure_once(endpoint, user, prefix, root_password, training_password, tls=tls)
            check_login(endpoint, user, training_password, prefix, tls=tls)
        except ElasticTrainError as exc:
            if ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ready_file)
            log.warning("auth_not_ensured", endpoint=endpoint, error=str(exc))
            if interval <= 0:
                raise
            time.sleep(min(interval, RETRY_PAUSE))
            continue
        if ready_file:
            with open(ready_file, "w", encoding="utf-8") as f:
                f.write("ok\n")
        log.info("auth_ensured", endpoint=endpoint, user=user, enabled_now=enabled_now)
        if interval <= 0:
            return
        time.sleep(interval)


def wait_for_login(
    endpoint: str, user: str, prefix: str, *, tls: TLSConfig | None = None, timeout: float = 600.0
) -> None:
    """Return as soon as ``user`` (password in :data:`ENV_TRAINING_PASSWORD`) can log in and read.

    Raises:
        ConfigError: the password variable is unset.
        EtcdError: no successful login within ``timeout`` seconds (the line names the last reason).
    """
    password = env_password(ENV_TRAINING_PASSWORD)
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            check_login(endpoint, user, password, prefix, tls=tls)
            log.info("etcd_ready", endpoint=endpoint, user=user)
            return
        except EtcdError as exc:
            if str(exc) != last:
                last = str(exc)
                log.info("etcd_not_ready", endpoint=endpoint, error=last)
        if time.monotonic() >= deadline:
            raise EtcdError(
                f"user {user!r} could not log in to etcd at {endpoint} within {timeout:g} s ({last})"
            )
        time.sleep(WAIT_PAUSE)
