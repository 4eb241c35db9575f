"""The planned snapshot: built once, reused while the structure holds, re-planned (never copied wrong) when
it changes: a new param group, optimizer state that appears late, a scheduler whose state grows, replaced
tensors."""

from __future__ import annotations

import json
import random
from functools import partial

import numpy as np
import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
from elastic_train.checkpoint.codec import flatten, tensor_at, unflatten
from elastic_train.checkpoint.plan import Fixed, Planner
from elastic_train.train import rng
from elastic_train.train.sampler import ElasticSampler
from elastic_train.train.state import TrainState


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def cloned(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(cloned(v) for v in state)
    return state


def as_flattened(ts: TrainState, *, verify: bool = True) -> None:
    """The planned snapshot is exactly the flattened state dict: skeleton, specs and tensor values (the RNG
    states included: nothing draws between the two reads)."""
    planned, plain = ts.snapshot(verify=verify), flatten(ts.state_dict())
    assert planned.specs == plain.specs and planned.nbytes == plain.nbytes
    assert planned.layout_key == plain.layout_key
    assert json.dumps(planned.skeleton) == json.dumps(plain.skeleton)
    for spec, x, y in zip(planned.specs, planned.tensors, plain.tensors, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), spec.path


class LateBuffer(torch.optim.Optimizer):
    """SGD that creates a second buffer per parameter only at its third step."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", torch.zeros(())) + 1
                if state["n"] >= 3:
                    buf = state.setdefault("avg", torch.zeros_like(p))
                    buf.mul_(0.5).add_(p)
                p.add_(p.grad, alpha=-group["lr"])


class Growing:
    """A scheduler-like object whose state grows at every step."""

    def __init__(self) -> None:
        self.history: list[float] = []

    def step(self, value: float) -> None:
        self.history.append(value)

    def state_dict(self) -> dict:
        return {"history": list(self.history), "last": torch.tensor(self.history[-1:] or [0.0])}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])


def make(opt_kind: str = "adam") -> tuple[torch.nn.Module, torch.optim.Optimizer, Growing, TrainState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    params = list(model[0].parameters()) + list(model[1].parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=0.01) if opt_kind == "adam" else LateBuffer(params, lr=0.01)
    )
    sched = Growing()
    return model, opt, sched, TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Growing) -> None:
    loss = model(torch.randn(5, 6)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step(float(loss.detach()))


@pytest.fixture
def mgr(memdir, tmp_path):
    made = []

    def new(every_steps: int = 0) -> CheckpointManager:
        cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=every_steps)
        m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
        made.append(m)
        return m

    yield new
    for m in made:
        m.close()


def restored_state(new) -> tuple[int, dict]:
    got = new().restore()
    assert got is not None and got.source == "memory"
    return got.step, got.state


def test_planned_once_while_the_structure_holds_and_equal_to_the_flattened_state():
    model, opt, sched, ts = make()
    train_step(model, opt, sched)
    ts.snapshot()
    plans = ts._planner.plans  # type: ignore[union-attr]
    for _ in range(5):
        train_step(model, opt, sched)
        opt.param_groups[0]["lr"] *= 0.5  # hyper-parameters are read at every step
        as_flattened(ts)
    # The scheduler's state grows at each step but holds one tensor of the same shape: no new plan.
    assert ts._planner.plans == plans  # type: ignore[union-attr]
    assert ts.snapshot().skeleton["optimizer"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("change", ["param_group", "late_state", "scheduler_grows", "data_swap", "loaded"])
def test_a_structure_change_is_re_planned_and_restores_bit_identically(change, mgr):
    model, opt, sched, ts = make("late" if change == "late_state" else "adam")
    m = mgr()
    m.attach(opt)
    for n in range(1, 4):
        train_step(model, opt, sched)
        ts.step = n
        m.save(n, ts.snapshot)
    plans = ts._planner.plans  # type: ignore[union-attr]
    if change == "param_group":
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})
    elif change == "scheduler_grows":
        sched.state_dict = lambda: {"history": list(sched.history), "extra": torch.arange(len(sched.history))}  # type: ignore[method-assign]
    elif change == "data_swap":
        model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # same Parameter, new storage
    elif change == "loaded":
        opt.load_state_dict(cloned(opt.state_dict()))  # every optimizer state tensor replaced
    for n in range(4, 7):
        train_step(model, opt, sched)
        ts.step = n
        m.save(n, ts.snapshot)
        as_flattened(ts)
    expected = cloned(ts.state_dict())
    m.close()
    assert ts._planner.plans > plans or change == "loaded"  # type: ignore[union-attr]
    step, got = restored_state(mgr)
    assert step == 6
    assert equal(got["model"], expected["model"])  # type: ignore[index]
    assert equal(got["optimizer"], expected["optimizer"])  # type: ignore[index]
    assert equal(got["scheduler"], expected["scheduler"])  # type: ignore[index]
    if change == "late_state":
        assert all("avg" in s for s in got["optimizer"]["state"].values())
    if change == "param_group":
        assert len(got["optimizer"]["param_groups"]) == 2
    # …and it loads: a fresh set of objects takes it and continues.
    model2, opt2, _, ts2 = make("late" if change == "late_state" else "adam")
    if change == "param_group":
        opt2.add_param_group({"params": list(model2[2].parameters()), "lr": 0.5})
    ts2.load_state_dict(got)
    assert equal(model2.state_dict(), model.state_dict())
    assert equal(opt2.state_dict(), opt.state_dict())


def test_a_replaced_parameter_and_a_new_buffer_are_seen(mgr):
    model, opt, sched, ts = make()
    train_step(model, opt, sched)
    ts.snapshot()
    model[2].weight = torch.nn.Parameter(torch.ones(3, 8))
    model[2].register_buffer("seen", torch.arange(4.0))
    as_flattened(ts)
    assert "seen" in json.dumps(ts.snapshot().skeleton["model"])


def test_a_state_dict_hook_registered_later_is_honoured():
    model, opt, sched, ts = make()
    train_step(model, opt, sched)
    ts.snapshot()

    def renamed(module, state, prefix, local_metadata):
        return {("hooked." + k): v for k, v in state.items()}

    model._register_state_dict_hook(renamed)
    as_flattened(ts)
    assert all(k.startswith("hooked.") for k in ts.snapshot().skeleton["model"])


def test_a_model_with_a_custom_state_dict_is_read_every_step():
    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": self.calls}

        def set_extra_state(self, state):
            self.calls = state["calls"]

    torch.manual_seed(0)
    model = Extra(2, 2)
    model.calls = 0
    ts = TrainState(model=model)
    for n in range(3):
        model.calls = n
        assert ts.snapshot().skeleton["model"]["_extra_state"] == {"calls": n}


def test_numpy_rng_capture_is_exact_across_draws_and_pending_gaussians():
    np.random.seed(1)
    for draw in [
        lambda: None,
        np.random.rand,
        np.random.randn,
        lambda: None,
        np.random.randn,
        np.random.randn,
    ]:
        draw()
        got = rng.capture()["numpy"]
        name, keys, pos, has_gauss, cached = np.random.get_state()
        assert got[0] == name and np.array_equal(got[1].numpy(), keys.astype("int64"))
        assert (got[2], got[3], got[4]) == (pos, has_gauss, cached)
    # Restoring puts the generator back; the next capture is of the restored state.
    saved = rng.capture()
    first = np.random.rand(3)
    random.random()
    rng.restore(saved)
    assert np.array_equal(np.random.rand(3), first)


def test_python_rng_capture_is_exact_and_the_same_tuple_while_nothing_draws():
    """The Python generator's state is read from its C words: unchanged, the last tuple is returned (its
    snapshot part is then recognised by identity); any draw, pending gaussian or re-seed is a new state."""
    random.seed(3)
    first = rng.capture()["python"]
    assert first == random.getstate() and rng.capture()["python"] is first
    draws = [random.random, lambda: random.gauss(0, 1), lambda: random.seed(4), lambda: random.getrandbits(3)]
    for draw in draws:
        draw()
        got = rng.capture()["python"]
        assert got == random.getstate() and got is not first
        first = got
    saved = rng.capture()
    values = [random.random() for _ in range(3)]
    rng.restore(saved)
    assert [random.random() for _ in range(3)] == values


def test_small_values_follow_every_step_without_a_new_plan():
    """Param-group hyper-parameters and Python's RNG state are parts keyed by their values: a change is in
    the next snapshot's skeleton, an unchanged one reuses the last skeleton object, neither re-plans."""
    model, opt, sched, ts = make()
    train_step(model, opt, sched)
    first = ts.snapshot()
    plans = ts._planner.plans  # type: ignore[union-attr]
    same = ts.snapshot()
    assert same.skeleton["optimizer"]["param_groups"] is first.skeleton["optimizer"]["param_groups"]
    assert same.skeleton["rng"]["python"] is first.skeleton["rng"]["python"]
    opt.param_groups[0]["lr"] = 0.25
    random.random()
    changed = ts.snapshot()
    assert changed.skeleton["optimizer"]["param_groups"][0]["lr"] == 0.25
    state = flatten(ts.state_dict())
    assert json.dumps(changed.skeleton["rng"]["python"]) == json.dumps(state.skeleton["rng"]["python"])
    assert ts._planner.plans == plans and changed.specs is first.specs


def test_a_hyper_parameter_that_becomes_a_tensor_of_the_same_value_is_a_tensor_in_the_snapshot(mgr):
    """Equal values of another type are a change: the float lr replaced by a tensor holding the same value
    is stored (and restored) as that tensor, never as the float seen before."""
    model, opt, sched, ts = make()
    m = mgr()
    train_step(model, opt, sched)
    ts.step = 1
    m.save(1, ts.snapshot)
    opt.param_groups[0]["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    ts.step = 2
    m.save(2, ts.snapshot)
    as_flattened(ts)
    m.close()
    step, got = restored_state(mgr)
    lr = got["optimizer"]["param_groups"][0]["lr"]
    assert step == 2 and isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(0.01)


def renamed(module, state, prefix, local_metadata):
    return {("hooked." + k): v for k, v in state.items()}


@pytest.mark.parametrize(
    "change", ["param_group", "late_state", "replaced_parameter", "new_buffer", "loaded"]
)
def test_changes_seen_without_touching_a_tensor_are_planned_at_once_by_the_unverified_snapshot(change):
    """``snapshot(verify=False)`` checks registrations, the optimizer's groups, parameter lists and state
    entries (and a loaded state): such a change makes that very snapshot a new plan."""
    model, opt, sched, ts = make()
    if change != "late_state":
        train_step(model, opt, sched)
    ts.snapshot(verify=False)
    plans = ts._planner.plans  # type: ignore[union-attr]
    if change == "param_group":
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})
    elif change == "late_state":
        train_step(model, opt, sched)  # AdamW's state appears at its first step
    elif change == "replaced_parameter":
        model[2].weight = torch.nn.Parameter(torch.ones(3, 8))
    elif change == "new_buffer":
        model[2].register_buffer("seen", torch.arange(4.0))
    elif change == "loaded":
        opt.load_state_dict(cloned(opt.state_dict()))
    as_flattened(ts, verify=False)
    assert ts._planner.plans > plans or change == "loaded"  # type: ignore[union-attr]


MISSED = [
    "data_swap",
    "data_reshaped",
    "model_to_double",
    "optimizer_tensor_replaced",
    "late_buffer",
    "state_dict_hook",
    "buffer_deleted",
]


def miss(change: str, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Growing) -> bool:
    """Make a change that only the full check sees; returns whether the model still trains after it."""
    if change == "data_swap":
        model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # same Parameter, shape and dtype
    elif change == "data_reshaped":
        model[0].weight.data = torch.arange(48.0).reshape(6, 8)  # same Parameter, transposed shape
        return False
    elif change == "model_to_double":
        model.to(torch.float64)
        return False
    elif change == "optimizer_tensor_replaced":
        opt.state[model[0].weight]["exp_avg"] = torch.full_like(model[0].weight, 3.0)
    elif change == "late_buffer":
        opt.state[model[0].weight]["extra"] = torch.zeros(3)  # an entry added to a parameter's state
    elif change == "state_dict_hook":
        model._register_state_dict_hook(renamed)
    elif change == "buffer_deleted":
        del model[1].num_batches_tracked
        return False
    return True


@pytest.mark.parametrize("change", MISSED)
def test_a_change_only_the_full_check_sees_is_never_sealed_and_the_next_snapshot_is_planned_anew(change, mgr):
    """The memory tier checks an unverified snapshot on its copier before the seal: a change the training
    thread's cheap check missed leaves that step's slot invalid (the previous step stays the newest), and
    the next snapshot is planned anew and restores bit-identically."""
    model, opt, sched, ts = make()
    m = mgr()
    m.attach(opt)
    assert m.memory is not None
    fast = partial(ts.snapshot, verify=False)
    first = 3
    for n in range(1, first + 1):
        train_step(model, opt, sched)
        ts.step = n
        m.save(n, fast)
    m.memory.wait_idle()
    assert m.memory.sealed_step == first and m.memory.rejected_step is None
    trains = miss(change, model, opt, sched)
    ts.step = first + 1
    m.save(first + 1, fast)
    m.memory.wait_idle()
    assert m.memory.rejected_step == first + 1 and m.memory.sealed_step == first
    newest = m.memory.newest_valid()
    assert newest is not None and newest.step == first
    plans = ts._planner.plans  # type: ignore[union-attr]
    for n in range(first + 2, first + 4):
        if trains:
            train_step(model, opt, sched)
        ts.step = n
        m.save(n, fast)
    m.memory.wait_idle()
    assert m.memory.sealed_step == first + 3 and m.memory.rejected_step == first + 1
    assert ts._planner.plans > plans  # type: ignore[union-attr]
    as_flattened(ts, verify=False)
    expected = cloned(ts.state_dict())
    m.close()
    step, got = restored_state(mgr)
    assert step == first + 3
    assert equal(got["model"], expected["model"])  # type: ignore[index]
    assert equal(got["optimizer"], expected["optimizer"])  # type: ignore[index]


@pytest.mark.parametrize("change", ["data_swap", "optimizer_tensor_replaced"])
def test_a_durable_step_checks_the_structure_before_its_copy(change, mgr):
    """A step with a durable checkpoint due checks the unverified snapshot on the training thread and plans
    it anew: that step's snapshot is sealed, correct, not lost."""
    model, opt, sched, ts = make()
    m = mgr(every_steps=4)
    m.attach(opt)
    assert m.memory is not None
    fast = partial(ts.snapshot, verify=False)
    for n in range(1, 4):
        train_step(model, opt, sched)
        ts.step = n
        m.save(n, fast)
    train_step(model, opt, sched)
    miss(change, model, opt, sched)
    ts.step = 4
    m.save(4, fast)
    m.wait()
    m.memory.wait_idle()
    assert m.memory.sealed_step == 4 and m.memory.rejected_step is None
    expected = cloned(ts.state_dict())
    m.close()
    step, got = restored_state(mgr)
    assert step == 4
    assert equal(got["model"], expected["model"])  # type: ignore[index]
    assert equal(got["optimizer"], expected["optimizer"])  # type: ignore[index]


def test_an_optimizer_replacing_its_state_tensors_every_step_loses_one_snapshot_then_is_checked_in_the_loop(
    mgr,
):
    """LateBuffer assigns a new counter tensor at every step, which only the full check sees: after the
    first failed check its part is checked fully on the training thread, so no later snapshot is lost."""
    model, opt, sched, ts = make("late")
    m = mgr()
    m.attach(opt)
    assert m.memory is not None
    fast = partial(ts.snapshot, verify=False)
    rejected = []
    for n in range(1, 8):
        train_step(model, opt, sched)
        ts.step = n
        m.save(n, fast)
        m.memory.wait_idle()
        if m.memory.rejected_step == n:
            rejected.append(n)
        else:
            assert m.memory.sealed_step == n
    assert rejected == [2]
    expected = cloned(ts.state_dict())
    m.close()
    step, got = restored_state(mgr)
    assert step == 7 and all("avg" in s for s in got["optimizer"]["state"].values())
    assert equal(got["optimizer"], expected["optimizer"])  # type: ignore[index]


def newest(m: CheckpointManager) -> tuple[int, dict]:
    """The newest sealed snapshot of ``m``'s memory tier as (step, state), read back from the slot."""
    assert m.memory is not None
    held = m.memory.newest_valid()
    assert held is not None
    buf = m.memory.data(held.slot, held.nbytes).clone()
    return held.step, unflatten(held.skeleton, [tensor_at(buf, s) for s in held.specs])


def same_rng(got: dict, expected: dict) -> bool:
    """A restored RNG state (tuples come back as tuples, tensors as copies) equals a fresh capture."""
    return (
        torch.equal(got["torch"], expected["torch"])
        and len(got["cuda"]) == len(expected["cuda"])
        and all(torch.equal(a, b) for a, b in zip(got["cuda"], expected["cuda"], strict=True))
        and got["python"] == expected["python"]
        and equal(got["numpy"], expected["numpy"])
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_every_snapshot_holds_the_rng_states_of_its_own_step_and_restores_them_exactly(seed, mgr):
    """torch's generator moves at every step, numpy's and Python's only at some (a pending Gaussian
    included, which only a full read sees): each sealed slot holds exactly the states read at its step (not
    the previous step's, not a later one), no RNG change makes a new plan, and the newest restores every
    generator exactly."""
    np.random.seed(seed)
    random.seed(seed)
    model, opt, sched, ts = make()
    m = mgr()
    m.attach(opt)
    fast = partial(ts.snapshot, verify=False)
    moves = ["", "numpy", "python", "gauss", "", "gauss", "both", "", "python", ""]
    plans = None
    for n, move in enumerate(moves, start=1):
        train_step(model, opt, sched)  # torch's generator moves
        if move in ("numpy", "both"):
            np.random.rand()
        if move in ("python", "both"):
            random.random()
        if move == "gauss":
            np.random.randn()  # one of a pair: the other is cached in the generator
        ts.step = n
        m.save(n, fast)
        expected = rng.capture()
        step, got = newest(m)
        assert step == n and same_rng(got["rng"], expected), (n, move)
        if plans is None:
            plans = ts._planner.plans  # type: ignore[union-attr]
    assert ts._planner.plans == plans  # type: ignore[union-attr]
    after = (torch.rand(4), [random.random() for _ in range(3)], np.random.randn(3), np.random.rand(2))
    m.close()
    # Elsewhere the generators move on; the restored state puts each back where the last snapshot took it.
    torch.rand(7), random.random(), np.random.randn()
    step, got = restored_state(mgr)
    assert step == len(moves)
    rng.restore(got["rng"])
    again = (torch.rand(4), [random.random() for _ in range(3)], np.random.randn(3), np.random.rand(2))
    assert torch.equal(after[0], again[0]) and after[1] == again[1]
    assert np.array_equal(after[2], again[2]) and np.array_equal(after[3], again[3])


def test_python_rng_skeleton_is_reused_while_only_numpy_moves():
    """The RNG part is walked again when numpy's state moves; Python's state inside it keeps its skeleton
    object (its 625 ints are not encoded again) until Python's generator itself moves."""
    *_, ts = make()
    random.seed(2)
    first = ts.snapshot().skeleton["rng"]
    np.random.rand()
    second = ts.snapshot().skeleton["rng"]
    assert second is not first and second["numpy"] != first["numpy"]
    assert second["python"] is first["python"]
    random.random()
    third = ts.snapshot().skeleton["rng"]
    assert third["python"] is not first["python"] and third["python"] != first["python"]
    as_flattened(ts)


def test_changed_small_values_are_in_the_snapshot_of_their_step(mgr):
    """Step, data cursor, extra facts and the scheduler's state change between steps, some at every step,
    some once: each sealed slot holds the values of its own step."""
    model, opt, sched, _ = make()
    sampler = ElasticSampler(100, 7, seed=3)
    ts = TrainState(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    m = mgr()
    m.attach(opt)
    fast = partial(ts.snapshot, verify=False)
    for n in range(1, 7):
        train_step(model, opt, sched)
        sampler.advance(sampler.plan(1, 0))
        ts.step = n
        if n == 4:
            ts.meta = {"world_size": 3, "round": 2}
        m.save(n, fast)
        step, got = newest(m)
        assert step == n and got["step"] == n
        assert got["sampler"] == sampler.state_dict() and got["sampler"]["cursor"] == (7 * n) % 100
        assert got["extra"] == ts.meta
        assert got["scheduler"]["history"] == sched.history
    m.close()


def test_a_part_whose_places_belie_its_layout_is_planned_by_its_places():
    """A Fixed part that hands over new tensors at each step promises their places through its layout; a
    tensor that changed shape under an equal layout still gets its own place (a new plan), never the old
    one."""
    planner = Planner()

    def state(t: torch.Tensor, key: object) -> dict:
        return {"a": torch.zeros(3), "p": Fixed(key, [t], partial(dict, x=t), layout="L"), "b": torch.ones(2)}

    first = planner.flat(state(torch.zeros(4), object()))
    same = planner.flat(state(torch.ones(4), object()))  # a new key (walked again), the same places
    assert same.specs is first.specs and planner.plans == 1
    key = object()  # walked again with the new shape, then reused as planned
    for got in (planner.flat(state(torch.arange(6.0), key)), planner.flat(state(torch.arange(6.0), key))):
        plain = flatten({"a": torch.zeros(3), "p": {"x": torch.arange(6.0)}, "b": torch.ones(2)})
        assert got.specs == plain.specs and got.nbytes == plain.nbytes
        assert json.dumps(got.skeleton) == json.dumps(plain.skeleton)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator_states_are_those_of_get_rng_state_all_and_in_the_planned_snapshot():
    """Once CUDA is used, every device's generator state is read (without get_rng_state_all's device
    switches) and is in the snapshot: a new plan (the RNG part's layout grew), equal to the flattened
    state."""
    model, opt, sched, ts = make()
    train_step(model, opt, sched)
    ts.snapshot()
    plans = ts._planner.plans  # type: ignore[union-attr]
    torch.cuda.init()
    torch.rand(3, device="cuda")
    states = rng.cuda_states()
    assert len(states) == torch.cuda.device_count()
    assert all(torch.equal(a, b) for a, b in zip(states, torch.cuda.get_rng_state_all(), strict=True))
    as_flattened(ts)
    assert ts._planner.plans > plans  # type: ignore[union-attr]
