"""elastic_train.lightning on Lightning's two namespaces: which one a class binds to, and that each bound
class is the namespace's own (a Trainer of one refuses the other's strategy)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

from elastic_train.integrations.lightning import choose_namespace

BOTH = ["lightning", "pytorch_lightning"]


@pytest.mark.parametrize(
    ("imported", "installed", "chosen"),
    [
        ([], BOTH, "lightning.pytorch"),  # nothing imported yet: the current name
        (["lightning.pytorch"], BOTH, "lightning.pytorch"),
        (["pytorch_lightning"], BOTH, "pytorch_lightning"),  # elastic_train never imports it: the script did
        (["lightning.pytorch", "pytorch_lightning"], BOTH, "pytorch_lightning"),
        ([], ["pytorch_lightning"], "pytorch_lightning"),
        ([], ["lightning"], "lightning.pytorch"),
    ],
)
def test_the_namespace_is_pytorch_lightning_only_where_it_is_imported(
    imported: list[str], installed: list[str], chosen: str
) -> None:
    assert choose_namespace(imported, installed) == chosen


def test_without_lightning_installed_the_error_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install 'elastic-train\[lightning\]'"):
        choose_namespace([], [])


def test_each_namespace_gets_its_own_strategy_and_environment() -> None:
    import lightning.pytorch as lp
    import pytorch_lightning as pl

    from elastic_train.lightning import ElasticEnvironment, ElasticStrategy

    for namespace, module in (("lightning.pytorch", lp), ("pytorch_lightning", pl)):
        cls = ElasticStrategy.for_namespace(namespace)
        assert cls is ElasticStrategy.for_namespace(namespace)  # built once
        strategy = cls(checkpoint="memory://ck")
        assert isinstance(strategy, ElasticStrategy) and isinstance(strategy, module.strategies.DDPStrategy)
        assert isinstance(strategy.cluster_environment, ElasticEnvironment)
        assert type(strategy.cluster_environment).namespace == namespace
        assert type(strategy).__name__ == "ElasticStrategy"
        trainer = module.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
        assert trainer.strategy is strategy
    other = ElasticStrategy.for_namespace("pytorch_lightning")(checkpoint="memory://ck")
    with pytest.raises(ValueError, match="lightning.pytorch.strategies.Strategy"):
        lp.Trainer(strategy=other, accelerator="cpu", devices=1, logger=False)  # why binding matters


def test_a_subclass_of_the_public_class_is_bound_at_instantiation() -> None:
    import pytorch_lightning as pl

    from elastic_train.lightning import ElasticStrategy

    class Mine(ElasticStrategy):
        pass

    strategy = Mine(checkpoint="memory://ck")  # pytorch_lightning is imported here: the script's namespace
    assert isinstance(strategy, Mine) and isinstance(strategy, pl.strategies.DDPStrategy)
    assert type(strategy).namespace == "pytorch_lightning" and type(strategy).__name__ == "Mine"
    with pytest.raises(ValueError, match="neither of"):
        ElasticStrategy.for_namespace("lightning")
