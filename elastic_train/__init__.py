"""elastic_train: fault-tolerant elastic training for PyTorch on an etcd v3 rendezvous."""

from __future__ import annotations

__version__ = "0.1.0"
