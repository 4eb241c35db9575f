"""Scale test of the etcd3 rendezvous alone: N participants, spread over a few light processes, per round.

Each participant is what one agent runs (its own lease, its own join loop and etcd writes), without torchrun
or workers; participants run as threads of ``--processes`` host processes, so that N participants do not
all queue on one interpreter lock. Two watch set-ups (``--watch``):

- ``shared``: the participants of one host process read one watch of the run, as agents behind an etcd gRPC
  proxy would (it coalesces identical watches); one probe participant keeps a watch of its own, and its
  round time is reported apart. This is the figure the targets are checked on.
- ``own``: every participant has its own watch stream, so etcd sends N events per round to each of N
  watchers and this machine decodes all N^2 of them; on 2 cores this measures the simulation's client CPU
  (reported per participant) more than the protocol. Sizes above ``--own-max`` are skipped.

The hosts refresh their participants' leases over one keep-alive stream per interval (``--keepalive
batch``, :class:`~elastic_train.rendezvous.view.KeepAliveBatch`): etcd gets the same keep-alive requests, but
one gRPC stream per lease per interval costs about a millisecond of client CPU, which at a few thousand
simulated nodes on 2 cores starves everything else (``--keepalive own`` measures that).

For each N it forms a first round, then a second one after one participant's lease is revoked (a failure
round), and reports per round: seconds (from the driver's start signal to the last participant holding its
rank), etcd requests counted by the client wrapper (writes = puts and successful transaction writes;
reads = range requests and watch set-ups; leases = keep-alives, grants, revokes), watch events and bytes
delivered (protobuf size of the responses) per watch and in all, the client CPU the host processes spent per
participant, and etcd's own CPU. From these it projects what an agent on a machine of its own would spend
(its client CPU: the host's CPU per participant, less the simulation's N-fold decoding of shared state) and
what one etcd serves with a watch per agent (the bytes one watch received, times N). It also compares the
process-group bootstrap exchange (every rank publishes its address, then reads all others) through a
TCPStore and through etcd keys (the etcd3-dynamic store). A size that does not finish says why in one line
and ends that watch set-up's sizes.

    .venv/bin/python benchmarks/rdzv_scale.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.etcd.client import Etcd, OpCounts, connect
from elastic_train.etcd.server import EmbeddedEtcd
from elastic_train.log import LoggingConfig, configure_logging
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings, run_view
from elastic_train.rendezvous.view import KeepAliveBatch, RunView

TARGETS_S = {256: 3.0, 1024: 3.0, 4096: 10.0}
HEADER = (
    f"{'N':>5} {'round':>8} {'s':>6} {'probe s':>8} {'detect s':>9} {'req/N':>6} {'ev/watch':>9} "
    f"{'KB/watch':>9} {'MB all':>7} {'cpu ms/N':>9} {'etcd cpu s':>10} {'lost':>5} {'ka max s':>8}"
)
WATCH_MODES = {
    "shared": "one watch per host process (as behind an etcd gRPC proxy); one probe participant has its own",
    "own": "every participant has its own watch stream (N^2 events per round, all decoded on this machine)",
}
#: Seconds the driver waits for a host process to answer a command before it gives up on that size.
REPLY_TIMEOUT_S = 180.0
#: Seconds a participant's join may take before the size is given up (the protocol's join timeout).
JOIN_TIMEOUT_S = 60.0
#: The lease TTL of the simulated nodes (the keep-alive runs every TTL/3).
LEASE_TTL_S = 5.0


def node_ids(n: int) -> list[str]:
    """Node ids as long as an agent's (``new_node_id``: host, pid, random suffix), so that bytes watched
    are what a real job's are."""
    return [f"worker-{i:05d}-{100000 + i}-{(i * 2654435761) % 16**6:06x}" for i in range(n)]


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


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds a thread of this process has used so far (0 when unknown)."""
    if thread is None or thread.native_id is None:
        return 0.0
    return proc_cpu_s(os.getpid(), f"/task/{thread.native_id}")


def proc_cpu_s(pid: int | None, task: str = "") -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}{task}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Host:
    """One light process's participants: threads that each run one node, and the commands of the driver.

    Each participant has its own lease (refreshed by the host's :class:`KeepAliveBatch`, or by a thread of
    its own) and its own join loop, as an agent does; ``per_client`` participants share one gRPC channel.
    With ``shared_watch`` the participants of this process read one watch of the run (as agents behind an
    etcd gRPC proxy, which coalesces identical watches), except ``probe``, which keeps a watch of its own;
    otherwise every participant has its own.
    """

    def __init__(
        self,
        endpoint: str,
        settings: ProtocolSettings,
        ids: list[str],
        *,
        per_client: int,
        shared_watch: bool,
        probe: str | None,
        batch_keepalive: bool,
    ) -> None:
        self.clients = [connect(endpoint, timeout=30) for _ in range(max(1, -(-len(ids) // per_client)))]
        self.watch_clients: list[Etcd] = []
        self.view: RunView | None = None
        if shared_watch:
            self.watch_clients.append(connect(endpoint, timeout=30))
            self.view = run_view(self.watch_clients[0], settings.run_id)
            self.view.start()
        self.probe = probe
        self.batch = KeepAliveBatch(self.clients[0], LEASE_TTL_S / 3) if batch_keepalive else None
        self.ps: dict[str, Participant] = {}
        for i, node in enumerate(ids):
            p = Participant(
                self.clients[i % len(self.clients)],
                settings,
                addr="127.0.0.1",
                node_id=node,
                view=None if node == probe else self.view,  # None: a watch of its own
            )
            p.lease.batch = self.batch
            self.ps[node] = p
        self.pool = ThreadPoolExecutor(max(1, len(self.ps)))
        self._base: tuple[OpCounts, OpCounts, float, int] = (OpCounts(), OpCounts(), 0.0, 0)
        self._unanswered = 0
        self._watch_cpu = 0.0

    def all_clients(self) -> list[Etcd]:
        return self.clients + self.watch_clients

    def start(self) -> None:
        list(self.pool.map(lambda p: p.start(), self.ps.values()))

    def mark(self) -> None:
        """Take the baselines the next :meth:`join` reports against (every host before any joins: a host
        that got its command later would otherwise miss the others' joins its watch already delivered)."""
        self._base = (snapshot(self.clients), snapshot(self.watch_clients), cpu_s(), self.losses())
        self._watch_cpu = thread_cpu_s(self.view._thread if self.view else None)
        self._unanswered = self.batch.unanswered if self.batch else 0
        if self.batch:
            self.batch.slowest = 0.0

    def join(self) -> dict[str, Any]:
        """Every participant joins at once; the world sizes, the monotonic time the last one and the probe
        finished, etcd op counts of the participants (their own watches included) and of the host's shared
        watch, CPU seconds and leases lost meanwhile."""
        c0, w0, t0, lost0 = self._base

        def one(p: Participant) -> tuple[int, float]:
            return p.join().world_size, time.monotonic()

        try:
            out = dict(zip(self.ps, self.pool.map(one, self.ps.values()), strict=True))
        except Exception as exc:
            raise RuntimeError(f"{exc} ({self.describe()})") from exc
        return {
            "world_sizes": sorted({w for w, _ in out.values()}),
            "done": max((t for _, t in out.values()), default=None),
            "probe_done": out[self.probe][1] if self.probe in out else None,
            "ops": diff(c0, snapshot(self.clients)),
            "shared_watch_ops": diff(w0, snapshot(self.watch_clients)) if self.view else None,
            "cpu_s": cpu_s() - t0,
            "watch_cpu_s": thread_cpu_s(self.view._thread if self.view else None) - self._watch_cpu,
            "leases_lost": self.losses() - lost0,
            "keepalive_slowest_s": self.batch.slowest if self.batch else None,
            "keepalive_unanswered": self.batch.unanswered - self._unanswered if self.batch else None,
        }

    def describe(self) -> str:
        """What this host's view shows of the run: live nodes, joins by target round, the last round."""
        p = next(iter(self.ps.values()))
        with p.view.cond:
            live = p.view.under("nodes/")
            targets: dict[int, int] = {}
            for node, j in p.run.joins().items():
                if node in live:
                    targets[j.target] = targets.get(j.target, 0) + 1
            rec, _ = p.run.round_record()
            seen = p.view.revision
        asking = ", ".join(f"{n} for round {t}" for t, n in sorted(targets.items()))
        try:
            _, now = self.clients[0].get_prefix("/elastic_train/none/")
        except Exception:
            now = -1
        ka = (
            f", keep-alive exchanges up to {self.batch.slowest:.2f} s, {self.batch.unanswered} unanswered"
            if self.batch
            else ""
        )
        return (
            f"this host's view: {len(live)} live nodes, joins {asking or 'none'}, last round "
            f"{rec.round if rec else 'none'}, at revision {seen} of {now}; {self.losses()} leases lost{ka}"
        )

    def losses(self) -> int:
        return sum(p.lease.losses for p in self.ps.values())

    def leave(self, node: str) -> None:
        self.ps.pop(node).leave()

    def sync(self, revision: int) -> None:
        """Wait until every view of this host has reached ``revision`` (the participants' start shows)."""
        for view in {id(p.view): p.view for p in self.ps.values()}.values():
            with view.cond:
                while view.revision < revision:
                    view.wait_revision(revision, 1.0)

    def waiting(self, gone: str) -> float:
        """Monotonic time at which every view of this host shows ``gone``'s node key deleted; then every
        remaining participant must report a node waiting (checked once each, after the clock stopped)."""
        views = {id(p.view): p.view for p in self.ps.values()}
        for view in views.values():
            with view.cond:
                while view.get("nodes/" + gone) is not None:
                    view.cond.wait(1.0)
        seen = time.monotonic()
        quiet = [n for n, p in self.ps.items() if p.num_waiting() <= 0]
        if quiet:
            raise RuntimeError(f"{len(quiet)} participants do not report a node waiting after {gone} left")
        return seen

    def stop(self) -> None:
        for p in self.ps.values():
            p.leave()
        if self.batch is not None:
            self.batch.stop()
        if self.view is not None:
            self.view.stop()
        for c in self.all_clients():
            c.close()


def host(conn: Connection, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A host process: builds a :class:`Host`, then answers the driver's commands (``join``, ``leave ID``,
    ``waiting ID``, ``stop``) until ``stop``. Any failure is answered as ``("error", one line)``."""
    configure_logging(LoggingConfig(level="warning"))
    h: Host | None = None
    try:
        h = Host(*args, **kwargs)
        h.start()
        conn.send(("ok", "ready"))
        while True:
            cmd, arg = conn.recv()
            if cmd == "join":
                conn.send(("ok", h.join()))
            elif cmd == "leave":
                h.leave(arg)
                conn.send(("ok", "left"))
            elif cmd == "waiting":
                conn.send(("ok", h.waiting(arg)))
            elif cmd == "mark":
                h.mark()
                conn.send(("ok", "marked"))
            elif cmd == "sync":
                h.sync(arg)
                conn.send(("ok", "synced"))
            else:
                h.stop()
                conn.send(("ok", "stopped"))
                return
    except BaseException as exc:  # one line for the driver, whatever broke
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" at {Path(last[0].filename).name}:{last[0].lineno}" if last else ""
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"
        with contextlib.suppress(OSError, EOFError):
            conn.send(("error", line))


def sum_ops(dicts: list[dict[str, int] | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def scale_round(
    etcd: EmbeddedEtcd,
    n: int,
    processes: int,
    per_client: int,
    settle: float,
    shared_watch: bool,
    batch_keepalive: bool,
) -> dict:
    """A first round of ``n`` participants, then the round after one of them is lost (lease revoked)."""
    processes = max(1, min(processes, n))
    s = ProtocolSettings(
        run_id=f"scale-{n}-{'shared' if shared_watch else 'own'}",
        min_nodes=max(1, n - 1),
        max_nodes=n,
        lease_ttl=LEASE_TTL_S,
        settle=settle,
        join_timeout=JOIN_TIMEOUT_S,
    )
    ids = node_ids(n)
    ctx = mp.get_context("spawn")
    hosts = []
    for k in range(processes):
        parent, child = ctx.Pipe()
        kwargs = {"per_client": per_client, "shared_watch": shared_watch, "probe": ids[0],
                  "batch_keepalive": batch_keepalive}  # fmt: skip
        args = (child, (etcd.endpoint, s, ids[k::processes]), kwargs)
        proc = ctx.Process(target=host, args=args, daemon=True)
        proc.start()
        hosts.append((proc, parent))

    def reply(c: Connection, what: str, timeout: float = REPLY_TIMEOUT_S) -> Any:
        try:
            if not c.poll(timeout):
                raise RuntimeError(f"a participant host did not answer {what} within {timeout:.0f}s")
            status, value = c.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"a participant host died during {what} ({type(exc).__name__})") from None
        if status == "error":
            raise RuntimeError(f"a participant host failed during {what}: {value}")
        return value

    try:
        t_start = time.monotonic()
        for _, c in hosts:
            reply(c, "start", timeout=REPLY_TIMEOUT_S + n * 0.05)
        with connect(etcd.endpoint) as probe_client:  # the rounds start once every view shows the starts
            _, revision = probe_client.get_prefix("/elastic_train/none/")
        for _, c in hosts:
            c.send(("sync", revision))
        for _, c in hosts:
            reply(c, "the views' catching up")
        res: dict = {
            "n": n, "processes": processes, "watch": "shared" if shared_watch else "own",
            "keepalive": "batch" if batch_keepalive else "own", "start_s": time.monotonic() - t_start,
        }  # fmt: skip

        def round_(members: list[tuple[Any, Connection]], expect: int, what: str) -> dict[str, Any]:
            for _, c in members:
                c.send(("mark", None))
            for _, c in members:
                reply(c, "the baselines")
            e0 = proc_cpu_s(etcd.pid)
            t0 = time.monotonic()
            for _, c in members:
                c.send(("join", None))
            replies = [reply(c, what) for _, c in members]
            etcd_cpu = proc_cpu_s(etcd.pid) - e0
            sizes = {w for r in replies for w in r["world_sizes"]}
            if sizes != {expect}:
                raise RuntimeError(f"{what} formed with world sizes {sorted(sizes)}, expected {expect}")
            probe = next(r["probe_done"] for r in replies if r["probe_done"] is not None)
            done = max(r["done"] for r in replies if r["done"] is not None)
            shared = [r["shared_watch_ops"] for r in replies if r["shared_watch_ops"]]
            ops = sum_ops([r["ops"] for r in replies] + shared)
            # Events and bytes one agent's own watch receives: a host's shared watch sees every event of the
            # run; with a watch per participant, the total over the N watches divided by them.
            per_watch = (
                max(shared, key=lambda o: o["watch_bytes"])
                if shared
                else {k: v // expect for k, v in ops.items()}
            )
            cpu = sum(r["cpu_s"] for r in replies)
            # What one agent would spend on a machine of its own: its share of the hosts' CPU without the
            # shared watches, plus one whole watch (a host's shared watch decodes what an agent's would).
            watch_cpu = [r["watch_cpu_s"] for r in replies if shared]
            agent_ms = 1000 * ((cpu - sum(watch_cpu)) / expect + (max(watch_cpu) if watch_cpu else 0.0))
            return {
                "s": done - t0,
                "probe_s": probe - t0,
                "ops": ops,
                "watch_bytes_per_agent": per_watch["watch_bytes"],
                "watch_events_per_agent": per_watch["watch_events"],
                "client_cpu_ms_per_participant": 1000 * cpu / expect,
                "agent_cpu_ms": agent_ms,
                "etcd_cpu_s": etcd_cpu,
                "leases_lost": sum(r["leases_lost"] for r in replies),
                "keepalive_slowest_s": max((r["keepalive_slowest_s"] or 0.0) for r in replies),
                "keepalive_unanswered": sum((r["keepalive_unanswered"] or 0) for r in replies),
            }

        first = round_(hosts, n, "the first round")
        victim = ids[-1]
        victim_host = hosts[(n - 1) % processes][1]
        t1 = time.monotonic()
        victim_host.send(("leave", victim))
        reply(victim_host, "the leave")
        for _, c in hosts:
            c.send(("waiting", victim))
        seen = max(reply(c, "the failure detection") for _, c in hosts)
        res["detect_s"] = seen - t1
        second = round_(hosts, n - 1, "the failure round")
        res["client_cpu_ms_per_participant"] = {}
        for key, r in (("first_round", first), ("failure_round", second)):
            res[f"{key}_s"] = r.pop("s")
            res[f"probe_{key}_s"] = r.pop("probe_s")
            res[f"{key}_ops"] = r.pop("ops")
            res["client_cpu_ms_per_participant"][key] = r.pop("client_cpu_ms_per_participant")
            res[key] = r
        for _, c in hosts:
            c.send(("stop", None))
            reply(c, "the stop")
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


def hot_exchange(n: int) -> dict:
    """What a hot re-formation adds to the failure round for ``n`` agents, without workers: each agent's
    decision (:func:`elastic_train.rendezvous.hot.decide` on the observation a lost member makes), then
    torchrun's rank exchange over the round's TCPStore on its rank 0 as :func:`~elastic_train.rendezvous.
    exchange.exchange_ranks` runs it: every agent writes its part, waits with non-blocking checks until all
    N are written (paced as :func:`~elastic_train.rendezvous.exchange.await_members` paces them), agent 0
    reads them all (one multi_get) and writes each agent's ranks, which each agent reads. One thread and
    one store client per agent, all on this machine."""
    import torch.distributed as dist

    from elastic_train.rendezvous import exchange
    from elastic_train.rendezvous.hot import Observation, decide

    t0 = time.perf_counter()
    obs = Observation(1.0, 7, engaged=True, waiting=1, lost=("gone",), announced_at=None)
    for _ in range(n):
        decide(obs)
    decide_s = time.perf_counter() - t0
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )

    def client(_: int) -> Any:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=120))

    # Each TCPStore connection looks up the peer's name on both sides (a DNS PTR query for ::ffff:127.0.0.1,
    # which /etc/hosts does not list); a resolver that drops some of a burst of queries stalls that
    # connection for glibc's 5 s timeout. Made one after another, the 1,023 clients took 200 s here (one
    # query in about 25 dropped); 64 at a time, 10 s. Setup only: the exchange is timed below.
    with ThreadPoolExecutor(64) as pool:
        stores = [server, *pool.map(client, range(n - 1))]
    barrier = threading.Barrier(n)
    keys = [f"role/{i}" for i in range(n)]

    spacing = min(exchange.MAX_SPACING, exchange.SPACING_PER_AGENT * n)

    def agent(i: int) -> None:
        st = stores[i]
        barrier.wait()
        st.set(keys[i], json.dumps({"role": "default", "rank": i, "local_world_size": 1}).encode())
        st.add("parts", 1)
        while st.add("parts", 0) < n:  # await_members' looks, as it paces them
            time.sleep(spacing + 0.005)
        if i == 0:
            infos = [json.loads(v) for v in st.multi_get(keys)]
            st.multi_set([f"ranks/{k['rank']}" for k in infos], [str(k["rank"]).encode() for k in infos])
        st.get(f"ranks/{i}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(agent, range(n)))
    exchange_s = time.perf_counter() - t0
    stores.clear()
    return {"n": n, "decide_s": round(decide_s, 5), "exchange_s": round(exchange_s, 3)}


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


def projection(r: dict) -> dict[str, float]:
    """What the protocol costs at this N apart from the simulation: the slower round's client CPU per
    participant, the CPU the 2 cores spent on that round in all (hosts + etcd), and etcd's watch egress
    with a watch per agent (bytes one watch received x N)."""
    slow = max(("first_round", "failure_round"), key=lambda k: r[f"{k}_s"])
    k, cpu_ms = r[slow], r["client_cpu_ms_per_participant"][slow]
    n = r["n"] - (1 if slow == "failure_round" else 0)
    total_cpu = cpu_ms * n / 1000 + k["etcd_cpu_s"]
    return {
        "round": slow,
        "client_cpu_ms_per_participant": cpu_ms,
        "agent_cpu_ms": k["agent_cpu_ms"],
        "machine_cpu_s": total_cpu,
        "cpu_bound_s": total_cpu / (os.cpu_count() or 1),
        "watch_mb_per_agent": k["watch_bytes_per_agent"] / 1e6,
        "watch_mb_all_agents_own_watch": k["watch_bytes_per_agent"] * n / 1e6,
    }


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
        if "projection" in r:  # requests, bytes watched and the projection (runs since keep-alive batching)
            p, requests = (
                r["projection"],
                max(r["first_round_ops"]["requests"], r["failure_round_ops"]["requests"]),
            )
            rows[-1] |= {
                "requests/N": requests / r["n"],
                "KB watched / agent": p["watch_mb_per_agent"] * 1e3, "agent CPU ms": p["agent_cpu_ms"],
                "machine CPU s": p["machine_cpu_s"],
            }  # fmt: skip
    return rows


def size_target(n: int, rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The round-time target at ``n`` participants (:data:`TARGETS_S`), when this run tried that size."""
    r = next((r for r in rounds if r["n"] == n), None)
    if r is None:
        return None
    t: dict[str, Any] = {
        "name": f"rendezvous alone at N={n} participants",
        "threshold": f"<= {TARGETS_S[n]:g} s per round (first and failure)",
    }
    if "error" in r:
        return t | {"status": "missed", "figure": "did not finish", "why": r["error"]}
    slowest = max(r["first_round_s"], r["failure_round_s"])
    why = f"the 2 cores spent {r['projection']['machine_cpu_s']:.2f} CPU-s on the slower round" if (
        "projection" in r
    ) else ""  # fmt: skip
    return t | {
        "figure": f"{slowest:.2f} s (first round {r['first_round_s']:.2f} s, failure round "
        f"{r['failure_round_s']:.2f} s)",
        "status": "met" if slowest <= TARGETS_S[n] else "missed",
        "why": why,
    }


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
    if doc.get("hot"):
        rows = [
            {"N": h["n"], "decisions s (all N)": h["decide_s"], "rank exchange s": h["exchange_s"],
             "failure round s": h["failure_round_s"], "hot re-formation s": h["reformation_s"]}
            for h in doc["hot"]
        ]  # fmt: skip
        caption = (
            "The hot path's re-formation without workers (each agent's decision, the failure round above, "
            "torchrun's rank exchange over the round's TCPStore, every agent a thread with its own client):"
        )
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
            "status": "met" if slowest <= TARGETS_S[256] else "missed",
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
        "targets": [big, writes]
        + [t for n in sorted(TARGETS_S) if n > 256 and (t := size_target(n, shared)) is not None],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 8, 32, 128 only")
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 8,16,32,64,128,256,1024,4096)")
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
    ap.add_argument("--own-max", type=int, default=256, help="largest N run with a watch per participant")
    ap.add_argument(
        "--keepalive",
        choices=("batch", "own"),
        default="batch",
        help="batch (default): a host refreshes its participants' leases over one stream per interval; "
        "own: a keep-alive thread and stream per participant, as an agent",
    )
    ap.add_argument("--per-client", type=int, default=64, help="participants sharing one gRPC channel")
    ap.add_argument(
        "--etcd-data",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="directory etcd keeps its data under (default /dev/shm: memory, as fast as the SSD a production "
        "etcd wants; this machine's shared disk takes up to tens of ms a sync under others' load)",
    )
    ap.add_argument("--hot-sizes", default="1024", help="N of the hot re-formation's rank exchange ('' none)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    configure_logging(LoggingConfig(level="warning"))
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [8, 16, 32, 64, 128, 256, 1024, 4096]
    if args.quick and not args.sizes:
        sizes = [8, 32, 128]
    results: dict = {
        "benchmark": "rdzv_scale",
        "settle_s": args.settle,
        "processes": args.processes,
        "per_client": args.per_client,
        "watch": args.watch,
        "keepalive": args.keepalive,
        "etcd_data": args.etcd_data,
        "cores": os.cpu_count(),
        "bootstrap": [],
    }
    modes = ("shared", "own") if args.watch == "both" else (args.watch,)
    data_dir = tempfile.mkdtemp(prefix="rdzv-scale-etcd-", dir=args.etcd_data)
    try:
        run_sizes(args, sizes, modes, results, data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(results), indent=2))
    return 0


def run_sizes(args: argparse.Namespace, sizes: list[int], modes: tuple[str, ...], results: dict,
              data_dir: str) -> None:  # fmt: skip
    """Every size of every watch set-up, then the bootstrap comparison, against one etcd in ``data_dir``."""
    with EmbeddedEtcd(data_dir=data_dir) as etcd:
        for mode in modes:
            key = "scale" if mode == "shared" else "scale_own"
            results[key] = []
            print(f"\nwatch: {WATCH_MODES[mode]}; keep-alives: {args.keepalive}")
            print(HEADER)
            for n in sizes:
                if mode == "own" and n > args.own_max:
                    print(f"{n:>5} skipped: a watch per participant decodes N^2 events here (--own-max "
                          f"{args.own_max})")  # fmt: skip
                    continue
                try:
                    r = scale_round(
                        etcd, n, args.processes, args.per_client, args.settle, mode == "shared",
                        args.keepalive == "batch",
                    )  # fmt: skip
                except RuntimeError as exc:
                    print(f"{n:>5} did not finish: {exc}", flush=True)
                    results[key].append({"n": n, "watch": mode, "error": str(exc)})
                    break
                r["projection"] = projection(r)
                results[key].append(r)
                if args.json:  # written as it goes: a size that never finishes leaves the smaller ones
                    Path(args.json).write_text(json.dumps(summary(results), indent=2))
                for name in ("first_round", "failure_round"):
                    k, ops = r[name], r[f"{name}_ops"]
                    detect = f"{r['detect_s']:.3f}" if name == "failure_round" else ""
                    s, probe = r[f"{name}_s"], r[f"probe_{name}_s"]
                    print(f"{n:>5} {name.split('_')[0]:>8} {s:>6.2f} {probe:>8.2f} "
                          f"{detect:>9} {ops['requests'] / n:>6.2f} {k['watch_events_per_agent']:>9} "
                          f"{k['watch_bytes_per_agent'] / 1e3:>9.1f} {ops['watch_bytes'] / 1e6:>7.2f} "
                          f"{r['client_cpu_ms_per_participant'][name]:>9.2f} {k['etcd_cpu_s']:>10.2f} "
                          f"{k['leases_lost']:>5} {k['keepalive_slowest_s']:>8.2f}", flush=True)  # fmt: skip
                p = r["projection"]
                target = TARGETS_S.get(n)
                slow = max(r["first_round_s"], r["failure_round_s"])
                met = (
                    ""
                    if target is None
                    else f" (target <= {target:g}s: {'met' if slow <= target else 'MISSED'})"
                )
                print(f"      N={n}: slowest round {slow:.2f}s{met}"
                      + f"; the 2 cores spent {p['machine_cpu_s']:.2f} CPU-s on it ({p['cpu_bound_s']:.2f}s "
                      f"of wall time at best); an agent of its own: {p['agent_cpu_ms']:.2f} "
                      f"ms CPU, {p['watch_mb_per_agent']:.2f} MB watched; a watch per agent: "
                      f"{p['watch_mb_all_agents_own_watch']:.0f} MB from etcd", flush=True)  # fmt: skip
        results["hot"] = []
        for n in [int(x) for x in args.hot_sizes.split(",") if x.strip()]:
            h = hot_exchange(n)
            failure = next((r["failure_round_s"] for r in results.get("scale", []) if r.get("n") == n), None)
            h["failure_round_s"] = failure
            h["reformation_s"] = round(failure + h["decide_s"] + h["exchange_s"], 3) if failure else None
            results["hot"].append(h)
            total = f"; with the failure round {h['reformation_s']:.2f}s" if failure else ""
            print(f"hot re-formation at N={n}: decisions {h['decide_s'] * 1e3:.1f} ms (all N), rank exchange "
                  f"{h['exchange_s']:.2f}s{total}", flush=True)  # fmt: skip
            if args.json:
                Path(args.json).write_text(json.dumps(summary(results), indent=2))
        print(f"\n{'ranks':>5} {'TCPStore s':>11} {'etcd keys s':>12} {'etcd/TCP':>9}")
        for n in (2, 4, 8) if args.quick else (2, 4, 8, 16):
            b = bootstrap(etcd.endpoint, n)
            results["bootstrap"].append(b)
            print(f"{n:>5} {b['tcpstore_s']:>11.4f} {b['etcd_keys_s']:>12.4f} {b['etcd_over_tcp']:>9.1f}x")


if __name__ == "__main__":
    sys.exit(main())
