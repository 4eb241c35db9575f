"""Task API: built-in tasks load and learn; bad task specs are one clear TaskError."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from elastic_train.train import rng
from elastic_train.train.api import Task, load_task, resolve_factory
from elastic_train.train.errors import TaskError
from elastic_train.train.tasks import charlm


def test_builtin_regression_is_seeded_and_learns() -> None:
    rng.seed_all(0)
    a = load_task("regression", {"n_samples": 128})
    rng.seed_all(0)
    b = load_task("regression", {"n_samples": 128})
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb) and pa.dtype == torch.float64
    batch = a.make_batch(list(range(128)))
    first = a.loss_fn(a.model, batch)
    assert first.shape == (128,)
    for _ in range(100):
        a.optimizer.zero_grad()
        a.loss_fn(a.model, batch).mean().backward()
        a.optimizer.step()
    assert a.loss_fn(a.model, batch).mean() < 0.5 * first.mean()


def test_charlm_corpus_is_deterministic_and_windows_line_up() -> None:
    text = charlm.make_corpus(200, corpus_seed=7)
    assert text == charlm.make_corpus(200, corpus_seed=7)
    assert text != charlm.make_corpus(200, corpus_seed=8)
    data = charlm.CharWindows(text, context=16, stride=4)
    batch = data.batch([0, 3, len(data) - 1])
    assert batch.shape == (3, 17)
    assert torch.equal(batch[1], data[3])
    decoded = "".join(data.vocab[int(i)] for i in data[len(data) - 1])
    assert text.endswith(decoded) or decoded in text


def test_charlm_loss_decreases_quickly() -> None:
    rng.seed_all(0)
    task = load_task("charlm", {"n_sentences": 300, "width": 32, "layers": 1})
    batch = task.make_batch(list(range(64)))
    losses = []
    for _ in range(40):
        task.optimizer.zero_grad()
        loss = task.loss_fn(task.model, batch).mean()
        loss.backward()
        task.optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 2.5  # about ln(vocabulary) at the start
    assert losses[-1] < 0.75 * losses[0]


def test_default_batch_collates_dataset_items() -> None:
    model = torch.nn.Linear(2, 1)
    data = [(torch.tensor([float(i), 1.0]), torch.tensor([float(i)])) for i in range(4)]
    task = Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=data,
        loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(1),
    )
    x, y = task.make_batch([1, 3])
    assert x.shape == (2, 2) and y.tolist() == [[1.0], [3.0]]


def test_module_function_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("user_tasks_for_test")

    def build(scale: int = 1) -> Task:
        model = torch.nn.Linear(1, scale)
        return Task(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            dataset=[torch.zeros(1)],
            loss_fn=lambda m, b: m(b).sum(1),
        )

    mod.build = build  # type: ignore[attr-defined]
    mod.not_a_task = lambda: 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert load_task("user_tasks_for_test:build", {"scale": 3}).model.out_features == 3  # type: ignore[union-attr]
    with pytest.raises(TaskError, match="rejected the arguments"):
        load_task("user_tasks_for_test:build", {"nope": 1})
    with pytest.raises(TaskError, match="returned a int"):
        load_task("user_tasks_for_test:not_a_task")
    with pytest.raises(TaskError, match="has no function 'missing'"):
        resolve_factory("user_tasks_for_test:missing")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuchtask", "neither a built-in task"),
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        (":build", "neither a built-in task"),
    ],
)
def test_bad_task_specs(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        resolve_factory(spec)


def test_task_validates_its_parts() -> None:
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TaskError, match="not a torch Optimizer"):
        Task(model=model, optimizer=object(), dataset=[1], loss_fn=lambda m, b: b)  # type: ignore[arg-type]
    with pytest.raises(TaskError, match="empty"):
        opt = torch.optim.SGD(model.parameters(), lr=1)
        Task(model=model, optimizer=opt, dataset=[], loss_fn=lambda m, b: b)
