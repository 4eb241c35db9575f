"""The memory tier's snapshot off the critical path: the fence, crash safety mid-copy, every-k, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic_train.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from elastic_train.checkpoint import memory as memory_mod
from elastic_train.checkpoint import slots as slots_mod
from elastic_train.checkpoint.codec import flatten, tensor_at, unflatten
from elastic_train.checkpoint.copier import Copier
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.envvars import ENV_SHM_OWNER
from elastic_train.train import rng
from elastic_train.train.api import load_task
from elastic_train.train.config import TrainConfig
from elastic_train.train.events import EventWriter
from elastic_train.train.loop import Trainer


def manager(memdir: str, tmp_path, **kw) -> CheckpointManager:
    kw.setdefault("memory_every_steps", 1)
    kw.setdefault("every_steps", 0)
    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, **kw)
    return CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n}


def reader(memdir: str, tmp_path) -> MemorySnapshot:
    """The snapshot file :func:`manager`'s worker writes (its run's durable location scopes it)."""
    return MemorySnapshot(memdir, "run", 0, str(tmp_path / "c" / "run"))


def snapshot(memdir: str, tmp_path) -> tuple[int, dict]:
    """The newest valid snapshot in ``memdir`` as (step, state), as a restarted worker reads it."""
    held = reader(memdir, tmp_path).newest_valid()
    assert held is not None
    reader_ = reader(memdir, tmp_path)
    assert reader_.newest_valid() is not None
    buf = reader_.data(held.slot, held.nbytes).clone()
    return held.step, unflatten(held.skeleton, [tensor_at(buf, s) for s in held.specs])


def clone(state: dict) -> dict:
    return {
        k: clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


@pytest.fixture(autouse=True)
def _always_background(monkeypatch):
    """These states are small: without this they would be copied and sealed inline (see INLINE_BYTES)."""
    monkeypatch.setattr(memory_mod, "INLINE_BYTES", 0)
    monkeypatch.setattr(memory_mod, "SEAL_INLINE_BYTES", 0)


@pytest.fixture
def gate(monkeypatch):
    """Holds the background copier before its deferred copies until ``gate.set()``."""
    event = threading.Event()
    entered = threading.Event()
    original = Copier.copy

    def held(job):
        if job.later:
            entered.set()
            assert event.wait(30), "gate never opened"
        original(job)

    monkeypatch.setattr(Copier, "copy", staticmethod(held))
    event.entered = entered  # type: ignore[attr-defined]
    yield event
    event.set()


def test_fence_orders_the_copy_before_the_next_optimizer_step(memdir, tmp_path, gate):
    model, opt = trained()
    m = manager(memdir, tmp_path)
    m.attach(opt)
    expected = clone(state_of(model, opt, 1))
    m.save(1, lambda: state_of(model, opt, 1))
    assert gate.entered.wait(10)  # parameters and optimizer state are being copied in the background
    # Forward and backward of the next step run meanwhile: they read the parameters only.
    model(torch.randn(4, 8)).square().mean().backward()
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    stepper.start()
    time.sleep(0.3)
    assert not stepped.is_set(), "the optimizer step ran before the snapshot's copy was done"
    params = {k: v for k, v in model.state_dict().items() if "running" not in k and "batches" not in k}
    assert all(same(v, expected["model"][k]) for k, v in params.items())  # forward only moved BN stats
    assert same(opt.state_dict()["state"], expected["optimizer"]["state"])
    gate.set()
    stepper.join(10)
    assert stepped.is_set()
    assert not same(model.state_dict()["0.weight"], expected["model"]["0.weight"])  # the step did run
    m.close()
    got_step, got = snapshot(memdir, tmp_path)
    assert (
        got_step == 1
        and same(got["model"], expected["model"])
        and same(got["optimizer"], expected["optimizer"])
    )


def test_waiting_for_the_copier_counts_as_progress_for_the_agent(memdir, tmp_path, gate, monkeypatch):
    """A copy that takes seconds (memory the process never touched, on a machine short of free pages) is
    work, not a worker blocked on a peer: the optimizer step's wait for it beats the agent's counter."""
    monkeypatch.setattr(memory_mod, "PROGRESS_EVERY", 0.05)
    model, opt = trained()
    m = manager(memdir, tmp_path)
    beats: list[float] = []
    assert m.memory is not None and m.memory.progress == m.agent.beat  # what the agent is told
    m.memory.progress = lambda: beats.append(time.monotonic())
    m.attach(opt)
    m.save(1, lambda: state_of(model, opt, 1))
    assert gate.entered.wait(10)
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    time.sleep(0.5)
    held = len(beats)
    gate.set()
    stepper.join(10)
    assert not stepper.is_alive()
    assert held >= 3, f"{held} beats while the optimizer step waited 0.5 s for the copier"
    m.close()


def test_a_follow_up_that_waits_on_a_peer_counts_no_progress(memdir, monkeypatch):
    """A replica exchange blocked on a stopped peer must look blocked to the agent: no beats while the
    job's follow-up runs, only while the copier works on its own."""
    monkeypatch.setattr(memory_mod, "PROGRESS_EVERY", 0.05)
    snap = MemorySnapshot(memdir, "follow", 0)
    beats: list[float] = []
    snap.progress = lambda: beats.append(time.monotonic())
    release, entered = threading.Event(), threading.Event()

    def exchange(job) -> None:
        entered.set()
        assert release.wait(30)

    state = {"w": torch.randn(64, 64)}
    flat = flatten(state)
    snap.save(1, flat, defer=range(len(flat.tensors)), then=exchange)
    assert entered.wait(10)
    waiter = threading.Thread(target=snap.wait_idle)
    waiter.start()
    time.sleep(0.4)
    assert beats == [], "the wait for a follow-up that waits on a peer counted as progress"
    release.set()
    waiter.join(10)
    assert not waiter.is_alive() and snap.newest_valid() is not None
    snap.release()


def test_buffers_changed_by_the_next_forward_are_taken_at_the_step(memdir, tmp_path, gate):
    """BatchNorm running stats change in forward: they are copied before save returns, never deferred."""
    model, opt = trained()
    m = manager(memdir, tmp_path)
    m.attach(opt)
    expected = clone(state_of(model, opt, 1))
    m.save(1, lambda: state_of(model, opt, 1))
    assert gate.entered.wait(10)
    model(torch.randn(4, 8) * 5 + 3)  # moves running_mean / running_var in place
    assert not same(model.state_dict()["1.running_mean"], expected["model"]["1.running_mean"])
    gate.set()
    m.close()
    _, got = snapshot(memdir, tmp_path)
    assert same(got["model"], expected["model"])


def test_without_an_attached_optimizer_save_copies_everything_before_returning(memdir, tmp_path, gate):
    model, opt = trained()
    m = manager(memdir, tmp_path)
    expected = clone(state_of(model, opt, 1))
    m.save(1, lambda: state_of(model, opt, 1))
    assert not gate.entered.is_set()
    step(model, opt)  # no fence: nothing may still be reading the parameters
    m.close()
    _, got = snapshot(memdir, tmp_path)
    assert same(got["model"], expected["model"]) and same(got["optimizer"], expected["optimizer"])


def test_detached_optimizer_is_no_longer_fenced(memdir, tmp_path):
    model, opt = trained()
    m = manager(memdir, tmp_path)
    handle = m.attach(opt)
    m.save(1, lambda: state_of(model, opt, 1))
    handle.remove()
    assert not opt._optimizer_step_pre_hooks
    expected = clone(state_of(model, opt, 2))
    m.save(2, lambda: state_of(model, opt, 2))
    step(model, opt)
    m.close()
    got_step, got = snapshot(memdir, tmp_path)
    assert got_step == 2 and same(got["model"], expected["model"])


def test_many_steps_through_the_fence_each_snapshot_is_its_step(memdir, tmp_path):
    model, opt = trained()
    m = manager(memdir, tmp_path)
    m.attach(opt)
    for n in range(1, 30):
        step(model, opt)
        m.save(n, lambda n=n: state_of(model, opt, n))
    expected = clone(state_of(model, opt, 29))
    m.close()
    got_step, got = snapshot(memdir, tmp_path)
    assert (
        got_step == 29
        and same(got["model"], expected["model"])
        and same(got["optimizer"], expected["optimizer"])
    )


def test_snapshot_every_k_steps_restores_the_newest_multiple(memdir, tmp_path):
    model, opt = trained()
    m = manager(memdir, tmp_path, memory_every_steps=3)
    m.attach(opt)
    kept = {}
    for n in range(1, 8):
        step(model, opt)
        m.save(n, lambda n=n: state_of(model, opt, n))
        kept[n] = clone(state_of(model, opt, n))
    m.close()
    restored = manager(memdir, tmp_path, memory_every_steps=3).restore()
    assert restored is not None and (restored.step, restored.source) == (6, "memory")
    assert same(restored.state["model"], kept[6]["model"])


@pytest.mark.parametrize("bad", [0, -1, -5])
def test_snapshot_interval_below_one_is_a_one_line_error(bad):
    with pytest.raises(ValueError, match=rf"^memory_every_steps: {bad} must be >= 1 \(memory: false turns"):
        CheckpointConfig(memory_every_steps=bad)


def test_state_too_large_for_shared_memory_names_both_sizes(memdir, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(slots_mod, "free_bytes", lambda d: 3 << 20)
    # the allocation's own failure (the space taken meanwhile), past the node-wide check before it
    monkeypatch.setattr(memory_mod, "check_node_room", lambda *args: None)
    snap = MemorySnapshot(memdir, "run", 0)
    with pytest.raises(CheckpointError) as err:
        snap.save(1, flatten({"w": torch.zeros(5 << 18)}))  # 5 MiB of float32
    msg = str(err.value)
    assert (
        "\n" not in msg and "needs 15.2 MiB" in msg and "5.0 MiB state" in msg and "3.0 MiB are free" in msg
    )
    assert not os.listdir(memdir)


def test_a_new_layout_is_allocated_on_the_copier_and_its_failure_is_the_same_line(memdir, monkeypatch):
    """With deferred tensors the slots are allocated on the copier thread; a tmpfs too small fails the fence
    with the one line a save on the training thread gives."""

    def full(fd, offset, length):
        assert threading.current_thread().name == "ckpt-memory-copy"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(slots_mod, "free_bytes", lambda d: 3 << 20)
    monkeypatch.setattr(memory_mod, "check_node_room", lambda *args: None)
    snap = MemorySnapshot(memdir, "run", 0)
    snap.save(1, flatten({"w": torch.zeros(5 << 18), "b": torch.ones(4)}), defer={0})  # returns at once
    with pytest.raises(CheckpointError) as err:
        snap.fence()  # the optimizer step's pre-hook
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("the shared-memory snapshot needs 15.2 MiB"), msg
    assert not os.listdir(memdir)


_CRASHER = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
    from elastic_train.checkpoint import memory
    from elastic_train.checkpoint.copier import Copier

    memdir, url = sys.argv[1], sys.argv[2]
    memory.INLINE_BYTES = 0
    original = Copier.copy

    def slow(job):  # copy half of the deferred tensors, then stall: the test kills us here
        if job.step == 2:
            half = job.later[: len(job.later) // 2]
            for i in half:
                job.dests[i].copy_(job.flat.tensors[i])
            print("copying", flush=True)
            time.sleep(60)
        original(job)

    Copier.copy = staticmethod(slow)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.full((1000,), float(i))) for i in range(8)]
    opt = torch.optim.SGD(params, lr=1.0)
    cfg = CheckpointConfig(url=url, every_steps=0, memory_every_steps=1, memory_dir=memdir)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    m.attach(opt)
    state = lambda n: {"params": list(params), "step": n}
    m.save(1, lambda: state(1))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # every value - 1
    m.save(2, lambda: state(2))
    time.sleep(60)
    """
)


def test_kill_mid_copy_leaves_the_previous_step_valid(memdir, tmp_path, reaper, monkeypatch):
    monkeypatch.setenv(ENV_SHM_OWNER, str(os.getpid()))
    proc = reaper.popen(
        [sys.executable, "-c", _CRASHER, memdir, str(tmp_path / "c")],
        stdout=subprocess.PIPE,
        env={**os.environ, ENV_SHM_OWNER: str(os.getpid())},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # log lines, then the marker
        if line.strip() == b"copying":
            break
    else:
        pytest.fail(f"the snapshot process ended (exit {proc.wait()}) before its copy")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    got_step, got = snapshot(memdir, tmp_path)
    assert got_step == 1
    assert all(torch.equal(t, torch.full((1000,), float(i))) for i, t in enumerate(got["params"]))


@pytest.fixture
def world_one():
    from elastic_train.net import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_trainer_attaches_its_optimizer_and_resumes_from_the_async_snapshot(memdir, tmp_path, world_one):
    def make(steps: int, m: CheckpointManager) -> Trainer:
        rng.seed_all(3)
        return Trainer(
            TrainConfig(task="regression", steps=steps, global_batch=10, seed=3),
            load_task("regression", {"n_samples": 64}),
            rank=0,
            world_size=1,
            round=0,
            device=torch.device("cpu"),
            checkpointer=m,
            events=EventWriter(None, round=0, world_size=1),
        )

    straight = make(9, manager(memdir, tmp_path / "a"))
    straight.run()
    m = manager(memdir, tmp_path / "b")
    first = make(5, m)
    assert [a.optimizer for a in m._attached] == [first.task.optimizer]
    first.wrap()
    while first.step < 5:
        first.train_step()
        m.save(first.step, first.state)
    m.close()  # an interrupted run: the snapshot of step 5 stays
    second = make(9, manager(memdir, tmp_path / "b"))
    second.restore()
    assert second.step == 5
    second.run()
    for key, value in straight.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[key], value), key


def test_small_cpu_states_are_copied_inside_save_and_sealed_by_the_copier(memdir, tmp_path, monkeypatch):
    """Below INLINE_BYTES (and above SEAL_INLINE_BYTES) save copies every tensor itself; the checksums are
    computed on the copier thread, and the slot is not valid before they are."""
    monkeypatch.setattr(memory_mod, "INLINE_BYTES", 4 << 20)
    monkeypatch.setattr(memory_mod, "SEAL_INLINE_BYTES", 0)
    release, entered = threading.Event(), threading.Event()
    original = MemorySnapshot.seal

    def held_seal(self, job):
        entered.set()
        assert release.wait(30), "seal never released"
        original(self, job)

    monkeypatch.setattr(MemorySnapshot, "seal", held_seal)
    model, opt = trained()
    m = manager(memdir, tmp_path)
    m.attach(opt)
    expected = clone(state_of(model, opt, 1))
    m.save(1, lambda: state_of(model, opt, 1))
    assert m.memory is not None and entered.wait(10)
    assert m.memory.sealed_step is None and reader(memdir, tmp_path).newest_valid() is None
    m.fence()  # nothing left to copy: the optimizer may step while the seal runs
    step(model, opt)
    release.set()
    m.memory.wait_idle()
    assert m.memory.sealed_step == 1
    m.close()
    got_step, got = snapshot(memdir, tmp_path)
    assert (
        got_step == 1
        and same(got["model"], expected["model"])
        and same(got["optimizer"], expected["optimizer"])
    )


def test_the_smallest_cpu_states_are_sealed_inside_save(memdir, tmp_path, monkeypatch):
    """Below SEAL_INLINE_BYTES save copies and seals the slot itself: valid when save returns, on the
    training thread, with no copier thread; a torn slot still fails its checksum."""
    monkeypatch.setattr(memory_mod, "INLINE_BYTES", 4 << 20)
    monkeypatch.setattr(memory_mod, "SEAL_INLINE_BYTES", 2 << 20)
    threads = []
    original = MemorySnapshot.seal

    def seal(self, job, **kw):
        threads.append(threading.current_thread())
        original(self, job, **kw)

    monkeypatch.setattr(MemorySnapshot, "seal", seal)
    model, opt = trained()
    m = manager(memdir, tmp_path)
    m.attach(opt)
    for n in (1, 2):
        expected = clone(state_of(model, opt, n))
        m.save(n, lambda n=n: state_of(model, opt, n))
        assert m.memory is not None and m.memory.sealed_step == n  # sealed before save returned
        got_step, got = snapshot(memdir, tmp_path)
        assert got_step == n and same(got["model"], expected["model"])
        assert same(got["optimizer"], expected["optimizer"])
        step(model, opt)
    assert threads == [threading.main_thread()] * 2
    assert m.memory.copier.thread is None  # no copier was ever started
    # Flip one data byte of the newest slot: it fails its checksum, the one before is restored.
    torn = reader(memdir, tmp_path)
    held = torn.newest_valid()
    assert held is not None and held.step == 2
    data = torn.data(held.slot, held.nbytes)
    data[held.nbytes // 2] ^= 0xFF
    again = reader(memdir, tmp_path).newest_valid()
    assert again is not None and again.step == 1
    m.close()


_SEAL_CRASHER = textwrap.dedent(
    """
    import sys, time
    import torch
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
    from elastic_train.checkpoint.memory import MemorySnapshot

    memdir, url = sys.argv[1], sys.argv[2]
    original = MemorySnapshot.seal

    def stalled(self, job, **kw):  # every byte of step 2 is copied; the test kills us before its seal
        if job.step == 2:
            assert not job.later
            print("copied", flush=True)
            time.sleep(60)
        original(self, job, **kw)

    MemorySnapshot.seal = stalled
    params = [torch.full((1000,), float(i)) for i in range(8)]
    cfg = CheckpointConfig(url=url, every_steps=0, memory_every_steps=1, memory_dir=memdir)
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    m.save(1, lambda: {"params": params, "step": 1})
    for p in params:
        p.sub_(1)
    m.save(2, lambda: {"params": params, "step": 2})
    time.sleep(60)
    """
)


def test_kill_after_the_copy_before_the_seal_leaves_the_previous_step_valid(
    memdir, tmp_path, reaper, monkeypatch
):
    """A slot whose bytes are all copied but whose checksums are not yet written is never restored."""
    monkeypatch.setenv(ENV_SHM_OWNER, str(os.getpid()))
    proc = reaper.popen(
        [sys.executable, "-c", _SEAL_CRASHER, memdir, str(tmp_path / "c")],
        stdout=subprocess.PIPE,
        env={**os.environ, ENV_SHM_OWNER: str(os.getpid())},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == b"copied":
            break
    else:
        pytest.fail(f"the snapshot process ended (exit {proc.wait()}) before its copy")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    got_step, got = snapshot(memdir, tmp_path)
    assert got_step == 1
    assert all(torch.equal(t, torch.full((1000,), float(i))) for i, t in enumerate(got["params"]))


def test_a_durable_checkpoint_waits_for_the_copy_it_reads(memdir, tmp_path, gate):
    """The durable writer reads the step from its shared-memory slot: never before the copier filled it."""
    model, opt = trained()
    m = manager(memdir, tmp_path, async_write=False, every_steps=1)
    m.attach(opt)
    expected = clone(state_of(model, opt, 1))
    saver = threading.Thread(target=m.save, args=(1, lambda: state_of(model, opt, 1)))
    saver.start()
    assert gate.entered.wait(10)
    time.sleep(0.2)
    assert saver.is_alive() and m.last_committed is None  # held until the copy is done
    gate.set()
    saver.join(10)
    assert m.last_committed is not None and m.last_committed.step == 1
    m.close(release_memory=True)
    restored = manager(memdir, tmp_path).restore()
    assert restored is not None and (restored.step, restored.source) == (1, "durable")
    assert same(restored.state["model"], expected["model"]) and same(
        restored.state["optimizer"], expected["optimizer"]
    )
