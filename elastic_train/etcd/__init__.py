"""etcd plumbing: an embedded dev/test server and a v3 client with clear errors."""

from __future__ import annotations

import os

# gRPC's C core logs a failed TLS handshake (and other transport trouble) to stderr itself; the failure
# reaches the user once, as an EtcdError line. Set here, before any module of this package imports grpc;
# an explicit setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster, find_etcd_binary

__all__ = ["EmbeddedEtcd", "EtcdCluster", "EtcdError", "find_etcd_binary"]
