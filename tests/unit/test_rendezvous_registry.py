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
