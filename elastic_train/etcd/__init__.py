"""etcd plumbing: an embedded dev/test server and a v3 client with clear errors."""

from __future__ import annotations

from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster, find_etcd_binary

__all__ = ["EmbeddedEtcd", "EtcdCluster", "EtcdError", "find_etcd_binary"]
