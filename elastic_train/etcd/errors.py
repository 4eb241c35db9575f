"""The etcd error family."""

from __future__ import annotations

from elastic_train.errors import ElasticTrainError


class EtcdError(ElasticTrainError):
    """etcd could not be found, started, reached or used."""
