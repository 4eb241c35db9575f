"""Hot recovery on NCCL (skipped where no CUDA GPU is visible; the multi-process test needs one GPU per rank).

- In one process: :func:`~elastic_train.train.group.shutdown` aborts the NCCL group and the next one forms on
  the same device; the model's CUDA tensors stay where they were, untouched.
- Across processes (>= 2 GPUs): a rank killed with SIGKILL makes the survivor's collective fail (NCCL's
  watchdog in ``CleanUpOnly`` mode aborts the communicator and the next collective raises); it re-forms
  in-process through the channel, keeps its pid, and its weights stay on the device at the same address.
  (The harness itself, with ``--backend gloo`` on the CPU, passes the same checks.)
- A CUDA error that poisons the context (a device-side assertion) is not re-formed in-process: the worker says
  why in one ``cuda_context_lost`` event and exits (its agent would restart it).

NCCL's peer-to-peer and shared-memory transports are turned off so that the ranks on one machine talk over
sockets as ranks on different machines do: a killed peer then closes its connections and NCCL reports a
remote error (through NVLink a dead peer may only be noticed by the collective timeout).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.envvars import ENV_NODE_DIR
from elastic_train.node import AgentChannel, Assignment
from elastic_train.train.env import WorkerEnv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hot_nccl_worker.py")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Seconds a step line, a request or the end of a worker may take (NCCL's first init is slow).
WAIT = 120.0


def _port() -> int:
    from elastic_train.net import free_port

    return free_port("127.0.0.1")


def test_an_aborted_nccl_group_re_forms_on_the_same_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from elastic_train.train import group

    def environ(port: int) -> WorkerEnv:  # env:// reads the address from os.environ
        for name, value in {**base, "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        return WorkerEnv.from_environ(os.environ)

    base = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    world = group.init("nccl", env=environ(_port()))
    try:
        assert world.backend == "nccl"
        model = torch.nn.Linear(512, 512, device=world.device)
        before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
        one = torch.ones(1, device=world.device)
        dist.all_reduce(one)
        torch.cuda.synchronize()
        group.shutdown()  # NCCL: aborted, then gone
        assert not dist.is_initialized()
        world = group.init("nccl", env=environ(_port()))
        dist.all_reduce(one)
        assert float(one.item()) == 1.0
        for key, value in model.state_dict().items():
            ptr, copy = before[key]
            assert value.is_cuda and value.data_ptr() == ptr and torch.equal(value, copy)
        model(torch.randn(8, 512, device=world.device)).sum().backward()  # the context still works
        torch.cuda.synchronize()
    finally:
        group.shutdown()


class Worker:
    """One worker process of hot_nccl_worker.py on GPU ``gpu``, its step lines read on a thread."""

    def __init__(self, tmp: Path, rank: int, world_size: int, port: int, gpu: int, *args: str) -> None:
        self.dir = tmp / f"node-{rank}"
        self.dir.mkdir()
        self.channel = AgentChannel(str(self.dir))  # the test plays the node's agent
        self.channel.assign(Assignment(round=1, node_rank=rank, nodes=world_size, master_addr="127.0.0.1",
                                       master_port=port, reform=True))  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        env.update(
            {ENV_NODE_DIR: str(self.dir)},
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=str(gpu),
            NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo",
            ELASTIC_TRAIN_LOG_FORMAT="json",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )  # fmt: skip
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # hot recovery's own choice (CleanUpOnly)
        self.log = tmp / f"worker-{rank}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args], env=env, cwd=tmp,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.text: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.text.append(line)
                if line.startswith('{"step"'):
                    self.lines.put(json.loads(line))

    def step_line(self, where: Any = lambda d: True) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                d = self.lines.get(timeout=1.0)
            except queue.Empty:
                assert self.proc.poll() is None, f"worker exited {self.proc.returncode}: {self.tail()}"
                continue
            if where(d):
                return d
        raise AssertionError(f"no such step line within {WAIT:.0f} s: {self.tail()}")

    def request(self) -> Any:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            asked = self.channel.requests().get(0)
            if asked is not None:
                return asked
            assert self.proc.poll() is None, f"worker exited {self.proc.returncode}: {self.tail()}"
            time.sleep(0.05)
        raise AssertionError(f"no request within {WAIT:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return "".join(self.text[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def workers() -> Any:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: >= 2 GPUs")
def test_survivors_of_a_kill_keep_their_processes_and_their_cuda_state(
    tmp_path: Path, workers: list[Worker]
) -> None:
    n = 2  # the survivor is the dead rank's direct peer in every NCCL topology: it sees the remote error
    port = _port()
    workers += [Worker(tmp_path, r, n, port, r, "--steps", "60") for r in range(n)]
    first = [w.step_line(lambda d: d["step"] >= 3) for w in workers]
    assert all(d["world"] == n for d in first)
    survivors, victim = workers[:-1], workers[-1]
    victim.proc.send_signal(signal.SIGKILL)
    asked = [w.request() for w in survivors]  # each survivor's collective failed, its group is down
    assert all(a.round == 1 for a in asked), asked
    new_port = _port()
    for rank, w in enumerate(survivors):
        w.channel.assign(Assignment(round=2, node_rank=rank, nodes=n - 1, ranks=(rank,), world_size=n - 1,
                                    master_addr="127.0.0.1", master_port=new_port, reform=True))  # fmt: skip
    after = [w.step_line(lambda d: d["round"] == 2) for w in survivors]
    for before, now in zip(first, after, strict=False):
        assert now["pid"] == before["pid"], "the survivor is another process"
        assert now["world"] == n - 1
        assert now["device"] == "cuda:0" and now["ptr"] == before["ptr"], "the weight left the device"
        assert now["sum"] == before["sum"]
    for w in survivors:
        assert w.proc.wait(timeout=WAIT) == 0, w.tail()
        assert '"group_reformed"' in "".join(w.text)


def test_a_poisoned_cuda_context_takes_the_restart_path(tmp_path: Path, workers: list[Worker]) -> None:
    workers.append(Worker(tmp_path, 0, 1, _port(), 0, "--steps", "30", "--poison", "5"))
    workers[0].step_line(lambda d: d["step"] >= 2)
    code = workers[0].proc.wait(timeout=WAIT)
    text = "".join(workers[0].text)
    assert code != 0, "the worker went on with a poisoned context"
    events = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{") and '"event"' in ln]
    lost = [e for e in events if e.get("event") == "cuda_context_lost"]
    assert len(lost) == 1 and "device-side assert" in lost[0]["reason"], text[-3000:]
    assert not any(e.get("event") == "group_reformed" for e in events)
    assert workers[0].channel.requests() == {}, "asked its agent for an in-process re-formation"
