"""``elastic-train etcd``: a foreground etcd dev server (one member, or a 3/5-member cluster), on loopback or,
with ``--host``, for the nodes of other machines; ``elastic-train etcd auth ensure|wait``: a job's etcd
authentication (:mod:`elastic_train.etcd.auth`)."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
import threading

from elastic_train.errors import ConfigError
from elastic_train.etcd.config import TLSConfig
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "etcd",
        help="serve a development etcd until Ctrl-C, on loopback or for other machines (`etcd auth`: a job's "
        "etcd users)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 127.0.0.1 (default) for nodes on this machine; this machine's address, "
        "or 0.0.0.0 for every interface, for nodes on others (no authentication, no TLS: a trusted network "
        "only)",
    )
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


#: What ``elastic-train etcd`` says when it listens for other machines.
OPEN_ADVICE = (
    "  listening for other machines without authentication or TLS: whoever reaches this port reads and "
    "changes every run's keys. Beyond a trusted network use a production etcd with client TLS and "
    'authentication (docs/kubernetes.md, "etcd in production"; `elastic-train etcd auth ensure` creates '
    "a job's user), and give the nodes rendezvous.user and rendezvous.tls."
)


def _reachable(host: str, port: int) -> list[str]:
    """``ADDR:PORT`` for each address other machines may reach a server listening on ``host`` at."""
    if host not in WILDCARDS:
        return [f"{host}:{port}"]
    import psutil

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                out.append(f"{a.address}:{port}")
    return out or [f"THIS_MACHINE:{port}"]


#: Hosts that mean "every interface".
WILDCARDS = ("0.0.0.0",)


def run(args: argparse.Namespace) -> int:
    server: EmbeddedEtcd | EtcdCluster
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host.strip("[]")).is_loopback
    except ValueError:
        raise ConfigError(
            f"--host {args.host!r}: expected an IP address (or 0.0.0.0 for every interface)"
        ) from None
    if args.members == 1:
        server = EmbeddedEtcd(
            host=args.host,
            client_port=args.port,
            data_dir=args.data_dir,
            enable_v2=args.enable_v2,
            peer_host=None if loopback else "127.0.0.1",  # a lone member has no peers
        )
    else:
        if args.enable_v2:
            sys.stderr.write("elastic-train: error: --enable-v2 is for a single member (drop --members)\n")
            return 2
        if args.host in WILDCARDS:
            raise ConfigError(f"--host {args.host}: a cluster's members need one address to find each other")
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
        if loopback:
            print(f"  torchrun --rdzv-backend=etcd3 --rdzv-endpoint={server.endpoint} ...", flush=True)
        else:
            port = int(server.endpoint.split(",")[0].rpartition(":")[2])
            reach = ",".join(_reachable(args.host, port)[:1])
            print(OPEN_ADVICE, flush=True)
            print(
                f"  on every node: elastic-train run JOB.yaml --endpoint {reach} --local-addr NODE_ADDR ...",
                flush=True,
            )
        while not stop.wait(0.5):
            for m in members:
                if m.proc is None or m.proc.poll() is not None:
                    sys.stderr.write(f"elastic-train: error: etcd {m.endpoint} exited: {m.log_tail()}\n")
                    return 1
    return 0
