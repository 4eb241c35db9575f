"""Scale test of the etcd3 rendezvous alone: N participants (threads sharing one etcd client) per round.

For each N it forms a first round, then a second one after one participant leaves (a failure round), and
reports seconds per round and etcd operations per round counted by the client wrapper (writes = puts and
successful transaction writes; reads = range requests and watch set-ups; watch events delivered).
It also compares the process-group bootstrap exchange (every rank publishes its address, then reads all
others) through a TCPStore and through etcd keys (the etcd3-dynamic store).

    .venv/bin/python benchmarks/rdzv_scale.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.etcd.client import Etcd, OpCounts, connect
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings

TARGET_N256_S = 3.0


def snapshot(clients: list[Etcd]) -> OpCounts:
    total = OpCounts()
    for c in clients:
        for k, v in asdict(c.counts).items():
            setattr(total, k, getattr(total, k) + v)
    return total


def diff(a: OpCounts, b: OpCounts) -> dict[str, int]:
    return {k: getattr(b, k) - getattr(a, k) for k in asdict(a)}


def scale_round(endpoint: str, n: int, clients_per: int, settle: float) -> dict:
    clients = [Etcd(connect(endpoint, timeout=30)) for _ in range(max(1, n // clients_per))]
    run = f"scale-{n}"
    s = ProtocolSettings(run_id=run, min_nodes=max(1, n - 1), max_nodes=n, lease_ttl=5, settle=settle)
    ps = [Participant(clients[i % len(clients)], s, addr="127.0.0.1", node_id=f"p{i:04d}") for i in range(n)]
    with ThreadPoolExecutor(min(n, 64)) as pool:
        list(pool.map(lambda p: p.start(), ps))
    res: dict = {"n": n}
    with ThreadPoolExecutor(n) as pool:
        c0 = snapshot(clients)
        t0 = time.perf_counter()
        out = list(pool.map(lambda p: p.join(), ps))
        res["first_round_s"] = time.perf_counter() - t0
        res["first_round_ops"] = diff(c0, snapshot(clients))
        assert {r.world_size for r in out} == {n}
        victim = ps[-1]
        victim.lease.stop(revoke=True)
        victim.view.stop()
        rest = ps[:-1]
        t1 = time.perf_counter()
        while not all(p.num_waiting() > 0 for p in rest):
            time.sleep(0.005)
        c1 = snapshot(clients)
        t2 = time.perf_counter()
        out2 = list(pool.map(lambda p: p.join(), rest))
        res["detect_s"] = t2 - t1
        res["failure_round_s"] = time.perf_counter() - t2
        res["failure_round_ops"] = diff(c1, snapshot(clients))
        assert {r.world_size for r in out2} == {n - 1}
    for p in rest:
        p.view.stop()
        p.lease.stop(revoke=False)
    for c in clients:
        c.close()
    return res


def bootstrap_exchange(store_factory, n: int) -> float:
    """Seconds for n ranks to publish an address and read every other rank's (gloo's bootstrap pattern)."""
    stores = [store_factory(i) for i in range(n)]
    barrier = threading.Barrier(n)

    def rank(i: int) -> None:
        barrier.wait()
        stores[i].set(f"addr/{i}", b"127.0.0.1:12345")
        for j in range(n):
            stores[i].get(f"addr/{j}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(rank, range(n)))
    return time.perf_counter() - t0


def bootstrap(endpoint: str, n: int) -> dict:
    import torch.distributed as dist

    from elastic_train.rendezvous.backend import Etcd3Store

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def tcp(i: int):
        return server if i == 0 else dist.TCPStore("127.0.0.1", server.port, is_master=False)

    etcd = Etcd(connect(endpoint))

    def via_etcd(i: int):
        return Etcd3Store(etcd, f"/elastic_train/boot-{n}/", timedelta(seconds=60))

    t_tcp = min(bootstrap_exchange(tcp, n) for _ in range(3))
    t_etcd = min(bootstrap_exchange(via_etcd, n) for _ in range(1))
    return {"n": n, "tcpstore_s": t_tcp, "etcd_keys_s": t_etcd, "etcd_over_tcp": t_etcd / t_tcp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 8, 32, 128 only")
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 8,16,32,64,128,256)")
    ap.add_argument("--settle", type=float, default=1.0, help="settle window of the rounds (s)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [8, 16, 32, 64, 128, 256]
    if args.quick and not args.sizes:
        sizes = [8, 32, 128]
    results: dict = {"benchmark": "rdzv_scale", "settle_s": args.settle, "scale": [], "bootstrap": []}
    with EmbeddedEtcd() as etcd:
        print(f"{'N':>5} {'round1 s':>9} {'writes':>7} {'reads':>6} {'fail-round s':>12} {'detect s':>9} "
              f"{'writes':>7} {'writes/N':>9}")  # fmt: skip
        for n in sizes:
            r = scale_round(etcd.endpoint, n, clients_per=8, settle=args.settle)
            results["scale"].append(r)
            if args.json:  # written as it goes: a size that never finishes leaves the smaller ones
                Path(args.json).write_text(json.dumps(results, indent=2))
            w1, w2 = r["first_round_ops"]["writes"], r["failure_round_ops"]["writes"]
            print(f"{n:>5} {r['first_round_s']:>9.2f} {w1:>7} {r['first_round_ops']['reads']:>6} "
                  f"{r['failure_round_s']:>12.2f} {r['detect_s']:>9.3f} {w2:>7} {w2 / n:>9.2f}",
                  flush=True)  # fmt: skip
        big = results["scale"][-1]
        print(f"N={big['n']}: failure round {big['failure_round_s']:.2f}s, target <= {TARGET_N256_S}s "
              f"(ratio {big['failure_round_s'] / TARGET_N256_S:.2f} of target); settle {args.settle}s "
              "of each round")  # fmt: skip
        print(f"\n{'ranks':>5} {'TCPStore s':>11} {'etcd keys s':>12} {'etcd/TCP':>9}")
        for n in (2, 4, 8) if args.quick else (2, 4, 8, 16):
            b = bootstrap(etcd.endpoint, n)
            results["bootstrap"].append(b)
            print(f"{n:>5} {b['tcpstore_s']:>11.4f} {b['etcd_keys_s']:>12.4f} {b['etcd_over_tcp']:>9.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
