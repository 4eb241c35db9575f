"""``elastic-train etcd``: a foreground etcd dev server on loopback."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from elastic_train.etcd.server import EmbeddedEtcd


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("etcd", help="serve a development etcd on loopback until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    p.add_argument("--port", type=int, default=2379, help="client port (0: a free one)")
    p.add_argument("--data-dir", default=None, help="keep data here (default: temporary, removed on exit)")
    p.add_argument("--enable-v2", action="store_true", help="also serve the v2 API (for torch's etcd-v2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    etcd = EmbeddedEtcd(
        host=args.host, client_port=args.port, data_dir=args.data_dir, enable_v2=args.enable_v2
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with etcd:
        print(f"etcd {etcd.version} serving on {etcd.endpoint} (pid {etcd.pid}); Ctrl-C stops it", flush=True)
        print(f"  torchrun --rdzv-backend=etcd3 --rdzv-endpoint={etcd.endpoint} ...", flush=True)
        while not stop.wait(0.5):
            if etcd.proc is None or etcd.proc.poll() is not None:
                sys.stderr.write(f"elastic-train: error: etcd exited: {etcd.log_tail()}\n")
                return 1
    return 0
