"""``elastic-train etcd``: a foreground etcd dev server (one member, or a 3/5-member cluster) on loopback."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("etcd", help="serve a development etcd on loopback until Ctrl-C")
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
