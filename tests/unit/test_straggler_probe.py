"""An evicted node's health probe and its probation: what a probe rate means, what the node does with it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_train.rendezvous import probation as probation_module
from elastic_train.rendezvous.config import ProtocolSettings, run_prefix
from elastic_train.rendezvous.errors import RunFinished
from elastic_train.rendezvous.probation import Probation
from elastic_train.rendezvous.slownodes import EvictOrder, SlowNodes
from elastic_train.straggler import StragglerConfig
from elastic_train.straggler.probe import probe_verdict, run_probe

PREFIX = run_prefix("probe")

# -- the verdict --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rates", "healthy", "verdict", "device"),
    [
        ({"cpu": 40.0}, {"cpu": 100.0}, "slow", "cpu"),  # 2.5x slower
        ({"cpu": 100.0 / 1.5}, {"cpu": 100.0}, "slow", "cpu"),  # at the threshold
        ({"cpu": 70.0}, {"cpu": 100.0}, "healthy", "cpu"),  # 1.43x: within the threshold
        ({"cpu": 90.0, "cuda": 4.0}, {"cpu": 100.0, "cuda": 10.0}, "slow", "cuda"),  # one device slow
        ({"cpu": 90.0, "cuda": None}, {"cpu": 100.0, "cuda": 10.0}, "healthy", "cpu"),  # no answer
        ({"cpu": None}, {"cpu": 100.0}, "blind", None),  # no answer: no evidence
        ({"cpu": 40.0}, {}, "blind", None),  # no healthy rate to compare with
        ({"cuda": 4.0}, {"cpu": 100.0}, "blind", None),  # another device than the healthy one
    ],
)
def test_a_probe_is_slow_when_a_device_is_threshold_times_below_its_healthy_rate(
    rates: dict[str, float | None], healthy: dict[str, float], verdict: str, device: str | None
) -> None:
    v = probe_verdict(rates=rates, healthy_rates=healthy, slow_at=1.5)
    assert (v.verdict, v.device) == (verdict, device)
    assert v.fields()["verdict"] == verdict


# -- the probe process ------------------------------------------------------------------------------------


def _probe_proc(seconds: float) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "elastic_train.straggler.probe",
        "--device",
        "cpu",
        "--seconds",
        f"{seconds:g}",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rate(proc: subprocess.Popen[str]) -> float:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return float(json.loads(out.strip().splitlines()[-1])["rate"])


def test_the_probe_runs_in_a_process_of_its_own_and_reports_a_rate() -> None:
    rate = run_probe("cpu", seconds=0.3)
    assert rate is not None and rate > 0


def test_a_probe_of_an_absent_device_is_no_rate() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert run_probe("cuda", seconds=0.1) is None


def test_a_probe_held_stopped_nineteen_twentieths_of_the_time_measures_a_lower_rate() -> None:
    """What a throttled node's probe sees: the process runs a twentieth of the time (SIGSTOP/SIGCONT), so its
    rate is well below a free-running probe's (the best of one before and one after it: on a loaded machine
    one free probe alone can be held back, and a held one gets the scheduler's credit at each SIGCONT; the
    ``slow-node`` fault's quarter duty cycle then measures as little as 1.6 times below a free probe, this
    cycle 3 times below it with four busy processes beside it on two cores)."""
    free = _rate(_probe_proc(2.0))
    proc = _probe_proc(2.0)
    time.sleep(0.2)  # started (importing torch): the cycle holds it from here to its end
    try:
        while proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.19)
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.01)
    except ProcessLookupError:
        pass
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
    held = _rate(proc)
    free = max(free, _rate(_probe_proc(2.0)))
    assert free / held >= 2.0, (free, held)


def test_a_probe_that_does_not_answer_is_no_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    def command(code: str) -> Any:
        real = subprocess.Popen

        def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[str]:
            return real([sys.executable, "-c", code], **kw)

        return popen

    monkeypatch.setattr(subprocess, "Popen", command("import sys; print('Traceback ...'); sys.exit(1)"))
    assert run_probe() is None  # failed
    monkeypatch.setattr(subprocess, "Popen", command("import time; time.sleep(30)"))
    t0 = time.monotonic()
    assert run_probe(timeout=0.5) is None  # no answer in time: killed
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert run_probe(stop=stop) is None  # the agent stops: killed
    assert time.monotonic() - t0 < 10


# -- the healthy rate --------------------------------------------------------------------------------------


def test_the_healthy_rate_is_probed_at_window_reports_then_at_doubling_counts_never_while_flagged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU probe after the node's 3rd (``window``), 6th, 12th, ... report of a round; the best rate is
    kept; a flagged node, or one evicted before, measures none."""
    import os

    from elastic_train.node import Stats
    from elastic_train.rendezvous import slownodes

    rates = iter([50.0, 80.0, 60.0, 70.0, 90.0])
    asked: list[tuple[int, list[str]]] = []
    seen = [0]

    def probes(devices: list[str], stop: Any = None) -> dict[str, float | None]:
        asked.append((seen[0], devices))
        return {d: next(rates) for d in devices}

    monkeypatch.setattr(slownodes, "run_probes", probes)
    delays: list[float] = []
    monkeypatch.setattr(slownodes.random, "uniform", lambda a, b: delays.append(b) or 0.0)
    standing: dict[str, bytes] = {}
    view = SimpleNamespace(cond=threading.Lock(), get=standing.get)
    p = SimpleNamespace(
        round=4, node_id="n1", lease=SimpleNamespace(lease_id=9), view=view,
        etcd=SimpleNamespace(put=lambda *a: 1),
    )  # fmt: skip
    channel = SimpleNamespace(
        stats=lambda: {1: Stats(os.getpid(), 4, 10, time.time(), 0.0, busy_s=0.1, busy_steps=5)}
    )
    settings = ProtocolSettings(
        run_id="probe", min_nodes=2, max_nodes=3, straggler=StragglerConfig(policy="evict", window=3)
    )
    slow = SlowNodes(lambda: p, channel, settings, lambda order: None, lambda: True)  # type: ignore[arg-type]

    def report(n: int) -> None:
        for _ in range(n):
            seen[0] += 1
            slow._report(p)  # type: ignore[arg-type]
            deadline = time.monotonic() + 5
            while slow._probing and time.monotonic() < deadline:
                time.sleep(0.01)

    report(48)
    assert asked == [(n, ["cpu"]) for n in (3, 6, 12, 24, 48)]  # never the GPU while the workers train
    assert slow.healthy_rates == {"cpu": 90.0}  # the best
    assert delays == [3 * 2.0] * 5  # each after a random delay of up to window reports
    p.round, seen[0] = 5, 0  # a new round counts again
    standing[PREFIX + "straggler/n1"] = b"{}"  # flagged: its rate now is not a healthy one
    report(3)
    assert len(asked) == 5 and slow.healthy_rates == {"cpu": 90.0}


# -- the probation ------------------------------------------------------------------------------------------


class FakeEtcd:
    """What a probation asks of etcd: a lease, the standing record, whether the run closed."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.revoked: list[int] = []

    def lease_grant(self, ttl: int) -> int:
        return 7

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self.kv[key] = value
        return 1

    def get(self, key: str) -> Any:
        return SimpleNamespace(value=self.kv[key]) if key in self.kv else None

    def lease_revoke(self, lease: int) -> None:
        self.revoked.append(lease)


def probation(
    monkeypatch: pytest.MonkeyPatch,
    rates: list[float | None],
    *,
    healthy: float | None = 100.0,
    evictions: int = 1,
    **cfg: Any,
) -> tuple[Probation, list[float | None], list[str], FakeEtcd]:
    """A probation of node ``n1`` whose probes answer ``rates`` in turn (the probe calls are recorded)."""
    monkeypatch.setattr(probation_module, "PROBE_EVERY", 0.01)
    straggler = StragglerConfig(policy="evict", probation_seconds=0.0, **cfg)
    settings = ProtocolSettings(run_id="probe", min_nodes=2, max_nodes=3, straggler=straggler)
    slow = SlowNodes(lambda: None, None, settings, lambda order: None, lambda: True)  # type: ignore[arg-type]
    if healthy is not None:
        slow.healthy({"cpu": healthy})
    asked: list[float | None] = []
    queue = list(rates)

    def probe(devices: list[str]) -> dict[str, float | None]:
        assert devices == ["cpu"]  # the devices with a healthy rate
        rate = queue.pop(0) if len(queue) > 1 else queue[0]
        asked.append(rate)
        return {"cpu": rate}

    said: list[str] = []
    etcd = FakeEtcd()
    order = EvictOrder(node="n1", round=3, step=80, score=2.1, by="n0")
    return Probation(etcd, settings, order, evictions, slow, said.append, probe), asked, said, etcd  # type: ignore[arg-type]


def test_a_node_the_probe_finds_slow_waits_until_a_probe_finds_it_healthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slow at eviction (2.5x below its healthy rate, ``threshold`` 1.5); kept out until a probe is within
    ``clear_below`` (1.2): 1.43x is not, 1.11x is."""
    p, asked, said, etcd = probation(monkeypatch, [40.0, 45.0, 70.0, 90.0])
    p.serve()
    assert asked == [40.0, 45.0, 70.0, 90.0]
    assert p.slow.healthy_rates == {"cpu": 100.0}  # the best one is kept
    assert said == []
    record = json.loads(etcd.kv[PREFIX + "straggler/n1"])
    assert record["state"] == "probation" and "health probe" in record["why"]
    assert etcd.revoked == [7]  # the standing goes once the node rejoins


def test_a_node_the_probe_does_not_find_slow_rejoins_after_its_probation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe does not see what slowed it (a slow link, say): the trial judges, as without a probe."""
    p, asked, said, etcd = probation(monkeypatch, [95.0, 40.0])
    assert said == []
    p.serve()
    assert asked == [95.0]
    assert "in 0 s" in json.loads(etcd.kv[PREFIX + "straggler/n1"])["why"]


@pytest.mark.parametrize("why", ["no healthy rate", "probe off"])
def test_without_a_healthy_rate_or_with_probes_off_nothing_is_probed(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    kw: dict[str, Any] = {"healthy": None} if why == "no healthy rate" else {"probe_patience": 0.0}
    p, asked, said, _ = probation(monkeypatch, [40.0], **kw)
    p.serve()
    assert asked == [] and said == []


def test_a_node_still_slow_after_the_probe_patience_leaves_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p, asked, said, _ = probation(monkeypatch, [40.0], probe_patience=0.1)
    with pytest.raises(RunFinished, match="still finds it slow after 0.1 s"):
        p.serve()
    assert len(asked) >= 2 and len(said) == 1
    assert said[0].startswith("elastic-train: node n1 leaves the job") and "probe_patience" in said[0]


def test_after_max_trials_evictions_the_node_leaves_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    p, asked, said, _ = probation(monkeypatch, [40.0], evictions=3, max_trials=3)
    with pytest.raises(
        RunFinished, match=r"evicted as a slow node 3 times \(rendezvous.straggler.max_trials 3\)"
    ):
        p.serve()
    assert asked == [] and len(said) == 1


def test_a_run_that_finishes_while_the_node_probes_ends_the_probation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p, asked, said, etcd = probation(monkeypatch, [40.0])
    monkeypatch.setattr(probation_module, "PROBE_EVERY", 5.0)  # the next probe would be 5 s away
    threading.Timer(0.3, lambda: etcd.put(PREFIX + "closed", b"{}")).start()
    with pytest.raises(RunFinished, match="finished while node n1 was on probation"):
        p.serve()
    assert asked == [40.0, 40.0] and len(said) == 1  # at eviction, one after the probation; then the end
