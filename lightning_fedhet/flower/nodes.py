"""Which Flower node is which client: the node id <-> client id map, fixed at the run's first contact."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


class NodeMap:
    """A one-to-one map between ``num_clients`` Flower node ids and the client ids ``0 .. N-1``.

    The rules keep per-client state (stale updates, participation intervals) indexed by client id, so the map is
    made once, before round 0, and a client's id never changes during the run; only its node may, when the node
    re-registers under a new node id (:meth:`with_node`, used by the strategy for a newcomer that names the
    partition of a client whose node is gone).

    Args:
        node_ids: the node id of each client, in client-id order (distinct).
    """

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = [int(n) for n in node_ids]
        if len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError(f"node_ids must be distinct, got {self.node_ids}")
        self._client = {node: client for client, node in enumerate(self.node_ids)}

    @classmethod
    def from_partitions(cls, partitions: Mapping[int, int | None], num_clients: int) -> NodeMap:
        """The map from what each node reported at start-up (node id -> its ``partition-id``, or ``None``).

        When every node names a partition, node ``n`` is client ``partitions[n]`` (so a client keeps its id when
        its node re-registers under a new node id, and a Flower simulation's node ``partition-id=i`` is client
        ``i``, the client that holds partition ``i`` in the in-process simulation); nodes naming a partition
        ``>= num_clients`` are left out. When no node names one, the ``num_clients`` smallest node ids are the
        clients, in increasing order.

        Raises ``ValueError`` when some nodes name a partition and others do not, when two nodes name the same
        partition, or when a client id in ``0 .. num_clients-1`` has no node.
        """
        named = {node: part for node, part in partitions.items() if part is not None}
        if named and len(named) != len(partitions):
            missing = sorted(node for node, part in partitions.items() if part is None)
            raise ValueError(
                f"nodes {missing} have no partition-id in their node config while others do: give every node one "
                "(flower-supernode --node-config 'partition-id=<i>') or none"
            )
        if not named:
            nodes = sorted(partitions)
            if len(nodes) < num_clients:
                raise ValueError(f"num_clients={num_clients} but only {len(nodes)} node(s) answered")
            return cls(nodes[:num_clients])
        owner: dict[int, int] = {}
        for node, part in sorted(named.items()):
            if not 0 <= int(part) < num_clients:
                continue
            if int(part) in owner:
                raise ValueError(f"nodes {owner[int(part)]} and {node} both have partition-id={part}")
            owner[int(part)] = node
        absent = [i for i in range(num_clients) if i not in owner]
        if absent:
            raise ValueError(
                f"num_clients={num_clients} but no node has partition-id {absent} (partition ids name client ids "
                f"0 .. {num_clients - 1})"
            )
        return cls(owner[i] for i in range(num_clients))

    def with_node(self, client: int, node: int) -> NodeMap:
        """This map with client ``client`` moved to node ``node`` (its node re-registered under a new id); ``node``
        must be no client's node yet."""
        if self.client(node) is not None:
            raise ValueError(f"node {node} is already client {self.client(node)}'s")
        node_ids = list(self.node_ids)
        node_ids[client] = int(node)
        return NodeMap(node_ids)

    @property
    def num_clients(self) -> int:
        return len(self.node_ids)

    def node(self, client: int) -> int:
        """The node id of client ``client``."""
        return self.node_ids[client]

    def client(self, node: int) -> int | None:
        """The client id of node ``node``, or ``None`` for a node outside the run."""
        return self._client.get(int(node))

    def mask(self, node_ids: Iterable[int]) -> Tensor:
        """``torch.bool [N]``: which clients' nodes are among ``node_ids`` (e.g. the ones connected now)."""
        mask = torch.zeros(self.num_clients, dtype=torch.bool)
        for node in node_ids:
            client = self.client(node)
            if client is not None:
                mask[client] = True
        return mask

    def __repr__(self) -> str:
        return f"NodeMap({self.node_ids})"
