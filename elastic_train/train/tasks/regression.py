"""Synthetic regression with a small MLP: fast and exactly reproducible, the task the tests train.

The data is generated from its own seeded generator (``data_seed``), so it does not depend on the global RNG.
Computation is in float64 by default: the sums over a global batch then differ between world sizes only by
rounding far below the 1e-5 tolerance the equivalence tests use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from elastic_train.train.api import Task


class TensorSamples:
    """Samples stored as rows of a few tensors; batches are built by one index operation per tensor."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        assert tensors and all(len(t) == len(tensors[0]) for t in tensors)
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t.index_select(0, idx) for t in self.tensors)


def make_data(n_samples: int, dim: int, data_seed: int, dtype: torch.dtype) -> TensorSamples:
    """``y = sin(2·x·w) + 0.5·x·v + noise`` for Gaussian ``x`` (bounded nonlinearity, well-conditioned)."""
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n_samples, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5
    v = torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5
    noise = 0.05 * torch.randn(n_samples, generator=gen, dtype=torch.float64)
    y = torch.sin(2 * (x @ w)) + 0.5 * (x @ v) + noise
    return TensorSamples(x.to(dtype), y.unsqueeze(1).to(dtype))


def mse_per_sample(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean(dim=1)


def build(
    *,
    n_samples: int = 512,
    dim: int = 8,
    hidden: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    gamma: float = 0.99,
    data_seed: int = 1234,
    dtype: str = "float64",
) -> Task:
    """An MLP ``dim → hidden → hidden → 1`` trained with SGD+momentum and an exponential LR decay."""
    torch_dtype = getattr(torch, dtype)
    data = make_data(n_samples, dim, data_seed, torch_dtype)
    model = nn.Sequential(
        nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    )
    model.to(torch_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=gamma)
    return Task(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=data,
        loss_fn=mse_per_sample,
        batch_fn=data.batch,
    )
