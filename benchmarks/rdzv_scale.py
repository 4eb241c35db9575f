"""Scale test of the etcd3 rendezvous alone: N participants, spread over a few light processes, per round.

Each participant is what one agent runs (its own lease and keep-alive, its own join loop and etcd writes),
without torchrun or workers; participants run as threads of ``--processes`` host processes, so that N
participants do not all queue on one interpreter lock. Two watch set-ups (``--watch``):

- ``shared``: the participants of one host process read one watch of the run, as agents behind an etcd gRPC
  proxy would (it coalesces identical watches); one probe participant keeps a watch of its own, and its
  round time is reported apart. This is the figure the N=256 target is checked on.
- ``own``: every participant has its own watch stream, so etcd sends N events per round to each of N
  watchers and this machine decodes all N^2 of them; on 2 cores this measures the simulation's client CPU
  (reported per participant) more than the protocol.

For each N it forms a first round, then a
second one after one participant's lease is revoked (a failure round), and reports seconds per round (from
the driver's start signal to the last participant holding its rank), the client CPU each participant spent
in the round, and etcd operations per round counted by the client wrapper (writes = puts and successful
transaction writes; reads = range requests and watch set-ups; watch events delivered).
It also compares the process-group bootstrap exchange (every rank publishes its address, then reads all
others) through a TCPStore and through etcd keys (the etcd3-dynamic store).

    .venv/bin/python benchmarks/rdzv_scale.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.etcd.client import Etcd, OpCounts, connect
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings, run_view

TARGET_N256_S = 3.0
WATCH_MODES = {
    "shared": "one watch per host process (as behind an etcd gRPC proxy); one probe participant has its own",
    "own": "every participant has its own watch stream (N^2 events per round, all decoded on this machine)",
}
#: Seconds the driver waits for a host process to answer a command before it gives up on that size.
REPLY_TIMEOUT_S = 180.0


def snapshot(clients: list[Etcd]) -> OpCounts:
    total = OpCounts()
    for c in clients:
        for k, v in asdict(c.counts).items():
            setattr(total, k, getattr(total, k) + v)
    return total


def diff(a: OpCounts, b: OpCounts) -> dict[str, int]:
    return {k: getattr(b, k) - getattr(a, k) for k in asdict(a)}


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def host(
    conn: Connection,
    endpoint: str,
    settings: ProtocolSettings,
    ids: list[str],
    per_client: int,
    shared_watch: bool,
    probe: str | None,
) -> None:
    """One light process: runs the participants ``ids`` as threads and answers the driver's commands.

    Each participant has its own lease and keep-alive thread and its own join loop, as an agent does;
    ``per_client`` participants share one gRPC channel. With ``shared_watch`` the participants of this process
    read one watch of the run (as agents behind an etcd gRPC proxy, which coalesces identical watches),
    except ``probe``, which keeps a watch of its own; otherwise every participant has its own.
    Commands: ``join`` (all join concurrently; reply with the world sizes, the monotonic time the last one
    and the probe finished, op counts and CPU seconds), ``leave ID`` (revoke that participant's lease),
    ``waiting`` (reply with the monotonic time at which every remaining participant reports a node waiting),
    ``stop``.
    """
    clients = [connect(endpoint, timeout=30) for _ in range(max(1, -(-len(ids) // per_client)))]
    view = run_view(clients[0], settings.run_id) if shared_watch else None
    if view is not None:
        view.start()
    ps = {
        node: Participant(
            clients[i % len(clients)],
            settings,
            addr="127.0.0.1",
            node_id=node,
            view=None if node == probe else view,
        )
        for i, node in enumerate(ids)
    }
    pool = ThreadPoolExecutor(len(ps))
    list(pool.map(lambda p: p.start(), ps.values()))
    conn.send("ready")

    def join(p: Participant) -> tuple[int, float]:
        return p.join().world_size, time.monotonic()

    while True:
        cmd, arg = conn.recv()
        if cmd == "join":
            c0, t0 = snapshot(clients), cpu_s()
            out = dict(zip(ps, pool.map(join, ps.values()), strict=True))
            conn.send(
                {
                    "world_sizes": sorted({w for w, _ in out.values()}),
                    "done": max((t for _, t in out.values()), default=None),
                    "probe_done": out[probe][1] if probe in out else None,
                    "ops": diff(c0, snapshot(clients)),
                    "cpu_s": cpu_s() - t0,
                }
            )
        elif cmd == "leave":
            ps.pop(arg).leave()
            conn.send("left")
        elif cmd == "waiting":
            while not all(p.num_waiting() > 0 for p in ps.values()):
                time.sleep(0.005)
            conn.send(time.monotonic())
        else:
            for p in ps.values():
                p.leave()
            if view is not None:
                view.stop()
            for c in clients:
                c.close()
            conn.send("stopped")
            return


def scale_round(
    endpoint: str, n: int, processes: int, per_client: int, settle: float, shared_watch: bool
) -> dict:
    """A first round of ``n`` participants, then the round after one of them is lost (lease revoked)."""
    processes = max(1, min(processes, n))
    s = ProtocolSettings(
        run_id=f"scale-{n}", min_nodes=max(1, n - 1), max_nodes=n, lease_ttl=5, settle=settle
    )
    ids = [f"p{i:04d}" for i in range(n)]
    ctx = mp.get_context("spawn")
    hosts = []
    for k in range(processes):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=host,
            args=(child, endpoint, s, ids[k::processes], per_client, shared_watch, ids[0]),
            daemon=True,
        )  # fmt: skip
        proc.start()
        hosts.append((proc, parent))
    try:

        def reply(c: Connection) -> Any:
            if not c.poll(REPLY_TIMEOUT_S):
                raise RuntimeError(f"a participant host did not answer within {REPLY_TIMEOUT_S:.0f}s")
            return c.recv()

        for _, c in hosts:
            if reply(c) != "ready":
                raise RuntimeError("a participant host failed to start")

        def round_(members: list[tuple[Any, Connection]], expect: int) -> tuple[float, dict, float, float]:
            t0 = time.monotonic()
            for _, c in members:
                c.send(("join", None))
            replies = [reply(c) for _, c in members]
            sizes = {w for r in replies for w in r["world_sizes"]}
            if sizes != {expect}:
                raise RuntimeError(f"round formed with world sizes {sorted(sizes)}, expected {expect}")
            ops: dict[str, int] = {}
            for r in replies:
                for k, v in r["ops"].items():
                    ops[k] = ops.get(k, 0) + v
            probe = next(r["probe_done"] for r in replies if r["probe_done"] is not None)
            done = max(r["done"] for r in replies if r["done"] is not None)
            return done - t0, ops, sum(r["cpu_s"] for r in replies), probe - t0

        res: dict = {"n": n, "processes": processes, "watch": "shared" if shared_watch else "own"}
        res["first_round_s"], res["first_round_ops"], cpu1, res["probe_first_round_s"] = round_(hosts, n)
        victim_host = hosts[(n - 1) % processes][1]
        t1 = time.monotonic()
        victim_host.send(("leave", ids[-1]))
        reply(victim_host)
        for _, c in hosts:
            c.send(("waiting", None))
        seen = max(reply(c) for _, c in hosts)
        res["detect_s"] = seen - t1
        res["failure_round_s"], res["failure_round_ops"], cpu2, res["probe_failure_round_s"] = round_(
            hosts, n - 1
        )
        res["client_cpu_ms_per_participant"] = {
            "first_round": 1000 * cpu1 / n,
            "failure_round": 1000 * cpu2 / (n - 1),
        }
        for _, c in hosts:
            c.send(("stop", None))
            reply(c)
        return res
    finally:
        for proc, _ in hosts:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


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

    etcd = connect(endpoint)

    def via_etcd(i: int):
        return Etcd3Store(etcd, f"/elastic_train/boot-{n}/", timedelta(seconds=60))

    t_tcp = min(bootstrap_exchange(tcp, n) for _ in range(3))
    t_etcd = min(bootstrap_exchange(via_etcd, n) for _ in range(1))
    return {"n": n, "tcpstore_s": t_tcp, "etcd_keys_s": t_etcd, "etcd_over_tcp": t_etcd / t_tcp}


def _rows(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in rounds:
        if "error" in r:
            rows.append({"N": r["n"], "first round s": f"did not finish: {r['error']}"})
            continue
        w1, w2 = r["first_round_ops"]["writes"], r["failure_round_ops"]["writes"]
        rows.append({
            "N": r["n"], "first round s": r["first_round_s"], "writes (first)": w1,
            "failure detected s": r["detect_s"], "failure round s": r["failure_round_s"],
            "writes (failure)": w2, "writes/N": w2 / r["n"],
            "probe s": max(r["probe_first_round_s"], r["probe_failure_round_s"]),
            "client CPU ms / participant": r["client_cpu_ms_per_participant"]["failure_round"],
        })  # fmt: skip
    return rows


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (its rounds) with what the report shows: a table per watch set-up, the bootstrap comparison
    and the targets (the round time at N=256 and the writes per round, both on the shared watch)."""
    shared, own = doc.get("scale") or [], doc.get("scale_own") or []
    main_mode = "shared" if shared else "own"
    tables = []
    if shared and own:
        tables.append({"caption": WATCH_MODES["own"] + ":", "rows": _rows(own)})
    if doc.get("bootstrap"):
        rows = [
            {"ranks": b["n"], "TCPStore s": b["tcpstore_s"], "etcd keys s": b["etcd_keys_s"],
             "etcd / TCPStore": b["etcd_over_tcp"]}
            for b in doc["bootstrap"]
        ]  # fmt: skip
        caption = "Process-group bootstrap exchange (every rank publishes an address and reads all others):"
        tables.append({"caption": caption, "rows": rows})
    done = sorted((r for r in shared if "error" not in r), key=lambda r: r["n"])
    at256 = next((r for r in done if r["n"] == 256), None)
    big = {
        "name": "rendezvous alone at N=256 participants",
        "threshold": "<= 3 s per round (first and failure)",
    }
    if at256 is not None:
        slowest = max(at256["first_round_s"], at256["failure_round_s"])
        own256 = next((r for r in own if r["n"] == 256 and "error" not in r), None)
        big |= {
            "figure": f"{slowest:.2f} s (first round {at256['first_round_s']:.2f} s, failure round "
            f"{at256['failure_round_s']:.2f} s)",
            "status": "met" if slowest <= TARGET_N256_S else "missed",
            "why": "one watch per host process (as behind an etcd gRPC proxy), a probe participant with its "
            f"own watch finished in {max(at256['probe_first_round_s'], at256['probe_failure_round_s']):.2f} s"
            + (
                f"; with a watch per participant (N^2 events decoded on 2 cores) "
                f"{max(own256['first_round_s'], own256['failure_round_s']):.2f} s"
                if own256
                else ""
            ),
        }
    else:
        big["why"] = "no N=256 round in this run" + (" (quick mode?)" if done else "")
    writes = {
        "name": "etcd writes per rendezvous round",
        "threshold": "O(N): writes/N flat from smallest to largest N",
    }
    if len(done) >= 2:
        per = [
            max(r["first_round_ops"]["writes"], r["failure_round_ops"]["writes"]) / r["n"]
            for r in (done[0], done[-1])
        ]
        writes |= {
            "figure": f"{per[0]:.1f} writes/participant at N={done[0]['n']}, "
            f"{per[1]:.1f} at N={done[-1]['n']}",
            "status": "met" if per[1] / per[0] <= 2.0 else "missed",
            "why": "a round costs etcd O(N) writes, not O(N^2)",
        }
    return doc | {
        "title": "Rendezvous alone at scale",
        "description": (
            "N participants (each with its own lease, keep-alive, join loop and etcd writes, as an agent "
            f"without torchrun) run as threads of {doc['processes']} host processes. They form a round, then "
            "one participant's lease is revoked and the rest form the next (a failure round); settle window "
            f"{doc['settle_s']} s. Seconds run from the start signal to the last participant holding its "
            "rank. etcd operations: client counts (writes: first round, then failure round); CPU: the host "
            "processes' CPU time in the failure round divided by the participants. "
            + WATCH_MODES[main_mode]
            + ":"
        ),
        "figures": _rows(shared or own),
        "tables": tables,
        "targets": [big, writes],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 8, 32, 128 only")
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 8,16,32,64,128,256)")
    ap.add_argument("--settle", type=float, default=1.0, help="settle window of the rounds (s)")
    ap.add_argument(
        "--processes", type=int, default=8, help="host processes the participants are spread over"
    )
    ap.add_argument(
        "--watch",
        choices=("shared", "own", "both"),
        default="both",
        help="shared: the participants of one host process read one watch (one probe keeps its own); "
        "own: each has its own; both (default): the shared sizes, then the own sizes",
    )
    ap.add_argument("--per-client", type=int, default=8, help="participants sharing one gRPC channel")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [8, 16, 32, 64, 128, 256]
    if args.quick and not args.sizes:
        sizes = [8, 32, 128]
    results: dict = {
        "benchmark": "rdzv_scale",
        "settle_s": args.settle,
        "processes": args.processes,
        "per_client": args.per_client,
        "watch": args.watch,
        "bootstrap": [],
    }
    modes = ("shared", "own") if args.watch == "both" else (args.watch,)
    with EmbeddedEtcd() as etcd:
        for mode in modes:
            key = "scale" if mode == "shared" else "scale_own"
            results[key] = []
            print(f"\nwatch: {WATCH_MODES[mode]}")
            print(f"{'N':>5} {'round1 s':>9} {'writes':>7} {'reads':>6} {'fail-round s':>12} {'detect s':>9} "
                  f"{'writes':>7} {'writes/N':>9} {'probe s':>8} {'cpu ms/agent':>12}")  # fmt: skip
            for n in sizes:
                try:
                    r = scale_round(
                        etcd.endpoint, n, args.processes, args.per_client, args.settle, mode == "shared"
                    )
                except RuntimeError as exc:
                    print(f"{n:>5} did not finish: {exc}", flush=True)
                    results[key].append({"n": n, "watch": mode, "error": str(exc)})
                    break
                results[key].append(r)
                if args.json:  # written as it goes: a size that never finishes leaves the smaller ones
                    Path(args.json).write_text(json.dumps(summary(results), indent=2))
                w1, w2 = r["first_round_ops"]["writes"], r["failure_round_ops"]["writes"]
                probe = max(r["probe_first_round_s"], r["probe_failure_round_s"])
                print(f"{n:>5} {r['first_round_s']:>9.2f} {w1:>7} {r['first_round_ops']['reads']:>6} "
                      f"{r['failure_round_s']:>12.2f} {r['detect_s']:>9.3f} {w2:>7} {w2 / n:>9.2f} "
                      f"{probe:>8.2f} {r['client_cpu_ms_per_participant']['failure_round']:>12.1f}",
                      flush=True)  # fmt: skip
            big = results[key][-1]
            if "error" not in big:
                slow = max(big["first_round_s"], big["failure_round_s"])
                print(f"N={big['n']}: slowest round {slow:.2f}s, target <= {TARGET_N256_S}s "
                      f"(ratio {slow / TARGET_N256_S:.2f} of target); {args.processes} host processes on "
                      f"{os.cpu_count()} cores")  # fmt: skip
        print(f"\n{'ranks':>5} {'TCPStore s':>11} {'etcd keys s':>12} {'etcd/TCP':>9}")
        for n in (2, 4, 8) if args.quick else (2, 4, 8, 16):
            b = bootstrap(etcd.endpoint, n)
            results["bootstrap"].append(b)
            print(f"{n:>5} {b['tcpstore_s']:>11.4f} {b['etcd_keys_s']:>12.4f} {b['etcd_over_tcp']:>9.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(summary(results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
