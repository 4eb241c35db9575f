"""Lightning's DDP strategy made elastic: one strategy in place of ``strategy="ddp"`` (docs/lightning.md).

A Lightning script keeps its ``LightningModule``, its ``DataLoader``, its callbacks and loggers and adds::

    from elastic_train.lightning import ElasticStrategy

    trainer = L.Trainer(strategy=ElasticStrategy(checkpoint="ckpts"), accelerator="cpu", devices=1)

:class:`ElasticStrategy` is Lightning's ``DDPStrategy`` with the world of the current rendezvous round
(:class:`ElasticEnvironment`), the process group from :func:`elastic_train.init`, the training DataLoader over
an :class:`~elastic_train.ElasticBatchSampler` (exactly-once, a constant global batch, the loss weighted by
sample count) and a :class:`~elastic_train.Checkpointer` committing every optimizer step.

Lightning ships under two names, ``lightning`` (``lightning.pytorch``, what Lightning's docs show) and
``pytorch_lightning``: two copies of the same code, whose classes are not each other's (a Trainer of one
refuses a strategy of the other). So each public class here is written once and bound to a namespace when it
is instantiated: to ``pytorch_lightning`` when that package is imported in the process (elastic_train itself
never imports it where ``lightning`` is installed, so it is the script's choice), else to
``lightning.pytorch`` (:func:`choose_namespace`). ``ElasticStrategy.for_namespace(...)`` names one outright.

Importing this module imports Lightning and what ``Trainer.fit`` imports on its way to the first step, so
that a fork server preloading ``elastic_train.lightning`` hands all of it to every worker.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import types
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

from elastic_train import elastic as et
from elastic_train.checkpoint import drain
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.errors import NonRetryableError
from elastic_train.log import get_logger
from elastic_train.train.busy import StepClock, time_collectives
from elastic_train.train.checkpointer import StepHook
from elastic_train.train.config import check_shares
from elastic_train.train.errors import TrainingError
from elastic_train.train.hot import request_next_round
from elastic_train.train.sampler import rebuild

if TYPE_CHECKING:  # the classes are typed as pytorch_lightning's; at run time their base is bound later
    from lightning_fabric.plugins.environments import ClusterEnvironment as _EnvironmentBase
    from pytorch_lightning import LightningModule, Trainer
    from pytorch_lightning.callbacks import Callback as _CallbackBase
    from pytorch_lightning.strategies import DDPStrategy as _StrategyBase
else:
    _EnvironmentBase = _CallbackBase = _StrategyBase = object
    LightningModule = Trainer = Any

log = get_logger(__name__)

__all__ = ["ElasticEnvironment", "ElasticStrategy", "LightningUnsupported", "choose_namespace"]

#: Lightning's two package names (the Trainer's namespace) and the Fabric package each one builds on.
NAMESPACES = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}


class LightningUnsupported(TrainingError, NonRetryableError):
    """The Trainer or module uses something the elastic strategy cannot keep its guarantees with."""

    exit_code = 2


def choose_namespace(imported: Collection[str], installed: Collection[str]) -> str:
    """The Lightning namespace to build on: ``pytorch_lightning`` when it is imported, else
    ``lightning.pytorch`` when ``lightning`` is imported or installed, else ``pytorch_lightning``.

    Args:
        imported: the namespaces (keys of :data:`NAMESPACES`) already in ``sys.modules``.
        installed: the top-level packages (``lightning``, ``pytorch_lightning``) that can be imported.

    Raises:
        ImportError: neither package is installed.
    """
    if "pytorch_lightning" in imported:
        return "pytorch_lightning"
    if "lightning.pytorch" in imported or "lightning" in installed:
        return "lightning.pytorch"
    if "pytorch_lightning" in installed:
        return "pytorch_lightning"
    raise ImportError("elastic_train.lightning needs Lightning: pip install 'elastic-train[lightning]'")


def current_namespace() -> str:
    """:func:`choose_namespace` for this process."""
    imported = [ns for ns in NAMESPACES if ns in sys.modules]
    installed = [name for name in ("lightning", "pytorch_lightning") if importlib.util.find_spec(name)]
    return choose_namespace(imported, installed)


class _PerNamespace:
    """A class written once and bound to one Lightning namespace: instantiating an unbound class (this one or
    a user's subclass) instantiates its subclass on the namespace of :func:`current_namespace`."""

    namespace: ClassVar[str | None] = None
    """The Lightning namespace the class is bound to (``None``: not yet)."""
    _bound: ClassVar[dict[tuple[type, str], type]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.namespace is None:
            cls = cls.for_namespace(current_namespace())
        return object.__new__(cls)

    @classmethod
    def for_namespace(cls, namespace: str) -> Any:
        """This class bound to ``namespace`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``).

        Raises:
            ValueError: not one of Lightning's namespaces.
        """
        if cls.namespace is not None:
            if cls.namespace != namespace:
                raise ValueError(f"{cls.__qualname__} is bound to {cls.namespace}, not {namespace}")
            return cls
        if namespace not in NAMESPACES:
            raise ValueError(f"Lightning namespace {namespace!r} is neither of {', '.join(NAMESPACES)}")
        key = (cls, namespace)
        if key not in _PerNamespace._bound:
            attrs = {"namespace": namespace, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
            bases = (cls, cls._lightning_base(namespace))
            bound = types.new_class(cls.__name__, bases, exec_body=lambda ns: ns.update(attrs))
            _PerNamespace._bound[key] = bound
        return _PerNamespace._bound[key]

    @staticmethod
    def _lightning_base(namespace: str) -> type:
        raise NotImplementedError


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise TrainingError(f"${name}: {value!r} is not an integer") from None


class ElasticEnvironment(_PerNamespace, _EnvironmentBase):
    """Lightning's view of the worker group torchrun formed in the current rendezvous round.

    Ranks and world size are read from torchrun's variables of this round (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``GROUP_RANK``); Lightning's ``num_nodes`` is not compared with them, so every world size
    within the job's node range trains. Without torchrun it is a world of one.
    """

    @staticmethod
    def _lightning_base(namespace: str) -> type:
        module = importlib.import_module(f"{NAMESPACES[namespace]}.plugins.environments")
        return module.ClusterEnvironment

    @property
    def creates_processes_externally(self) -> bool:
        return True  # torchrun (or the user, for a world of one) starts every process

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return _env_int("MASTER_PORT", 0)

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return _env_int("WORLD_SIZE", 1)

    def set_world_size(self, size: int) -> None:
        pass  # the round decides

    def global_rank(self) -> int:
        return _env_int("RANK", 0)

    def set_global_rank(self, rank: int) -> None:
        pass  # the round decides

    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        return _env_int("GROUP_RANK", 0)

    def local_world_size(self) -> int:
        return _env_int("LOCAL_WORLD_SIZE", 1)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = self.local_world_size()
        if num_devices != local:
            raise LightningUnsupported(
                f"Trainer(devices={num_devices}) but torchrun starts {local} process(es) per node "
                f"(--nproc-per-node): give devices={local}"
            )


class ElasticStrategy(_PerNamespace, _StrategyBase):
    """Lightning's DDP strategy made elastic: ranks from the round, exactly-once data, per-step state tiers.

    Args:
        global_batch: samples per optimizer step over all ranks, whatever the world size (default: the
            training DataLoader's ``batch_size`` times ``Trainer(num_nodes=..., devices=...)``, the world the
            script was written for).
        checkpoint: checkpoint root, any fsspec URL (default ``config.url``, ``checkpoints``); the run's
            checkpoints go to ``checkpoint/run_id`` (``run_id``: torchrun's ``--rdzv-id``).
        every_steps: durable checkpoint every N optimizer steps (default ``config.every_steps``).
        seed: epoch ``e`` of the data walks the permutation seeded ``seed + e``.
        loss_reduction: how ``training_step``'s loss is reduced over the rank's batch: ``"mean"``
            (Lightning's usual) or ``"sum"``; the loss is weighted so the update is the mean-loss gradient
            of the whole step.
        resume_from: a checkpoint to start from when the run has none.
        config: every other checkpoint setting (``keep_last``, ``memory_dir``, ``storage_options`` …).
        run_id: checkpoints go to ``checkpoint/run_id`` (default: torchrun's ``--rdzv-id``).
        hooks: called with the step number at every commit, before the state is saved.
        shares: ``"even"`` or ``"speed"``: each step split by the ranks' measured speeds
            (docs/stragglers.md). The busy times ride in the strategy's DDP communication hook, which
            also lets slow-node detection tell a rank's work from its wait; with a ``ddp_comm_hook`` of
            your own neither works (shares stay even, nobody is flagged).
        **kwargs: passed to ``DDPStrategy`` (``find_unused_parameters``, ``timeout``,
            ``process_group_backend`` …).
    """

    strategy_name = "elastic"

    @staticmethod
    def _lightning_base(namespace: str) -> type:
        return importlib.import_module(f"{namespace}.strategies").DDPStrategy

    def __init__(
        self,
        global_batch: int | None = None,
        checkpoint: str | None = None,
        *,
        every_steps: int | None = None,
        seed: int = 0,
        loss_reduction: str = "mean",
        resume_from: str | None = None,
        config: CheckpointConfig | None = None,
        run_id: str | None = None,
        hooks: Sequence[StepHook] = (),
        shares: str = "even",
        **kwargs: Any,
    ) -> None:
        check_shares(shares)
        if global_batch is not None and global_batch < 1:
            raise ValueError(f"global_batch: {global_batch} must be >= 1")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction: {loss_reduction!r} is neither 'mean' nor 'sum'")
        assert self.namespace is not None, "instantiated through _PerNamespace.__new__"
        kwargs.setdefault("cluster_environment", ElasticEnvironment.for_namespace(self.namespace)())
        super().__init__(**kwargs)
        self.global_batch = global_batch
        self.seed = seed
        self.loss_reduction = loss_reduction
        self.shares = shares
        #: The step clock the DDP timing hook reports to (slow-node detection, speed-weighted shares).
        self.clock = StepClock()
        self._ckpt_args: dict[str, Any] = {
            "url": checkpoint,
            "every_steps": every_steps,
            "resume_from": resume_from,
            "config": config,
            "run_id": run_id,
            "hooks": tuple(hooks),
        }
        self._requested_nodes = 1
        self.sampler: et.ElasticBatchSampler | None = None
        self.checkpointer: et.Checkpointer | None = None
        self._loader: DataLoader[Any] | None = None

    # -- the world of this round -----------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes of the current round (``WORLD_SIZE / LOCAL_WORLD_SIZE``), not ``Trainer(num_nodes=...)``."""
        env = self.cluster_environment
        if isinstance(env, ElasticEnvironment):
            return max(1, env.world_size() // max(1, env.local_world_size()))
        return self._requested_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._requested_nodes = num_nodes  # only sizes the default global batch

    def setup_distributed(self) -> None:
        assert self.namespace is not None
        importlib.import_module(f"{NAMESPACES[self.namespace]}.utilities.seed").reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        et.init(self._process_group_backend, timeout=self._timeout)

    def setup(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            raise LightningUnsupported(
                "manual optimization (automatic_optimization = False, which Lightning needs for several "
                "optimizers) is not supported by ElasticStrategy: it commits the state after each automatic "
                "optimizer step of one optimizer"
            )
        if trainer.accumulate_grad_batches != 1:
            raise LightningUnsupported(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported by "
                "ElasticStrategy: one batch is one optimizer step of global_batch samples "
                "(raise global_batch)"
            )
        super().setup(trainer)  # (Lightning itself refuses several optimizers in automatic optimization)
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, _Commit) for cb in callbacks):
            assert self.namespace is not None
            callbacks.append(_Commit.for_namespace(self.namespace)(self))

    def _register_ddp_hooks(self) -> None:
        """Lightning's hooks when the strategy was given a ``ddp_comm_hook``; else the timing hook (DDP's
        default reduction, the rank's wait for the others timed: slow-node detection, speed shares)."""
        if self._ddp_comm_hook is not None or not isinstance(self.model, DistributedDataParallel):
            super()._register_ddp_hooks()
            return
        time_collectives(self.model, self.clock)

    # -- data ------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader over the elastic sampler (evaluation loaders as Lightning made them)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if self._loader is not None:
            return self._loader  # reloaded: the same sampler goes on
        if not isinstance(dataloader, DataLoader):
            raise LightningUnsupported(
                f"the training data is a {type(dataloader).__name__}, not a torch DataLoader: "
                "ElasticStrategy needs a DataLoader over a map-style dataset"
            )
        if isinstance(dataloader.dataset, IterableDataset):
            raise LightningUnsupported(
                "the training DataLoader has an IterableDataset: exactly-once data needs a map-style dataset "
                "(len and integer indexing)"
            )
        batch_size = dataloader.batch_size
        if batch_size is None:
            raise LightningUnsupported(
                "the training DataLoader has a batch_sampler of its own: give it batch_size= (per rank) and "
                "ElasticStrategy(global_batch=...) instead; the strategy draws the batches"
            )
        global_batch = self.global_batch or batch_size * self._requested_nodes * self.num_processes
        self.sampler = _EpochSampler(dataloader.dataset, global_batch, seed=self.seed, shares=self.shares)
        self._loader = rebuild(dataloader, self.sampler)
        self._restore(trainer)
        return self._loader

    def _restore(self, trainer: Trainer) -> None:
        """Collective: the newest state anywhere into the module, optimizer, scheduler, data position and
        Lightning's loop counters (before the training loop draws its first batch)."""
        assert self.sampler is not None and self.lightning_module is not None
        configs = trainer.lr_scheduler_configs
        state = et.TrainState(
            model=self.lightning_module,
            optimizer=self.optimizers[0],
            scheduler=configs[0].scheduler if len(configs) == 1 else None,
            sampler=self.sampler,
            **{f"scheduler{i}": c.scheduler for i, c in enumerate(configs) if len(configs) > 1},
        )
        args = {k: v for k, v in self._ckpt_args.items() if k != "hooks"}
        self.checkpointer = et.Checkpointer(state, **args, hooks=self._ckpt_args["hooks"], clock=self.clock)
        step = self.checkpointer.restore()
        loop = trainer.fit_loop
        if step == 0:
            # nothing of ours: go on from what Lightning restored (ckpt_path), or from the start
            self.sampler.epoch = trainer.current_epoch
            state.step = self.sampler.step = trainer.global_step
            return
        log.info("lightning_resumed", step=step, epoch=self.sampler.epoch, source=self.checkpointer.source)
        loop.restarting = False  # our state supersedes a Lightning checkpoint loaded before it
        epoch = self.sampler.epoch
        for progress in (loop.epoch_progress.total, loop.epoch_progress.current):
            for counter in ("ready", "started", "processed", "completed"):
                setattr(progress, counter, epoch)
        steps = loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = step
        loop.epoch_loop._batches_that_stepped = step

    # -- the step --------------------------------------------------------------------------------------------
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Weigh this rank's loss by its share of the step, so DDP's average is the whole step's gradient."""
        module = self.lightning_module
        if self.sampler is not None and module is not None and module.trainer.training:
            closure_loss = closure_loss * self.sampler.loss_weight(self.loss_reduction)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning's SIGTERM handler broadcasts from inside the signal handler, which deadlocks when the
        # signal lands while a collective (a checkpoint barrier) is in flight. The state is in shared memory
        # after every step: a stopped worker may simply end, once the snapshot copy in flight is sealed.
        if not drain.install(claim=True):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def on_exception(self, exception: BaseException) -> None:
        # a broken group re-formed in-process: the agent joins the next round while Lightning tears down
        request_next_round(exception)
        super().on_exception(exception)
        # no final checkpoint and no waiting on peers that may be gone: the snapshot stays for the next group
        self.checkpointer = None


class _EpochSampler(et.ElasticBatchSampler):
    """The elastic sampler with the length of a whole epoch, which Lightning takes once for every epoch (a
    resumed partial epoch ends when the sampler runs out; Lightning sees that as its last batch)."""

    def __len__(self) -> int:
        return -(-self.dataset_len // self.global_batch)


class _Commit(_PerNamespace, _CallbackBase):
    """Commits each optimizer step (after Lightning stepped the LR schedulers) and finalizes the run."""

    def __init__(self, strategy: ElasticStrategy) -> None:
        self.strategy = strategy

    @staticmethod
    def _lightning_base(namespace: str) -> type:
        return importlib.import_module(f"{namespace}.callbacks").Callback

    @property
    def state_key(self) -> str:
        return "elastic_train.lightning.commit"

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ckpt = self.strategy.checkpointer
        if ckpt is not None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            ckpt.commit(loss if isinstance(loss, (torch.Tensor, float)) else None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ckpt = self.strategy.checkpointer
        if ckpt is not None:
            ckpt.finalize()
            self.strategy.checkpointer = None


def _import_what_fit_imports() -> None:
    """Import now Lightning (the namespace :func:`current_namespace` picks) and what ``Trainer.fit`` would
    import on its way to the first step (about 2.5 s on a busy machine), so a fork server that preloads this
    module (``--preload elastic_train.lightning``) hands all of it to every worker it forks: the checkpoint
    manager's modules, and the filesystems Lightning probes for (and so imports, when installed) at every
    Trainer start to tell object storage from a disk."""
    from lightning_utilities.core.imports import module_available

    importlib.import_module(current_namespace())
    for name in ("manager", "durable", "memory", "preflight", "schema"):
        importlib.import_module(f"elastic_train.checkpoint.{name}")
    for name in ("adlfs", "gcsfs", "s3fs"):
        if module_available(name):  # cached: a forked worker asks again for free
            importlib.import_module(name)


_import_what_fit_imports()
