"""``etcd3-dynamic``: an etcd v3 ``RendezvousBackend`` and c10d Store for torch's DynamicRendezvousHandler.

The backend keeps torch's encoded rendezvous state in one key; the fencing token is the key's etcd mod
revision, and ``set_state`` is one compare-and-set transaction. The store is a c10d Store in Python over etcd
keys (blocking reads poll with a short backoff), used by the handler for its per-round prefix store.

Inherited from DynamicRendezvousHandler (documented in docs/rendezvous.md): heartbeats by rewriting the state
blob (no leases, no watch), a ``last_call_timeout`` wait (30 s by default), and the shared-TCPStore pitfall
(we default ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the registry).
"""

from __future__ import annotations

import binascii
import time
from base64 import b64decode, b64encode
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_train.etcd.client import Etcd, cmp_mod, cmp_version, op_get, op_put
from elastic_train.etcd.errors import EtcdError
from elastic_train.rendezvous.params import DYNAMIC_KEYS, config_from_params
from elastic_train.rendezvous.protocol import run_prefix

BACKEND_NAME = "etcd3-dynamic"


class Etcd3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in ``/elastic_train/<run>/dynamic/state`` (base64), fenced by its mod revision.

    Raises (every method):
        RendezvousConnectionError: etcd failed.
        RendezvousStateError: the stored state is not valid base64.
    """

    def __init__(self, etcd: Etcd, run_id: str) -> None:
        self._etcd = etcd
        self._key = run_prefix(run_id) + "dynamic/state"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._etcd.get(self._key)
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd failed reading rendezvous state: {exc}") from exc
        if kv is None:
            return None
        return self._decode(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                result = self.get_state()
                return (*result, False) if result is not None else None
            compare = cmp_mod(self._key, revision) if revision > 0 else cmp_version(self._key, 0)
        else:
            compare = cmp_version(self._key, 0)
        try:
            ok, resp = self._etcd.txn([compare], [op_put(self._key, b64encode(state))], [op_get(self._key)])
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd failed writing rendezvous state: {exc}") from exc
        if ok:
            return state, int(resp.header.revision), True
        kvs = resp.responses[0].response_range.kvs
        if not kvs:
            return None
        return self._decode(kvs[0].value), int(kvs[0].mod_revision), False

    @staticmethod
    def _decode(raw: bytes) -> bytes:
        try:
            return b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError("the rendezvous state stored in etcd is corrupt (not base64)") from exc


class Etcd3Store(Store):
    """A c10d Store on etcd v3 keys under ``prefix``; blocking reads wait up to the store timeout.

    ``add`` is a compare-and-set loop on the counter's mod revision, so concurrent adds never lose updates.
    """

    def __init__(self, etcd: Etcd, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._etcd = etcd
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout

    def _k(self, key: str) -> str:
        return self._prefix + key

    @staticmethod
    def _b(value: str | bytes | list[int]) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._etcd.put(self._k(key), self._b(value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._etcd.txn([], [op_put(self._k(k), self._b(v)) for k, v in zip(keys, values, strict=True)])

    def get(self, key: str) -> bytes:
        return self._wait_get([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_get(keys, self._timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self._etcd.get(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_get(keys, timeout or self._timeout)

    def add(self, key: str, amount: int) -> int:
        k = self._k(key)
        while True:
            kv = self._etcd.get(k)
            current = int(kv.value) if kv is not None else 0
            ok, _ = self._etcd.txn(
                [cmp_mod(k, kv.mod_revision if kv else 0)], [op_put(k, str(current + amount).encode())]
            )
            if ok:
                return current + amount

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        k = self._k(key)
        kv = self._etcd.get(k)
        exp = self._b(expected)
        if (kv is None and exp == b"") or (kv is not None and kv.value == exp):
            ok, _ = self._etcd.txn([cmp_mod(k, kv.mod_revision if kv else 0)], [op_put(k, self._b(desired))])
            if ok:
                return self._b(desired)
            kv = self._etcd.get(k)
        return kv.value if kv is not None else exp

    def delete_key(self, key: str) -> bool:
        existed = self._etcd.get(self._k(key)) is not None
        self._etcd.delete(self._k(key))
        return existed

    def num_keys(self) -> int:
        return len(self._etcd.get_prefix(self._prefix)[0])

    def _wait_get(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict[str, bytes] = {}
        delay = 0.002
        while True:
            for key in keys:
                if key not in found:
                    kv = self._etcd.get(self._k(key))
                    if kv is not None:
                        found[key] = kv.value
            if len(found) == len(keys):
                return [found[k] for k in keys]
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in found]
                raise LookupError(
                    f"etcd store: timed out after {timeout.total_seconds():.0f}s waiting for {missing}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def create_backend(params: RendezvousParameters) -> tuple[Etcd3RendezvousBackend, Store]:
    """The v3 backend and store for torch's DynamicRendezvousHandler, like torch's own ``create_backend``.

    ``params.config`` takes our connection keys (user, password_env, password_file, ca_file, cert_file,
    key_file; the others are ignored here) and torch's dynamic-handler keys (join/last_call/close/heartbeat
    timeouts, keep_alive_interval, keep_alive_max_attempt).

    Raises:
        ConfigError: unknown rdzv-conf key or invalid value.
        RendezvousConnectionError: etcd unreachable, TLS or authentication failure (one line).
    """
    from elastic_train.rendezvous.registry import open_etcd

    cfg = config_from_params(params, allowed_extra=tuple(k for k in DYNAMIC_KEYS if k != "join_timeout"))
    try:
        etcd = open_etcd(cfg)
    except EtcdError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    backend = Etcd3RendezvousBackend(etcd, cfg.run_id)
    store = Etcd3Store(etcd, run_prefix(cfg.run_id) + "dynamic/store/")
    return backend, store
