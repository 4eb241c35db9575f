"""The own-loop API in a world of one: process group, sampler under a DataLoader with workers, state
round trips through the checkpoint tiers, loss weighting, and one clear error per kind of bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import elastic_train as et
from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, ModelMismatch
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.batching import share_weight
from elastic_train.train.errors import NotStateful, StateMismatch, TrainingError
from elastic_train.train.sampler import share_bounds

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_VARS = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "ELASTIC_TRAIN_NODE_DIR"),
    *("TORCHELASTIC_USE_AGENT_STORE", "ELASTIC_TRAIN_EVENTS", "ELASTIC_TRAIN_AUDIT_DIR"),
)


@pytest.fixture(scope="module")
def world() -> Iterator[et.World]:
    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    w = et.init()
    yield w
    et.shutdown()
    os.environ.update(saved)


def dataset(n: int = 50) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.arange(n))


def make(
    tmp: Path,
    memdir: str,
    *,
    n: int = 50,
    g: int = 8,
    every: int = 3,
    round: int = 0,
    run_id: str = "api",
    resume_from: str | None = None,
    **extra: object,
) -> et.Checkpointer:
    """A checkpointed linear model; ``round`` stands for the rendezvous round of a restarted group."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = et.ElasticBatchSampler(dataset(n), g, seed=3, round=round, audit_dir=str(tmp / "audit"))
    state = et.TrainState(model=model, optimizer=opt, sampler=sampler, **extra)  # type: ignore[arg-type]
    cfg = CheckpointConfig(memory_dir=memdir, keep_last=10)
    return et.Checkpointer(
        state, str(tmp / "ck"), every_steps=every, resume_from=resume_from, config=cfg, run_id=run_id
    )


def train(ckpt: et.Checkpointer, steps: int, *, workers: int = 2) -> list[list[int]]:
    """Train up to ``steps`` committed steps through a DataLoader with workers; the labels seen per step."""
    sampler = ckpt.state.sampler
    assert isinstance(sampler, et.ElasticBatchSampler)
    model, opt = ckpt.state.model, ckpt.state.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    loader = DataLoader(dataset(sampler.dataset_len), batch_sampler=sampler, num_workers=workers)
    seen = []
    while ckpt.step < steps:
        for x, label in loader:
            loss = model(x).square().mean() * sampler.loss_weight()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.append(label.tolist())
            ckpt.commit(loss)
            if ckpt.step == steps:
                break
    return seen


def test_init_outside_torchrun_is_a_world_of_one(world: et.World) -> None:
    assert (world.rank, world.world_size, world.device.type, world.backend) == (0, 1, "cpu", "gloo")
    assert world.run_id == "default" and world.is_main and world.device_ids is None
    assert et.init() is world and et.current_world() is world and dist.get_world_size() == 1


def test_import_elastic_train_does_not_import_torch() -> None:
    code = "import sys, elastic_train; print('torch' in sys.modules, callable(elastic_train.init))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.split() == ["False", "True"]


def test_cursor_moves_on_commit_not_on_prefetch(world: et.World, tmp_path: Path, memdir: str) -> None:
    ckpt = make(tmp_path, memdir)
    ckpt.restore()
    sampler = ckpt.state.sampler
    assert isinstance(sampler, et.ElasticBatchSampler)
    loader = iter(DataLoader(dataset(), batch_sampler=sampler, num_workers=2, prefetch_factor=2))
    next(loader)  # the workers have fetched several steps ahead by now
    assert sampler.cursor == 0
    ckpt.commit()
    assert (sampler.epoch, sampler.cursor, ckpt.step) == (0, 8, 1)
    ckpt.close()


def test_every_sample_once_per_epoch_across_a_restore(world: et.World, tmp_path: Path, memdir: str) -> None:
    first = make(tmp_path, memdir)
    assert first.restore() == 0
    seen = train(first, 4)
    first.close()  # a crash: no final checkpoint; the memory snapshot of step 4 stays
    second = make(tmp_path, memdir, round=1)
    assert second.restore() == 4 and second.source == "memory"
    seen += train(second, 14)
    second.finalize()
    epochs = [seen[:7], seen[7:14]]  # 50 samples, 8 per step: 6 full steps and a short one per epoch
    for steps in epochs:
        assert sorted(i for step in steps for i in step) == list(range(50))
    assert [len(s) for s in epochs[0]] == [8, 8, 8, 8, 8, 8, 2]
    report = check_exactly_once(str(tmp_path / "audit"), steps=14)
    assert report.ok, report.problems
    assert [p for p in os.listdir(memdir)] == []  # finalize released the snapshot


def test_durable_checkpoint_round_trip_and_ckpt_cli(world: et.World, tmp_path: Path, memdir: str) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = int(state["n"])

    counter = Counter()
    ckpt = make(tmp_path, memdir, counter=counter)
    ckpt.restore()
    for _ in range(5):
        counter.n += 2
        train(ckpt, ckpt.step + 1, workers=0)
    committed = ckpt.finalize()
    assert committed is not None and committed.step == 5
    weights = {k: v.clone() for k, v in ckpt.state.model.state_dict().items()}
    again = make(tmp_path, memdir, counter=Counter())
    assert again.restore() == 5 and again.source == "durable"
    assert again.state.extra["counter"].n == 10  # type: ignore[attr-defined]
    for key, value in again.state.model.state_dict().items():
        assert torch.equal(value, weights[key])
    assert again.state.sampler is not None and again.state.sampler.cursor == 40
    again.close()
    run = str(tmp_path / "ck" / "api")
    elsewhere = make(tmp_path, memdir, run_id="fine-tune", resume_from=run, counter=Counter())
    assert elsewhere.restore() == 5 and elsewhere.source == "resume_from"
    elsewhere.close()
    cli = [sys.executable, "-m", "elastic_train", "ckpt"]
    assert subprocess.run([*cli, "verify", run], capture_output=True, timeout=120).returncode == 0
    out = tmp_path / "model.pt"
    export = subprocess.run(
        [*cli, "export", run, "--to", str(out)], capture_output=True, text=True, timeout=120
    )
    assert export.returncode == 0, export.stderr
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["weight"], weights["weight"])


@pytest.mark.parametrize("n,world_size", [(10, 3), (5, 4), (3, 5), (7, 7)])
def test_share_weights_give_the_mean_loss_gradient(n: int, world_size: int) -> None:
    """DDP averages rank gradients; weighted rank losses then give the gradient of the mean over the step."""
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, 3, generator=gen, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    full = torch.autograd.functional.jacobian(lambda w: (x @ w).sin().mean(), w)
    averaged = torch.zeros(3, dtype=torch.float64)
    for rank in range(world_size):
        lo, hi = share_bounds(n, world_size, rank)
        share = x[lo:hi] if hi > lo else x[:1]  # an empty share is padded with one sample of weight 0
        for reduction in ("mean", "sum"):
            weight = share_weight(hi - lo, n, world_size, reduction)

            def loss(w: torch.Tensor, s: torch.Tensor = share, r: str = reduction) -> torch.Tensor:
                return getattr((s @ w).sin(), r)()  # type: ignore[no-any-return]

            grad = torch.autograd.functional.jacobian(loss, w) * weight / world_size
            if reduction == "mean":
                averaged += grad
            else:
                torch.testing.assert_close(grad, _mean_grad(x, w, lo, hi, n, world_size))
    torch.testing.assert_close(averaged, full, rtol=1e-12, atol=1e-14)


def _mean_grad(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int, n: int, world_size: int) -> torch.Tensor:
    if hi == lo:
        return torch.zeros(3, dtype=torch.float64)
    g = torch.autograd.functional.jacobian(lambda w: (x[lo:hi] @ w).sin().sum(), w)
    return g / n


def test_padded_share_and_len(world: et.World) -> None:
    sampler = et.ElasticBatchSampler(10, 4, world_size=5, rank=4)
    assert len(sampler) == 3
    shares = list(sampler)
    assert [len(s) for s in shares] == [1, 1, 1]  # empty shares (steps of 4 and 2 at world 5) are padded
    assert sampler.loss_weight() == 0.0
    assert list(et.ElasticBatchSampler(10, 4, world_size=5, rank=4, pad_empty=False)) == [[], [], []]
    with pytest.raises(ValueError, match="reduction"):
        sampler.loss_weight("max")


def test_restoring_while_iterating_is_refused(world: et.World) -> None:
    sampler = et.ElasticBatchSampler(20, 4)
    it = iter(sampler)
    next(it)
    sampler.load_state_dict(sampler.state_dict())
    with pytest.raises(TrainingError, match="restore the state before iterating"):
        next(it)


# -- bad input ------------------------------------------------------------------------------------------


def test_objects_that_cannot_be_checkpointed(world: et.World) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(NotStateful, match="ema: a object has no state_dict"):
        et.TrainState(model=model, ema=object())  # type: ignore[arg-type]
    with pytest.raises(NotStateful, match="model: a dict is not a torch.nn.Module"):
        et.TrainState(model={})  # type: ignore[arg-type]
    with pytest.raises(NotStateful, match="not an elastic_train ElasticBatchSampler"):
        et.TrainState(model=model, sampler=torch.utils.data.SequentialSampler(range(3)))  # type: ignore[arg-type]
    assert issubclass(NotStateful, TypeError)


def test_commit_before_restore_is_refused(world: et.World, tmp_path: Path, memdir: str) -> None:
    ckpt = make(tmp_path, memdir)
    with pytest.raises(TrainingError, match="call restore"):
        ckpt.commit()
    ckpt.close()


def test_mismatched_model_and_changed_dataset(world: et.World, tmp_path: Path, memdir: str) -> None:
    ckpt = make(tmp_path, memdir)
    ckpt.restore()
    train(ckpt, 2, workers=0)
    ckpt.finalize()
    other = et.TrainState(model=torch.nn.Linear(5, 1).double())
    bad = et.Checkpointer(
        other, str(tmp_path / "ck"), config=CheckpointConfig(memory_dir=memdir), run_id="api"
    )
    with pytest.raises(ModelMismatch, match="different model"):
        bad.restore()
    bad.close()
    grown = make(tmp_path, memdir, n=60)
    with pytest.raises(
        StateMismatch, match="the dataset has 60 samples, but the checkpoint's data order is for 50"
    ):
        grown.restore()
    grown.close()


SCRIPT = """
import torch, elastic_train as et
et.init()
state = et.TrainState(model=torch.nn.Linear(2, 1), optimizer=torch.optim.SGD([torch.zeros(1)], lr=1.0),
                      lookup={{"a": 1}})
"""


def test_bad_input_in_a_script_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format()))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    # torch.distributed prefixes what its excepthook prints with "[rank0]: " once a group exists
    assert lines[0].removeprefix("[rank0]: ") == (
        "train.py: error: rank 0: lookup: a dict has no state_dict()/load_state_dict(), so it cannot be "
        "checkpointed (wrap it in an object that has both)"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--entry"], "--entry: needs a script (or -m MODULE) to run"),
        (["--checkpoint", "x", "--entry", "t.py"], "--checkpoint: not used with --entry"),
        (["--seed", "3", "--entry", "t.py", "--seed", "4"], "--seed: not used with --entry"),
    ],
)
def test_local_entry_usage_errors_are_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train", "local", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-train: error: "), proc.stderr
    assert message in proc.stderr


def test_finalize_tells_the_agent_that_the_workers_training_ended(
    world: et.World, tmp_path: Path, memdir: str
) -> None:
    """Once the final checkpoint committed, the node's channel says so (a lease the node loses from then on
    no longer stops its workers); not before, and not for a checkpointer closed without one."""
    from elastic_train.node import AgentChannel, WorkerChannel
    from elastic_train.train.link import ProcessLink

    node = tmp_path / "node"
    node.mkdir()
    agent = AgentChannel(str(node))
    closed = make(tmp_path, memdir, run_id="closed")
    closed.link = ProcessLink(WorkerChannel(str(node)))
    closed.restore()
    train(closed, 2, workers=0)
    closed.close()
    assert agent.finished() is None
    ckpt = make(tmp_path, memdir)
    ckpt.link = ProcessLink(WorkerChannel(str(node)))
    ckpt.restore()
    train(ckpt, 3, workers=0)
    assert agent.finished() is None
    assert ckpt.finalize() is not None
    assert agent.finished() == 3


@pytest.mark.parametrize("every", [100, 3])
def test_a_step_boundary_that_re_forms_the_group_keeps_the_step(
    world: et.World, tmp_path: Path, memdir: str, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """The agent announced a membership change: commit() leaves at the step boundary with the step's memory
    snapshot taken (the next group starts from it, nothing redone) and the live state marked as that step,
    unless a durable checkpoint is due at the step (a collective: the step is then redone and written)."""
    from elastic_train.train.link import GroupChanged

    ckpt = make(tmp_path, memdir, every=every)
    live = ckpt.link.live
    ckpt.restore()
    train(ckpt, 2)
    assert live.get(ckpt.state) == 2
    opt = ckpt.state.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    ckpt.state.model(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()  # the live tensors change: they no longer hold step 2
    assert live.get(ckpt.state) is None

    def announced(step: int) -> None:
        raise GroupChanged(f"re-forms after step {step}")

    monkeypatch.setattr(ckpt.link, "boundary", announced)
    with pytest.raises(GroupChanged):
        ckpt.commit()
    manager = ckpt.manager
    assert isinstance(manager, CheckpointManager) and manager.memory is not None
    held = manager.memory.newest_valid()
    assert held is not None
    if every == 100:
        assert held.step == 3 and live.get(ckpt.state) == 3
    else:  # due at step 3: no snapshot; the next group redoes step 3 from step 2's
        assert held.step == 2 and live.get(ckpt.state) is None
    ckpt.close()
    live.clear()
