"""``partition-full``: a node cut off from everything — etcd and its peers — while the job trains.

etcd and three torchrun agents (etcd3 rendezvous, a gloo DDP worker that counts its steps for the fence) each
run in a network namespace of their own, joined by a bridge (tests/netns.py); addresses exist only inside
those namespaces, which are deleted afterwards, also when the test fails. The victim's link is downed on the
bridge: its packets vanish, nobody sees a reset, so its worker would sit in a blocked collective for gloo's
whole timeout. Asserted: its workers are gone within TTL + 1.5 s (the fence), the others train at world 2,
after the heal the victim rejoins and the job trains at world 3 again, the healed cut spent one unit of the
failure budget, and no agent printed a traceback. Skipped, with the reason, where namespaces are refused.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_train.etcd.server import find_etcd_binary
from elastic_train.procs import tree
from elastic_train.rendezvous.fence import FENCE_GRACE, KILL_GRACE
from tests.helpers import wait_world
from tests.netns import Topology, environ_without_proxies, namespaces_refused

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "integration" / "rdzv_worker.py")
TTL = 2.0
CUT_S = 10.0
GONE_WITHIN = TTL + FENCE_GRACE + KILL_GRACE
RUN_ID = "part-full"


@pytest.fixture(scope="module")
def netns_ok() -> None:
    why = namespaces_refused()
    if why:
        pytest.skip(f"partition-full needs network namespaces: {why}")


def in_ns(net: Topology, host: str, code: str) -> str:
    """Run a Python snippet in ``host``'s namespace; its stdout."""
    env = dict(environ_without_proxies(), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*net.run_in(host), sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_partition_full_victim_fences_itself_and_rejoins(netns_ok, reaper, tmp_path: Path) -> None:
    hosts = ["etcd", "node0", "node1", "node2"]
    out = tmp_path / "steps.jsonl"
    with Topology(hosts) as net:
        try:
            _run(net, reaper, tmp_path, out)
        finally:
            reaper.reap()  # before the namespaces go


def _run(net: Topology, reaper, tmp_path: Path, out: Path) -> None:
    etcd_addr = net.addr["etcd"]
    endpoint = f"{etcd_addr}:2379"
    url = f"http://{endpoint}"
    env = environ_without_proxies()
    reaper.popen(
        [*net.run_in("etcd"), find_etcd_binary(), "--name", "e0", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://{etcd_addr}:2380", "--initial-advertise-peer-urls",
         f"http://{etcd_addr}:2380", "--initial-cluster", f"e0=http://{etcd_addr}:2380"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    in_ns(
        net,
        "etcd",
        "import time, urllib.request\n"
        "for _ in range(200):\n"
        "    try:\n"
        f"        urllib.request.urlopen('{url}/health', timeout=1); break\n"
        "    except Exception: time.sleep(0.1)\n"
        "else: raise SystemExit('etcd did not start')\n",
    )
    agents = {}
    for host in ("node0", "node1", "node2"):
        agent_env = dict(
            env, GLOO_SOCKET_IFNAME=net.dev[host], RDZV_WORKER_OUT=str(out), PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )  # fmt: skip
        cmd = [
            *net.run_in(host), sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3",
            "--nproc-per-node=1", "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={RUN_ID}",
            f"--rdzv-conf=lease_ttl={TTL:g},settle=1", f"--local-addr={net.addr[host]}",
            "--monitor-interval=0.1", "--max-restarts=100", WORKER,
        ]  # fmt: skip
        log = open(tmp_path / f"{host}.log", "wb")  # noqa: SIM115 - closed with the process
        agents[host] = reaper.popen(cmd, env=agent_env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    first = wait_world(out, 3, 0, 180)

    victim = "node0"  # the first node to join: it holds rank 0 and the round's store
    agent = next(p for p in tree(agents[victim].pid) if "torch.distributed.run" in " ".join(p.cmdline()))
    workers = [p for p in tree(agent.pid) if p.pid != agent.pid]
    assert workers
    net.cut(victim)
    cut = time.monotonic()
    _, alive = psutil.wait_procs(workers, timeout=GONE_WITHIN + 5)
    gone_s = time.monotonic() - cut
    assert not alive and gone_s <= GONE_WITHIN, f"the victim's workers were gone after {gone_s:.2f}s"
    smaller = wait_world(out, 2, first["round"], 90)
    trains_s = time.monotonic() - cut
    print(
        f"partition-full: the victim's workers gone {gone_s:.2f}s after the cut, "
        f"world 2 trains at {trains_s:.1f}s"
    )

    time.sleep(max(0.0, CUT_S - (time.monotonic() - cut)))
    net.heal(victim)
    wait_world(out, 3, smaller["round"], 90)
    failures = in_ns(
        net,
        "node1",
        "from elastic_train.etcd.client import connect\n"
        f"print(connect('{endpoint}').get('/elastic_train/{RUN_ID}/failures').value.decode())\n",
    )
    assert failures == "1"
    assert agents[victim].poll() is None
    for (
        host
    ) in agents:  # the agents print no traceback (a worker reset by its peers may: that is the script's)
        text = (tmp_path / f"{host}.log").read_text(errors="replace")
        assert not [ln for ln in text.splitlines() if "Traceback" in ln and not ln.startswith("[rank")], host
