"""Hugging Face's ``Trainer`` made elastic: ``ElasticTrainer`` in place of ``Trainer`` (docs/huggingface.md).

The public import path of :mod:`elastic_train.integrations.hf` (needs the ``hf`` extra: transformers and
accelerate). Importing it imports transformers' Trainer, which is what ``--preload elastic_train.hf`` is for.
"""

from elastic_train.integrations.hf import ElasticTrainer, HFUnsupported

__all__ = ["ElasticTrainer", "HFUnsupported"]
