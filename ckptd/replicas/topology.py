"""Which ranks hold each rank's replicas: ranks on other nodes, chosen from the group's topology.

A rank's node is its host name (``CKPTD_NODE`` overrides it: tests simulate several hosts on one
machine, and a cluster whose host names do not tell its failure domains can name them).  Nodes are
numbered in the order their first rank appears; the ``j``-th replica of the rank at position ``p``
on node ``k`` goes to the rank at position ``p`` (modulo that node's size) on node ``k + j``
(modulo the number of nodes), so every replica of a rank lives on another host than the rank and
than its other replicas, and with equal node sizes every rank holds exactly ``replicas`` replicas.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = ["NODE_VARIABLE", "node_name", "replica_holders", "wards"]

NODE_VARIABLE = "CKPTD_NODE"


def node_name() -> str:
    """This process's node: ``CKPTD_NODE`` when set, else the host name."""
    return os.environ.get(NODE_VARIABLE) or socket.gethostname()


def replica_holders(nodes: Sequence[str], replicas: int) -> list[list[int]]:
    """For each rank (``nodes[rank]`` is its node), the ranks holding its ``replicas`` replicas,
    one per round; a :class:`ConfigError` when the ranks span too few nodes for that."""
    if replicas < 0:
        raise ConfigError(f"replicas must be 0 or more, got {replicas}")
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    if replicas and len(members) <= replicas:
        raise ConfigError(
            f"replicas={replicas} needs ranks on at least {replicas + 1} nodes (a replica on the rank's own "
            f"host is lost with it); this group spans {len(members)}: {', '.join(sorted(members))} "
            f"(set {NODE_VARIABLE} where host names do not tell the nodes apart)"
        )
    order = list(members)
    holders: list[list[int]] = []
    for rank, node in enumerate(nodes):
        index, position = order.index(node), members[node].index(rank)
        row = []
        for round_ in range(1, replicas + 1):
            other = members[order[(index + round_) % len(order)]]
            row.append(other[position % len(other)])
        holders.append(row)
    return holders


def wards(holders: Sequence[Sequence[int]], rank: int, round_: int) -> list[int]:
    """The ranks whose replica of round ``round_`` (0-based) ``rank`` holds, in rank order."""
    return [ward for ward, row in enumerate(holders) if row[round_] == rank]
