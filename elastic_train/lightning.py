"""Lightning made elastic: :class:`ElasticStrategy` in place of ``strategy="ddp"`` (docs/lightning.md).

The public import path of :mod:`elastic_train.integrations.lightning`, for scripts on either of Lightning's
namespaces (``import lightning as L`` or ``import pytorch_lightning as pl``)::

    from elastic_train.lightning import ElasticStrategy

Importing it imports Lightning, so a fork server told ``--preload elastic_train.lightning`` imports Lightning
once per node instead of once per worker start.
"""

from __future__ import annotations

from elastic_train.integrations.lightning import (
    ElasticEnvironment,
    ElasticStrategy,
    LightningUnsupported,
    choose_namespace,
)

__all__ = ["ElasticEnvironment", "ElasticStrategy", "LightningUnsupported", "choose_namespace"]
