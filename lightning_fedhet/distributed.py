"""Splitting a round's clients over the processes of a ``torch.distributed`` group, and merging them back.

Framework-free (``torch`` only, no Lightning). Every process draws the same round plan (a pure function of the seed
and the round), so every process can compute, without communicating, which process trains which client
(:func:`place_clients`) and how many steps each process runs. After training, every process holds the partial
sums of its own clients; :meth:`ProcessGroupComm.merge` combines them (one all-reduce of the sums per dtype and
device, one all-gather of the small per-client tables), after which every process holds the same round state as one
process that had trained every client, and closes the round identically.

Placement (``placement=``):

* ``"balanced"``: longest-processing-time first: clients sorted by decreasing local steps (ties by increasing id)
  are each given to the process with the least work so far (ties by lowest rank). Deterministic.
* ``"by_client"``: client ``i`` always trains on process ``i % world_size``. Needed when the server keeps per-client
  state that the processes shard by client id (FedVARP / MIFA / FedStale memories, ``optimizer_state="persist"``).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedhet._checks import check_choice
from lightning_fedhet.algorithms.base import RoundShares, ShardedRows
from lightning_fedhet.federation import RoundPlan

PLACEMENTS = ("balanced", "by_client")


def place_clients(plan: RoundPlan, world_size: int, placement: str) -> list[list[int]]:
    """The clients each process trains in ``plan``'s round: ``world_size`` lists of ids, each in increasing order."""
    check_choice(placement, "placement", PLACEMENTS)
    trained = plan.trained_ids
    if placement == "by_client":
        return [[c for c in trained if c % world_size == rank] for rank in range(world_size)]
    steps = plan.local_steps
    parts: list[list[int]] = [[] for _ in range(world_size)]
    loads = [(0, rank) for rank in range(world_size)]  # (work so far, rank): a heap, already ordered
    for client in sorted(trained, key=lambda c: (-int(steps[c]), c)):
        load, rank = heapq.heappop(loads)
        parts[rank].append(client)
        heapq.heappush(loads, (load + int(steps[client]), rank))
    return [sorted(part) for part in parts]


def local_view(plan: RoundPlan, clients: list[int]) -> RoundPlan:
    """``plan`` restricted to ``clients``: what one process executes (trained/arrives masks, local steps, schedule
    and batches of those clients only; availability, selection and duration unchanged)."""
    mask = torch.zeros_like(plan.trained)
    mask[clients] = True
    keep = set(clients)
    pairs = [(slot, idx) for slot, idx in zip(plan.schedule, plan.batches) if slot[0] in keep]
    return dataclasses.replace(
        plan,
        trained=plan.trained & mask,
        arrives=plan.arrives & mask,
        local_steps=np.where(mask.numpy(), plan.local_steps, 0),
        schedule=[slot for slot, _ in pairs],
        batches=[idx for _, idx in pairs],
    )


class ProcessGroupComm:
    """The collectives the many-process strategy needs, on a ``torch.distributed`` process group.

    Args:
        group: the process group (default: the world group that Lightning's launcher initialised).

    Without an initialised process group it behaves as one process (rank 0 of 1) and communicates nothing.

    Attributes:
        merge_seconds: wall-clock seconds spent in :meth:`merge` so far (waiting for the slowest process included).
        merges: number of :meth:`merge` calls so far.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.merge_seconds = 0.0
        self.merges = 0

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.active else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.active else 1

    # ------------------------------------------------------------------ one round
    def merge(self, shares: RoundShares, extra: Any = None) -> list[Any]:
        """Combine every process's ``shares`` in place (see :class:`RoundShares`) and return every process's
        ``extra`` (any picklable value) in rank order.

        One all-gather of the tables and ``extra`` (a few numbers per client), then one all-reduce per dtype and
        device of the sums (the weighted delta sum and the rule's other accumulators, flattened together).
        """
        if self.world_size == 1:
            return [extra]
        start = time.perf_counter()
        local = [dict(table) if isinstance(table, dict) else list(table) for table in shares.tables]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (local, extra), group=self.group)
        for i, table in enumerate(shares.tables):
            _install_union(table, [tables[i] for tables, _ in gathered])
        self.sum_(shares.sums)
        self.merge_seconds += time.perf_counter() - start
        self.merges += 1
        return [item for _, item in gathered]

    @property
    def device(self) -> torch.device:
        """Where the backend communicates: the current CUDA device for NCCL, else the CPU (gloo)."""
        if self.active and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum_(self, tensors: list[Tensor]) -> None:
        """Sum each tensor elementwise over the processes, in place: one all-reduce per dtype, on the backend's
        device (a tensor elsewhere, e.g. a CPU buffer under NCCL, is copied there and back)."""
        device = self.device
        groups: dict[torch.dtype, list[Tensor]] = {}
        for tensor in tensors:
            if tensor.numel():
                groups.setdefault(tensor.dtype, []).append(tensor)
        for group in groups.values():
            if len(group) == 1 and group[0].is_contiguous() and group[0].device == device:
                dist.all_reduce(group[0], group=self.group)
                continue
            flat = torch.cat([t.reshape(-1).to(device) for t in group])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # ------------------------------------------------------------------ checkpoints
    def union(self, table: dict) -> dict:
        """The union of every process's ``table`` (disjoint keys), in increasing key order."""
        if self.world_size == 1:
            return dict(sorted(table.items()))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, table, group=self.group)
        merged: dict = {}
        _install_union(merged, gathered)
        return merged

    def gather_rows(self, state: Any) -> Any:
        """``state`` with every :class:`ShardedRows` replaced by the full ``[num_rows, ...]`` tensor on rank 0 (the
        process that writes checkpoints; the others keep their shard). Every process must call it, on states of the
        same structure."""
        if isinstance(state, ShardedRows):
            return self._gather(state)
        if isinstance(state, dict):
            return {key: self.gather_rows(value) for key, value in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.gather_rows(value) for value in state)
        return state

    def _gather(self, shard: ShardedRows) -> Tensor | ShardedRows:
        if self.world_size == 1:
            return shard.values[torch.argsort(shard.rows)]
        size = -(-shard.num_rows // self.world_size)  # the largest shard
        values = torch.zeros((size, *shard.values.shape[1:]), dtype=shard.values.dtype, device=self.device)
        values[: len(shard.rows)] = shard.values
        rows = torch.full((size,), -1, dtype=torch.int64, device=values.device)
        rows[: len(shard.rows)] = shard.rows.to(values.device)
        root = self.rank == 0
        all_values = [torch.empty_like(values) for _ in range(self.world_size)] if root else None
        all_rows = [torch.empty_like(rows) for _ in range(self.world_size)] if root else None
        dist.gather(values, all_values, dst=0, group=self.group)
        dist.gather(rows, all_rows, dst=0, group=self.group)
        if not root:
            return shard
        full = torch.zeros((shard.num_rows, *values.shape[1:]), dtype=values.dtype)  # checkpoints hold CPU tensors
        for part_rows, part_values in zip(all_rows, all_values):
            used = part_rows >= 0
            full[part_rows[used].cpu()] = part_values[used].cpu()
        return full


def _install_union(table: dict | list, parts: list) -> None:
    """Replace ``table`` in place by the union of ``parts`` (every process's table), in increasing id order."""
    if isinstance(table, dict):
        merged: dict = {}
        for part in parts:
            clash = merged.keys() & part.keys()
            if clash:
                raise RuntimeError(f"clients {sorted(clash)} were reported by two processes in the same round")
            merged.update(part)
        table.clear()
        table.update(sorted(merged.items()))
    else:
        table[:] = sorted({client for part in parts for client in part})
