"""``elastic-train etcd``: a foreground etcd dev server (one member, or a 3/5-member cluster) on loopback;
``elastic-train etcd auth ensure|wait``: a job's etcd authentication (:mod:`elastic_train.etcd.auth`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from elastic_train.errors import ConfigError
from elastic_train.etcd.config import TLSConfig
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "etcd", help="serve a development etcd on loopback until Ctrl-C (`etcd auth`: a job's etcd users)"
    )
    p.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=2379,
        help="client port (0: a free one); a cluster's members use PORT, PORT+1, ... (0: free ones)",
    )
    p.add_argument("--data-dir", default=None, help="keep data here (default: temporary, removed on exit)")
    p.add_argument("--enable-v2", action="store_true", help="also serve the v2 API (for torch's etcd-v2)")
    p.add_argument(
        "--members",
        type=int,
        default=1,
        choices=(1, 3, 5),
        help="cluster size: 3 or 5 members for trying failover, leader loss and quorum loss (dev/test only)",
    )
    p.set_defaults(func=run)
    verbs = p.add_subparsers(dest="etcd_command", metavar="{auth}", parser_class=type(p))
    _register_auth(verbs)


def _register_auth(verbs: argparse._SubParsersAction) -> None:
    auth = verbs.add_parser(
        "auth",
        help="set up a job's etcd authentication idempotently (ensure), or wait until its user can log in",
        description="Passwords come from $ETCD_ROOT_PASSWORD and $ETCD_TRAINING_PASSWORD only.",
    )
    sub = auth.add_subparsers(dest="auth_command", metavar="{ensure,wait}", required=True)
    ensure = sub.add_parser(
        "ensure",
        help="create root, the training user and its role, enable auth; check again every --interval",
    )
    wait = sub.add_parser("wait", help="return once the training user can log in and read (--timeout)")
    for q in (ensure, wait):
        q.add_argument("--endpoint", default="127.0.0.1:2379", help="etcd HOST:PORT")
        q.add_argument("--user", default="elastic-train", help="training user (and role) name")
        q.add_argument(
            "--prefix", default="", help="key prefix the training user may read and write ('' = all)"
        )
        add_tls_options(q)
    ensure.add_argument(
        "--ready-file", default=None, help="written after a successful check, removed on a failed one"
    )
    ensure.add_argument("--interval", type=float, default=60.0, help="seconds between checks (0: once)")
    ensure.set_defaults(func=run_auth_ensure)
    wait.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    wait.set_defaults(func=run_auth_wait)


def add_tls_options(p: argparse.ArgumentParser) -> None:
    """``--ca-file``, ``--cert-file``, ``--key-file``: TLS to etcd (plain text without them)."""
    p.add_argument("--ca-file", default=None, help="CA bundle of the etcd server certificate")
    p.add_argument("--cert-file", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--key-file", default=None, help="client certificate key")


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The TLS settings :func:`add_tls_options` read, or ``None`` for plain text.

    Raises:
        ConfigError: a certificate without its key, or a key without its certificate.
    """
    if not (args.ca_file or args.cert_file or args.key_file):
        return None
    try:
        return TLSConfig(ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def run_auth_ensure(args: argparse.Namespace) -> int:
    from elastic_train.etcd.auth import ensure

    tls = tls_from_args(args)
    ensure(args.endpoint, args.user, args.prefix, tls=tls, ready_file=args.ready_file, interval=args.interval)
    return 0


def run_auth_wait(args: argparse.Namespace) -> int:
    from elastic_train.etcd.auth import wait_for_login

    wait_for_login(args.endpoint, args.user, args.prefix, tls=tls_from_args(args), timeout=args.timeout)
    return 0


def run(args: argparse.Namespace) -> int:
    server: EmbeddedEtcd | EtcdCluster
    if args.members == 1:
        server = EmbeddedEtcd(
            host=args.host, client_port=args.port, data_dir=args.data_dir, enable_v2=args.enable_v2
        )
    else:
        if args.enable_v2:
            sys.stderr.write("elastic-train: error: --enable-v2 is for a single member (drop --members)\n")
            return 2
        ports = [args.port + i if args.port else 0 for i in range(args.members)]
        server = EtcdCluster(args.members, host=args.host, client_ports=ports, data_dir=args.data_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        members = server.members if isinstance(server, EtcdCluster) else [server]
        pids = ", ".join(str(m.pid) for m in members)
        what = f" ({len(members)} members, dev/test only)" if len(members) > 1 else ""
        print(
            f"etcd {server.version}{what} serving on {server.endpoint} (pid {pids}); Ctrl-C stops it",
            flush=True,
        )
        print(f"  torchrun --rdzv-backend=etcd3 --rdzv-endpoint={server.endpoint} ...", flush=True)
        while not stop.wait(0.5):
            for m in members:
                if m.proc is None or m.proc.poll() is not None:
                    sys.stderr.write(f"elastic-train: error: etcd {m.endpoint} exited: {m.log_tail()}\n")
                    return 1
    return 0
