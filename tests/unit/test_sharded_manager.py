"""The sharded checkpoint manager in a world of one (gloo, in this process): the memory tier's slots, the
DCP durable tier, a torn slot, another model, a foreign DCP checkpoint; multi-rank resharding is in
tests/integration/test_fsdp_train.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from elastic_train.checkpoint import CheckpointConfig, ModelMismatch, WriteFailed
from elastic_train.checkpoint import memory as memory_mod
from elastic_train.checkpoint.codec import Flat, flatten
from elastic_train.checkpoint.copier import Copier, CopyJob
from elastic_train.checkpoint.memory import MemorySnapshot
from elastic_train.checkpoint.sharded.manager import ShardedCheckpointManager
from elastic_train.checkpoint.sharded.slots import ShardedMemory
from elastic_train.checkpoint.slots import SlotFile
from elastic_train.train.fsdp import device_mesh, load_full, shard_model
from elastic_train.train.group import World
from elastic_train.train.sampler import ElasticBatchSampler
from elastic_train.train.state import TrainState


@pytest.fixture
def world_one() -> Iterator[World]:
    from elastic_train.net import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield World(
        rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo",
        round=1, run_id="r", restart_count=0,
    )  # fmt: skip
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 5), torch.nn.Linear(5, out)])
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale


def job(
    world: World, tmp: Path, *, out: int = 3, sharding: dict[str, object] | None = None, **cfg: object
) -> tuple[TrainState, ShardedCheckpointManager]:
    torch.manual_seed(0)
    full = Net(out).state_dict()
    model = shard_model(lambda: Net(out), mesh=device_mesh(), **(sharding or {}))
    load_full(model, full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    sampler = ElasticBatchSampler(32, 8, seed=0)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    settings = {"url": str(tmp / "ck"), "memory_dir": str(tmp / "shm"), "every_steps": 0, **cfg}
    manager = ShardedCheckpointManager(
        CheckpointConfig(**settings), "r", rank=0, world_size=1, local_rank=0, model=model,  # type: ignore[arg-type]
        optimizer=optimizer, current_state=state.state_dict, group=dist.group.WORLD,
    )  # fmt: skip
    return state, manager


def train(state: TrainState, manager: ShardedCheckpointManager, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()  # type: ignore[union-attr]
        state.optimizer.zero_grad()  # type: ignore[union-attr]
        state.scheduler.step()  # type: ignore[union-attr]
        state.sampler.advance(state.sampler.plan(1, 0))  # type: ignore[union-attr]
        state.step += 1
        manager.save(state.step, state.state_dict)


def local(state: TrainState) -> dict[str, torch.Tensor]:
    out = {
        f"model.{k}": (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in state.model.state_dict().items()
    }
    for i, per in enumerate(state.optimizer.state.values()):  # type: ignore[union-attr]
        for k, v in per.items():
            out[f"opt.{i}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    return out


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    (tmp_path / "shm").mkdir()
    return tmp_path


def test_memory_round_trip_into_a_rebuilt_model(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm)
    assert manager.restore() is None
    train(state, manager, 3)
    saved = local(state)
    manager.close()

    state2, manager2 = job(world_one, shm)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 3 and restored.source == "memory"
    assert isinstance(restored.state["optimizer"]["state"][0]["exp_avg"], DTensor)
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert state2.scheduler.last_epoch == 3 and state2.sampler.state_dict()["cursor"] == 24  # type: ignore[union-attr]
    assert manager2.last_moved["kept"] > 0 and manager2.last_moved["received"] == 0
    manager2.close(release_memory=True)


def test_a_mixed_precision_model_keeps_its_float32_shards_and_trains_on_as_if_never_stopped(
    world_one: World, shm: Path
) -> None:
    bf16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    state, manager = job(world_one, shm, sharding=bf16)
    assert manager.restore() is None
    train(state, manager, 3)
    saved = local(state)
    manager.close()
    assert {v.dtype for k, v in saved.items() if k.startswith("model.layers")} == {torch.float32}
    assert state.model.layers[0](torch.randn(2, 4)).dtype == torch.bfloat16  # blocks compute in bfloat16

    state2, manager2 = job(world_one, shm, sharding=bf16)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 3 and restored.source == "memory"
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    # The stopped job and the restored one take the same two steps to the same weights and moments.
    x = torch.randn(8, 4)
    for s in (state, state2):
        for _ in range(2):
            s.model(x).float().pow(2).mean().backward()
            s.optimizer.step()  # type: ignore[union-attr]
            s.optimizer.zero_grad()  # type: ignore[union-attr]
    a, b = local(state), local(state2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.weight"], saved["model.layers.0.weight"])
    manager2.close(release_memory=True)


def test_shard_model_passes_options_to_the_default_sharding_only(world_one: World) -> None:
    for reshard in (True, False):
        model = shard_model(lambda: Net(), mesh=device_mesh(), reshard_after_forward=reshard)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
            model(torch.randn(2, 4))
        # resharded after the forward: DTensor parameters again; kept unsharded: plain ones
        assert [isinstance(m.weight, DTensor) for m in model.layers] == [reshard, reshard]
    with pytest.raises(ValueError, match=r"^shard_model: fully_shard options \(mp_policy\) apply to the"):
        shard_model(lambda: Net(), shard=lambda m, mesh: None, mp_policy=MixedPrecisionPolicy())


def test_a_torn_slot_is_never_restored(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm)
    manager.restore()
    train(state, manager, 3)
    manager.close()
    assert manager.memory is not None
    newest = manager.memory.own.valid_slots()[0]  # maps the file again
    assert newest.step == 3
    data = manager.memory.own.data(newest.slot, newest.nbytes)
    data[-8:] ^= 0xFF  # flipped bits in the newest step's data: its header and metadata still verify
    manager.memory.own.detach()

    state2, manager2 = job(world_one, shm)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 2  # the next-newest slot, after the verdict
    manager2.close(release_memory=True)


def test_durable_dcp_round_trip_and_ls(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm, every_steps=2, memory=False)
    manager.restore()
    train(state, manager, 4)
    saved = local(state)
    manager.finalize(state.step, state.state_dict())
    run = shm / "ck" / "r"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert (run / "step-00000004" / ".metadata").exists()

    state2, manager2 = job(world_one, shm, memory=False)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 4 and restored.source == "durable"
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    manager2.close()


def test_a_restore_lists_the_durable_checkpoints_once(
    world_one: World, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On remote storage every listing costs requests per checkpoint: one per restore attempt."""
    from elastic_train.checkpoint import durable

    state, manager = job(world_one, shm, every_steps=2)
    manager.restore()
    train(state, manager, 4)
    manager.close()  # the memory snapshot stays, beside the durable checkpoints of steps 2 and 4
    assert sorted(p.name for p in (shm / "ck" / "r").glob("step-*")) == ["step-00000002", "step-00000004"]
    listed: list[str] = []
    real = durable.list_entries

    def counting(storage: object, run_path: str, **kw: object) -> list[durable.Entry]:
        listed.append(run_path)
        return real(storage, run_path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(durable, "list_entries", counting)
    state2, manager2 = job(world_one, shm, every_steps=2)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 4 and restored.source == "memory"
    assert len(listed) == 1
    manager2.close(release_memory=True)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The chaos suite's ``flaky://`` filesystem (tests/chaos/chaos_task.py): local files of absolute paths
    behind a protocol of their own (as ``file://``, ``memory://`` or a mounted store's fsspec driver),
    whose writes fail while the file this yields exists. Nothing may land relative to the working
    directory."""
    from tests.chaos.chaos_task import ENV_FLAG  # registers flaky://

    outage = tmp_path / "outage"
    monkeypatch.setenv(ENV_FLAG, str(outage))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield outage
    outage.unlink(missing_ok=True)
    assert not any(cwd.iterdir()), "a checkpoint file written relative to the working directory"


def test_the_durable_tier_on_an_fsspec_filesystem_of_absolute_paths(
    world_one: World, shm: Path, flaky: Path
) -> None:
    """``flaky:///abs/ck``: the DCP directory lands at ``/abs/ck/...``, not at ``abs/ck`` relative to the
    working directory (the URL DCP's writer gets keeps the leading slash)."""
    state, manager = job(world_one, shm, every_steps=1, memory=False, url=f"flaky://{shm}/ck")
    manager.restore()
    train(state, manager, 1)
    saved = local(state)
    assert manager.finalize(state.step, state.state_dict()) is not None
    assert (shm / "ck" / "r" / "step-00000001" / ".metadata").exists()
    state2, manager2 = job(world_one, shm, memory=False, url=f"flaky://{shm}/ck")
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and (restored.step, restored.source) == (1, "durable")
    state2.load_state_dict(restored.state)
    assert all(torch.equal(v, saved[k]) for k, v in local(state2).items())
    manager2.close()


def test_a_final_checkpoint_that_fails_keeps_the_memory_snapshot(
    world_one: World, shm: Path, flaky: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final DCP write fails: the job fails, and the memory tier's slots (the newest copy of the state)
    stay for the restarted worker, which restores them and writes the final checkpoint again."""
    from elastic_train.checkpoint import writer as writer_module

    monkeypatch.setattr(writer_module, "retry_delay", lambda attempt: 0.0)
    url = f"flaky://{shm}/ck"
    state, manager = job(world_one, shm, memory=True, retries=1, url=url)
    manager.restore()
    train(state, manager, 2)
    saved = local(state)
    flaky.touch()  # storage fails
    with pytest.raises(WriteFailed, match="durable checkpoint of step 2 failed: rank 0: DCP write of"):
        manager.finalize(state.step, state.state_dict())
    flaky.unlink()
    state2, manager2 = job(world_one, shm, memory=True, url=url)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and (restored.step, restored.source) == (2, "memory")
    state2.load_state_dict(restored.state)
    assert all(torch.equal(v, saved[k]) for k, v in local(state2).items())
    assert manager2.finalize(2, state2.state_dict()) is not None
    assert (shm / "ck" / "r" / "step-00000002" / ".metadata").exists()
    assert not list((shm / "shm").iterdir())  # released once the final checkpoint is committed


def test_a_final_checkpoint_broken_by_the_group_is_a_group_failure(
    world_one: World, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group breaks under the final DCP write: the WriteFailed carries the broken group's error (the hot
    path re-forms in-process and writes the final checkpoint again), and the memory slots stay."""
    from elastic_train.checkpoint.sharded.writer import DurableWriting
    from elastic_train.train.hot import classify_failure

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )

    def broken(self: object, job: object, data: object) -> None:
        raise RuntimeError(gloo)

    monkeypatch.setattr(DurableWriting, "_write_once", broken)
    state, manager = job(world_one, shm, memory=True)
    manager.restore()
    train(state, manager, 2)
    with pytest.raises(WriteFailed) as info:
        manager.finalize(state.step, state.state_dict())
    failure = classify_failure(info.value)
    assert failure is not None and failure.reform and "Connection closed by peer" in failure.reason
    assert list((shm / "shm").iterdir())
    manager.close()


def test_a_checkpoint_of_another_model_is_refused(world_one: World, shm: Path) -> None:
    state, manager = job(world_one, shm, every_steps=1, memory=False)
    manager.restore()
    train(state, manager, 1)
    manager.finalize(state.step, state.state_dict())
    state2, manager2 = job(world_one, shm, out=4, memory=False)
    with pytest.raises(
        ModelMismatch, match="different model: .layers.1.bias. is float32.3. in the checkpoint"
    ):
        manager2.restore(state2.model.state_dict())
    manager2.close()


# -- the snapshot off the training thread ------------------------------------------------------------------


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch) -> None:
    """These states are small: without this they would be copied and sealed inside save (INLINE_BYTES)."""
    monkeypatch.setattr(memory_mod, "INLINE_BYTES", 0)
    monkeypatch.setattr(memory_mod, "SEAL_INLINE_BYTES", 0)


class Gate:
    """Holds the copier thread in a snapshot's deferred copies (half of them done) until :meth:`open`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        original = Copier.copy

        def held(job: CopyJob) -> None:
            if job.later:
                for i in job.later[: len(job.later) // 2]:
                    job.dests[i].copy_(job.flat.tensors[i])  # type: ignore[union-attr]
                self.entered.set()
                assert self._open.wait(30), "gate never opened"
            original(job)

        monkeypatch.setattr(Copier, "copy", staticmethod(held))

    def open(self) -> None:
        self._open.set()


def reader(manager: ShardedCheckpointManager, shm: Path) -> MemorySnapshot:
    """The own snapshot file as another process (a restarted worker) reads it."""
    return MemorySnapshot(str(shm / "shm"), "r", 0, manager.run_path)


def copying_step_2(
    world: World, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[TrainState, ShardedCheckpointManager, Gate]:
    """A job with its optimizer attached, step 1's snapshot sealed, and step 2's held by the :class:`Gate`
    on the copier thread: its shards and moments half copied."""
    state, manager = job(world, shm)
    manager.attach(state.optimizer)  # type: ignore[arg-type]
    manager.restore()
    train(state, manager, 1)
    assert manager.memory is not None and manager.memory.wait_idle(10)
    gate = Gate(monkeypatch)
    train(state, manager, 1)
    assert gate.entered.wait(10)
    return state, manager, gate


def test_the_optimizer_step_waits_for_the_snapshot_copy(
    world_one: World, shm: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, manager, gate = copying_step_2(world_one, shm, monkeypatch)
    expected = local(state)
    state.model(torch.randn(8, 4)).pow(2).mean().backward()  # the next forward and backward run meanwhile
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (state.optimizer.step(), stepped.set()))  # type: ignore[union-attr]
    stepper.start()
    time.sleep(0.3)
    assert not stepped.is_set(), "the optimizer step ran before the snapshot's copy was done"
    gate.open()
    stepper.join(10)
    assert stepped.is_set() and not torch.equal(
        local(state)["model.layers.0.weight"], expected["model.layers.0.weight"]
    )
    manager.close()

    state2, manager2 = job(world_one, shm)
    restored = manager2.restore(state2.model.state_dict())
    assert restored is not None and restored.step == 2
    state2.load_state_dict(restored.state)
    got = local(state2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # the state of step 2, not the step after
    manager2.close(release_memory=True)


def test_a_snapshot_in_flight_is_never_read_as_valid(
    world_one: World, shm: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _state, manager, gate = copying_step_2(world_one, shm, monkeypatch)
    held = reader(manager, shm).newest_valid()  # what a worker restarted now (the copy half done) finds
    assert held is not None and held.step == 1
    gate.open()
    assert manager.memory is not None and manager.memory.wait_idle(10)
    held = reader(manager, shm).newest_valid()
    assert held is not None and held.step == 2
    manager.close()

    # The first snapshot of a new layout (a rank's part at another world size): its slots are allocated on the
    # copier thread, and no slot is valid until the new one is sealed whole.
    state3, manager3 = job(world_one, shm, out=6)
    manager3.attach(state3.optimizer)  # type: ignore[arg-type]
    gate = Gate(monkeypatch)
    allocated_on: list[str] = []
    allocate = SlotFile.allocate

    def recorded(self: SlotFile, *args: object) -> None:
        allocated_on.append(threading.current_thread().name)
        allocate(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SlotFile, "allocate", recorded)
    train(state3, manager3, 1)
    assert gate.entered.wait(10)
    assert allocated_on == ["ckpt-memory-copy"]
    assert manager3.memory is not None and manager3.memory.own.copier.copying_rest  # the clones come after
    assert reader(manager3, shm).newest_valid() is None
    gate.open()
    assert manager3.memory.wait_idle(10)
    held = reader(manager3, shm).newest_valid()
    assert held is not None and held.step == 1
    manager3.close(release_memory=True)


def test_the_replica_exchange_runs_on_the_copier_and_its_failure_is_a_group_failure(
    tmp_path: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic_train.train.hot import classify_failure

    memory = ShardedMemory(str(tmp_path), "r", 0, 1)
    ran: list[tuple[int, str]] = []
    hold = threading.Event()

    def exchange(step: int, slot: int, flat: Flat, **_: object) -> None:
        ran.append((step, threading.current_thread().name))
        if step == 2:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
        if step == 3:
            assert hold.wait(10)
        assert memory.replica is not None
        with memory._lock:
            if not memory._stopped:
                memory.replica.save(step, flat, background=False)

    monkeypatch.setattr(memory, "exchange", exchange)
    flat = flatten({"w": torch.ones(1 << 16)})
    memory.save(1, flat, replica=(0, 0, None))
    assert memory.wait_idle(10)
    assert ran == [(1, "ckpt-memory-copy")] and memory.replica is not None
    assert [h.step for h in memory.replica.valid_slots()] == [1]
    memory.save(2, flat, replica=(0, 0, None))
    assert memory.wait_idle(10)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as err:
        memory.raise_error()  # raised as it is: the training loop re-forms the group on it
    failure = classify_failure(err.value)
    assert failure is not None and failure.reform
    assert memory.own.valid_slots()[0].step == 2  # the own slot is sealed all the same

    memory.save(3, flat, replica=(0, 0, None))  # an exchange that waits on a peer
    assert not memory.stop(0.2)  # the manager closes without it...
    hold.set()
    time.sleep(0.2)
    assert memory.wait_idle(10)
    assert [h.step for h in memory.replica.valid_slots()] == [1]  # ...and it writes no replica afterwards


def test_frozen_parameters_are_copied_off_the_training_thread_too(world_one: World, shm: Path) -> None:
    """Not only the optimizer's: a parameter changes only in an optimizer step (or after a fence)."""
    state, manager = job(world_one, shm)
    frozen = list(state.model.layers[0].parameters())  # type: ignore[index]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(state.model.layers[1].parameters(), lr=0.1)  # type: ignore[index]
    manager.attach(optimizer)
    flat = manager._flat(state.state_dict)
    defer = manager._attached.deferrable(flat)
    deferred = {s.path for i, s in enumerate(flat.specs) if i in defer}
    assert {f"/state/model/layers.0.{n}" for n in ("weight", "bias")} <= deferred
    assert {f"/state/model/layers.1.{n}" for n in ("weight", "bias")} <= deferred
    assert "/state/model/scale" not in deferred  # a buffer: the next forward may change it
    assert not any(s.path.startswith("/state/rng") for i, s in enumerate(flat.specs) if i in defer)
    manager.close(release_memory=True)


def test_the_optimizer_step_does_not_wait_for_frozen_parameters_but_a_fence_does(
    world_one: World, shm: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, manager = job(world_one, shm)
    for p in state.model.layers[0].parameters():  # type: ignore[index]
        p.requires_grad_(False)
    state.optimizer = torch.optim.AdamW(state.model.layers[1].parameters(), lr=0.1)  # type: ignore[index]
    state.scheduler = torch.optim.lr_scheduler.StepLR(state.optimizer, 2, 0.5)
    manager.optimizer = state.optimizer
    manager.attach(state.optimizer)
    manager.restore()
    train(state, manager, 1)
    assert manager.memory is not None and manager.memory.wait_idle(10)
    entered, release = threading.Event(), threading.Event()
    original = Copier.copy_rest

    def held(job: CopyJob) -> None:
        if job.rest:
            entered.set()
            assert release.wait(30), "never released"
        original(job)

    monkeypatch.setattr(Copier, "copy_rest", staticmethod(held))
    train(state, manager, 1)  # its optimizer step did not wait for step 1's frozen copies either
    assert entered.wait(10)  # step 2's frozen shards are being copied
    state.optimizer.step()  # the optimizer's own tensors are copied: its step goes on
    fenced = threading.Event()
    fencer = threading.Thread(target=lambda: (manager.fence(), fenced.set()))
    fencer.start()
    time.sleep(0.3)
    assert not fenced.is_set(), "a fence returned while frozen parameters were still being copied"
    release.set()
    fencer.join(10)
    assert fenced.is_set() and manager.memory.wait_idle(10)
    held_slot = reader(manager, shm).newest_valid()
    assert held_slot is not None and held_slot.step == 2
    manager.close(release_memory=True)


def test_closing_a_broken_group_leaves_an_exchange_waiting_on_a_stopped_peer_behind(
    tmp_path: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send to (or a receive from) a peer that stopped may never return, even with the connections cut:
    closing after the group broke waits for the own slot's copy and seal, not for that exchange, so the
    process asks for the next round in time; the exchange left behind writes no replica."""
    from elastic_train.checkpoint.sharded import slots

    memory = ShardedMemory(str(tmp_path), "r", 0, 1)
    entered, never = threading.Event(), threading.Event()

    def exchange(step: int, slot: int, flat: Flat, **_: object) -> None:
        entered.set()
        never.wait(30)  # the stopped peer
        assert memory.replica is not None
        with memory._lock:
            if not memory._stopped:
                memory.replica.save(step, flat, background=False)

    monkeypatch.setattr(memory, "exchange", exchange)
    flat = flatten({"w": torch.ones(1 << 16)})
    memory.save(1, flat, replica=(0, 0, None))
    assert entered.wait(10)
    started = time.monotonic()
    assert not memory.stop(10, broken=True)
    assert time.monotonic() - started < slots.BROKEN_EXCHANGE_WAIT + 1.0  # not the close's 10 s
    never.set()  # (reading the slots waits for the copier, which the exchange left behind still holds)
    assert memory.wait_idle(10)
    assert memory.own.valid_slots()[0].step == 1  # sealed before the exchange began
    assert memory.replica is not None and memory.replica.valid_slots() == []  # nothing written after


def test_a_replica_that_arrived_whole_is_kept_when_the_own_send_fails(
    tmp_path: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group broke while this rank's own send was in flight (its buddy failed, or cut its links), after
    its source's replica had arrived: that replica is kept (it may be the only copy of a failed rank's
    shards), and the send's error still reaches the training thread."""
    import pickle
    from types import SimpleNamespace

    from elastic_train.checkpoint.sharded import slots

    source = ShardedMemory(str(tmp_path), "source", 0, 0)
    theirs = flatten({"w": torch.arange(1 << 12, dtype=torch.float32)})
    source.save(3, theirs)
    assert source.wait_idle(10)
    held = source.own.valid_slots()[0]
    meta = pickle.dumps((theirs.skeleton, [s.to_json() for s in theirs.specs]))
    payload = {
        slots._HEADER_TAG: torch.tensor([len(meta), theirs.nbytes], dtype=torch.int64),
        1: torch.frombuffer(bytearray(meta), dtype=torch.uint8),
        2: source.own.data(held.slot, theirs.nbytes).clone(),
    }

    class Failed:
        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")

    def recv(tensor: torch.Tensor, src: int, group: object, tag: int) -> None:
        tensor.copy_(payload[tag])

    monkeypatch.setattr(slots, "dist", SimpleNamespace(isend=lambda *a, **k: Failed(), recv=recv))
    memory = ShardedMemory(str(tmp_path), "receiver", 0, 1)
    memory.save(3, flatten({"w": torch.ones(1 << 10)}), replica=(1, 1, None))
    assert memory.wait_idle(10)
    assert isinstance(memory.error, RuntimeError) and "closed by peer" in str(memory.error)
    assert memory.replica is not None
    kept = memory.replica.valid_slots()
    assert [h.step for h in kept] == [3] and kept[0].nbytes == theirs.nbytes
    assert torch.equal(memory.replica.data(kept[0].slot, theirs.nbytes), payload[2])
    source.own.release()
    memory.own.release()
    memory.replica.release()


def test_a_broken_close_still_waits_for_the_own_slots_copy(
    tmp_path: Path, background: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the exchange is left behind: a copy in progress (no peer involved) is waited for."""
    memory = ShardedMemory(str(tmp_path), "r", 0, 0)
    entered, release = threading.Event(), threading.Event()
    original = Copier.copy

    def slow(job: CopyJob) -> None:
        entered.set()
        assert release.wait(10)
        original(job)

    monkeypatch.setattr(Copier, "copy", staticmethod(slow))
    flat = flatten({"w": torch.ones(1 << 16)})
    memory.save(1, flat, defer=range(len(flat.specs)))
    assert entered.wait(10)
    threading.Timer(0.5, release.set).start()
    started = time.monotonic()
    assert memory.stop(10, broken=True)  # waited past the exchange's bound for the copy
    assert time.monotonic() - started >= 0.4
    memory.raise_error()
    assert memory.own.valid_slots()[0].step == 1
