"""The torchrun entry points: torch may register them any number of times, quietly."""

from __future__ import annotations

import logging

import pytest
from torch.distributed.elastic.rendezvous import registry as torch_registry
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

from elastic_train.rendezvous import registry


def test_each_entry_point_returns_one_creator() -> None:
    assert registry.etcd3() is registry.etcd3()
    assert registry.etcd3_dynamic() is registry.etcd3_dynamic()
    assert registry.etcd3() is not registry.etcd3_dynamic()


def test_torch_registers_the_plugins_again_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """What torch's own out-of-tree plugin test does: register the entry points a second time."""
    torch_registry._register_out_of_tree_handlers()
    with caplog.at_level(logging.DEBUG):
        torch_registry._register_out_of_tree_handlers()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert rendezvous_handler_registry._registry["etcd3"] is registry.etcd3()
    assert rendezvous_handler_registry._registry["etcd3-dynamic"] is registry.etcd3_dynamic()


class MemoryBackend:
    """torch's RendezvousBackend contract in a dict (what etcd3-dynamic keeps in one etcd key)."""

    name = "memory"

    def __init__(self) -> None:
        self.state: bytes | None = None
        self.token = 0

    def get_state(self) -> tuple[bytes, int] | None:
        return None if self.state is None else (self.state, self.token)

    def set_state(self, state: bytes, token: int | None = None) -> tuple[bytes, int, bool] | None:
        if token != (self.token if self.state is not None else None):
            return (self.state, self.token, False) if self.state is not None else None
        self.state, self.token = state, self.token + 1
        return state, self.token, True


def test_the_dynamic_handler_is_torchs_own_and_a_closed_run_leaves_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What torch's checks of a rendezvous handler plugin see (its type), and the finished-run exit."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        create_handler,
    )

    from elastic_train.rendezvous.errors import RunFinished

    params = RendezvousParameters(
        backend="etcd3-dynamic", endpoint="", run_id="late", min_nodes=1, max_nodes=1
    )
    handler = registry.closed_run_exits(create_handler(dist.HashStore(), MemoryBackend(), params))  # type: ignore[arg-type]
    assert type(handler) is DynamicRendezvousHandler
    handler.set_closed()  # the job ended: a late node finds the rendezvous closed
    with pytest.raises(RunFinished) as finished:
        handler.next_rendezvous()
    assert finished.value.code == 0
    assert capsys.readouterr().err == (
        "elastic-train: rendezvous of run late is closed (its job ended); this node has nothing left to do\n"
    )
