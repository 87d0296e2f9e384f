"""Peer snapshots: each rank's state in its host's memory, replicated to ranks on other nodes
(:class:`PeerSnapshots`), so a job that lost a host restores from memory."""

from .records import PeerRestore, ReplicationStats
from .snapshots import PeerSnapshots
from .topology import replica_holders

__all__ = ["PeerRestore", "PeerSnapshots", "ReplicationStats", "replica_holders"]
