"""Fault tolerance for your own training loop: process group, state tiers, exactly-once data.

A torchrun script of the usual DDP kind keeps its model, optimizer, Dataset, DataLoader and loop, and adds::

    import elastic_train as et

    world = et.init()                                     # process group from torchrun's environment
    model = Net().to(world.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = et.ElasticBatchSampler(dataset, global_batch=64, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    ckpt = et.Checkpointer(et.TrainState(model=model, optimizer=optimizer, sampler=sampler), "ckpts")
    ckpt.restore()                                        # newest state: memory, durable, resume_from
    ddp = DDP(model, device_ids=world.device_ids)
    for epoch in range(sampler.epoch, epochs):
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y) * sampler.loss_weight()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            ckpt.commit()                                 # memory snapshot every step, durable every N
    ckpt.finalize()                                       # final checkpoint, shared memory released
    et.shutdown()

The state goes through the same :class:`~elastic_train.checkpoint.CheckpointManager` as the built-in loop
(which is itself a user of this module), so ``elastic-train ckpt ls/verify/export`` read it, a restarted
worker group resumes from a surviving rank's shared memory (at most one step redone), and the data order is
the built-in one: every sample once per epoch across any resize, with a constant global batch.
See docs/own-loop.md. A sharded model (FSDP2's ``fully_shard``, rebuilt on each group's mesh with
:func:`shard_model` and :func:`device_mesh`) goes through the same ``TrainState`` and ``Checkpointer``: its
state is kept and resharded per rank (docs/sharded.md).
"""

from elastic_train.train.busy import time_collectives
from elastic_train.train.checkpointer import Checkpointer
from elastic_train.train.fsdp import device_mesh, load_full, shard_model
from elastic_train.train.group import World, current_world, init, resolve_backend, shutdown
from elastic_train.train.hot import elastic_run as run
from elastic_train.train.sampler import ElasticBatchSampler
from elastic_train.train.state import Stateful, TrainState

__all__ = [
    "Checkpointer",
    "ElasticBatchSampler",
    "Stateful",
    "TrainState",
    "World",
    "current_world",
    "device_mesh",
    "init",
    "load_full",
    "resolve_backend",
    "run",
    "shard_model",
    "shutdown",
    "time_collectives",
]
