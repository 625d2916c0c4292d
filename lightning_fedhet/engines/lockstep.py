"""The lock-step scheduler: one round's clients, of one federation or of several, trained as stacked cohorts.

A round is split into groups by mini-batch size and by the rule's per-client config (Fed-CIS's exit), each group one
:class:`~lightning_fedhet.engines.cohort.VmapCohort`; local step ``k`` of every group runs on that step's stacked
batches (built one step at a time, :class:`CohortRound`); afterwards every trained row goes back to its own
federation's server. :class:`LockStepRound` is that sequence for one round. The groups can hold clients of several
federations at once (``members`` are ``(server, plan)`` pairs, each row starts from its own federation's global state
and goes back to its own server): the vmap engine schedules one federation's round across Lightning's hooks
(:mod:`lightning_fedhet.engines.vmap`), and :mod:`lightning_fedhet.multiseed` runs many seeds of one configuration as
one batched computation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_fedhet.engines._compile_policy import recompile_budget
from lightning_fedhet.engines.base import EngineBatch
from lightning_fedhet.engines.cohort import VmapCohort
from lightning_fedhet.engines.layout import StateLayout
from lightning_fedhet.federation import RoundPlan
from lightning_fedhet.server import Server

Members = Sequence[tuple[Server, RoundPlan]]


class LockStepRound:
    """One open round of every federation in ``members`` (``(server, plan)`` pairs), as lock-step cohorts.

    Made when the rounds are open (each client starts through :meth:`Server.start_client`); then :meth:`batches`
    gives the round's lock-steps, :meth:`run` trains them (all at once, or a part at a time from ``first_step``) and
    :meth:`submit` hands every trained row to its federation's server. Closing the rounds is the caller's.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        members: Members,
        apply_config: Callable[[dict], None],
        compile: bool | str,
        layout: StateLayout,
    ) -> None:
        self.members = list(members)
        self.apply_config = apply_config
        self.groups = build_groups(module, optimizer, self.members, apply_config, compile, layout)
        #: the round's lock-steps: the most local steps of any trained client
        self.num_steps = max((int(plan.local_steps.max()) for _, plan in self.members if plan.trained_ids), default=0)

    @property
    def cohorts(self) -> list[VmapCohort]:
        return [group.cohort for group in self.groups]

    def batches(self, to_device: Callable[[Any], Any]) -> CohortRound:
        """The round's lock-steps, each built (and moved with ``to_device``) when it is used."""
        return CohortRound(lock_step_batches(self.members, self.groups, to_device), self.num_steps)

    def run(
        self, batch: CohortRound, first_step: int = 0
    ) -> tuple[dict[str, list[tuple[Tensor, np.ndarray]]], dict[str, dict[str, Any]]]:
        """Every lock-step of ``batch`` (see :func:`run_lock_steps`)."""
        return run_lock_steps(self.groups, batch, first_step, self.apply_config)

    def submit(self) -> None:
        """Every trained row's update to its federation's server (see :func:`submit_groups`)."""
        submit_groups(self.members, self.groups)

    def member_losses(self) -> list[float]:
        """Each federation's mean training loss over its clients that trained this round (NaN if none)."""
        sums, counts = [0.0] * len(self.members), [0] * len(self.members)
        for group in self.groups:
            for owner, loss in zip(group.owners.tolist(), group.cohort.mean_losses().tolist()):
                if loss == loss:  # NaN: a client with no step
                    sums[owner] += loss
                    counts[owner] += 1
        return [s / c if c else float("nan") for s, c in zip(sums, counts)]


class CohortRound(EngineBatch):
    """The vmap engine's one Lightning batch per round: ``len()`` lock-steps, built one at a time.

    ``lock_step(k)`` is local step ``k`` of every cohort: a list with one batch per cohort, each stacked on a
    leading client dimension ``[C, B, ...]`` (``[rows, B, ...]`` for a compiled cohort, whose padding rows repeat
    row 0's samples, see :attr:`VmapCohort.rows`) and already moved to the device (through the module's transfer
    hooks, which therefore see the user's batch structure with that extra leading dimension). Only one step's data
    is materialised at a time, so a round holds O(C·B) samples, not O(K·C·B).
    """

    def __init__(self, lock_step: Callable[[int], list], num_steps: int) -> None:
        self.lock_step = lock_step
        self.num_steps = int(num_steps)

    def __len__(self) -> int:
        return self.num_steps

    def __repr__(self) -> str:
        return f"CohortRound(num_steps={self.num_steps})"


@dataclass
class CohortGroup:
    """One lock-step cohort of a round and whose rows it trains.

    A round of one federation, or of several stacked ones (many seeds), is split into groups by mini-batch size and
    by the rule's per-client config (Fed-CIS's exit); each group is one :class:`VmapCohort`. Row ``r`` is client
    ``cohort.clients[r]`` of federation ``owners[r]`` (rows are sorted by federation).
    """

    cohort: VmapCohort
    config: dict
    owners: np.ndarray


def build_groups(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    members: Members,
    apply_config: Callable[[dict], None],
    compile: bool | str,
    layout: StateLayout,
) -> list[CohortGroup]:
    """The cohorts of an open round of every federation in ``members`` (``(server, plan)`` pairs), each client
    started from its own federation's global state through :meth:`Server.start_client`."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    configs: dict[tuple, dict] = {}
    kept: dict[tuple[int, int], list[dict] | None] = {}  # each client's optimizer state (optimizer_state="persist")
    persist = any(server.optimizer_state == "persist" for server, _ in members)
    for owner, (server, plan) in enumerate(members):
        sizes, batch = server.streams.sizes, server.streams.batch_size
        for client in plan.trained_ids:
            start = server.start_client(client)
            config = start.config
            key = (min(batch, int(sizes[client])), tuple(sorted(config.items())))
            groups.setdefault(key, []).append((owner, client))
            configs[key] = config
            if persist:
                kept[owner, client] = start.optimizer_state
    out = []
    for key in sorted(groups):
        rows = groups[key]
        owners = np.array([owner for owner, _ in rows], dtype=np.int64)
        clients = [client for _, client in rows]
        steps = np.array([members[owner][1].local_steps[client] for owner, client in rows], dtype=np.int64)
        starts, int_starts = _start_rows(members, owners)
        apply_config(configs[key])
        cohort = VmapCohort(
            module, optimizer, clients, steps, starts=starts, int_starts=int_starts, compile=compile, layout=layout,
            optimizer_states=[kept[row] for row in rows] if persist else None,
        )
        out.append(CohortGroup(cohort, configs[key], owners))
    return out


def _start_rows(members: Members, owners: np.ndarray) -> tuple[Tensor, Tensor]:
    """Each row's global vector ``[C, d]`` and integer buffers ``[C, m]`` (views, no copy, for one federation)."""
    blocks = [(owner, int(count)) for owner, count in zip(*np.unique(owners, return_counts=True))]
    floats = [members[owner][0].global_vector.unsqueeze(0).expand(count, -1) for owner, count in blocks]
    ints = [members[owner][0].global_ints.unsqueeze(0).expand(count, -1) for owner, count in blocks]
    if len(blocks) == 1:
        return floats[0], ints[0]
    return torch.cat(floats), torch.cat(ints)


def lock_step_batches(
    members: Members, groups: Sequence[CohortGroup], to_device: Callable[[Any], Any]
) -> Callable[[int], list]:
    """``lock_step(k)``: local step ``k``'s batch of every group, stacked ``[C, B, ...]`` and moved to the device.

    A client that has finished repeats its last batch; its cohort leaves its rows unchanged. Each group's dataset
    indices for every lock-step are stacked once, when the round opens (:func:`index_table`), so a step only gathers.
    """
    by_client: list[dict[int, list[np.ndarray]]] = []
    for _, plan in members:
        own: dict[int, list[np.ndarray]] = {}
        for (client, _), idx in zip(plan.schedule, plan.batches):
            own.setdefault(client, []).append(idx)
        by_client.append(own)
    streams = [server.streams for server, _ in members]
    # one gather for every federation when they draw from the same dataset the same way (seeds of one configuration)
    shared = all(s.dataset is streams[0].dataset and s.collate_fn is streams[0].collate_fn for s in streams)
    # Gathered with a compiled cohort's padding rows (they repeat row 0, as VmapCohort pads itself): padding the
    # gathered batch at every step copied it a second time (about 60 us a B1 step on a CPU). Several datasets are
    # gathered per federation and concatenated; the cohort pads that batch itself.
    tables = [
        index_table(
            [by_client[o][c] for o, c in zip(group.owners, group.cohort.clients)],
            group.cohort.rows if shared else len(group.cohort.clients),
        )
        for group in groups
    ]

    def lock_step(k: int) -> list:
        out = []
        for group, table in zip(groups, tables):
            indices = table[min(k, len(table) - 1)]
            if shared:
                batch = streams[0].stacked_batch(indices)
            else:
                owners = group.owners
                batch = cat_batches([streams[o].stacked_batch(indices[owners == o]) for o in np.unique(owners)])
            # each cohort's batch on its own: the module's transfer hooks see its own structure (stacked [C, B, ...],
            # or [rows, B, ...] with a compiled cohort's padding rows)
            out.append(to_device(batch))
        return out

    return lock_step


def index_table(batches: Sequence[Sequence[np.ndarray]], rows: int | None = None) -> np.ndarray:
    """The dataset indices of every lock-step of one cohort, ``[K, rows, B]``, from each client's mini-batches (``C``
    lists of ``[B]`` arrays; ``K`` is the longest list): client ``r`` at step ``k`` takes its mini-batch
    ``min(k, K_r - 1)``, so a client whose local steps are used up repeats its last batch, and rows ``C`` to
    ``rows - 1`` (a compiled cohort's padding, ``rows`` defaults to ``C``) repeat row 0. One ``np.stack`` a round."""
    steps = max(len(own) for own in batches)
    flat = [own[min(k, len(own) - 1)] for k in range(steps) for own in batches]
    table = np.stack(flat).reshape(steps, len(batches), -1)
    if rows is not None and rows > len(batches):
        table = np.concatenate([table, np.repeat(table[:, :1], rows - len(batches), axis=1)], axis=1)
    return table


def cat_batches(batches: Sequence) -> object:
    """Concatenate stacked batches (tensors, or lists/tuples/dicts of tensors) along the client dimension."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, Tensor):
        return torch.cat(list(batches))
    if isinstance(first, dict):
        return {k: cat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(cat_batches([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(f"batches of type {type(first).__name__} cannot be concatenated per client")


def submit_groups(members: Members, groups: Sequence[CohortGroup]) -> None:
    """Hand every trained row's update (parameters, floating buffers, integer buffers; with
    ``optimizer_state="persist"`` its optimizer state) to its federation's server: one :meth:`Server.submit_cohort`
    per group and federation (one finiteness check and one host sync each)."""
    for group in groups:
        cohort = group.cohort
        states, ints = cohort.flat_state(), cohort.int_state()
        losses = cohort.mean_losses().tolist()
        kept = cohort.client_optimizer_states() if cohort.persist else None
        for owner in np.unique(group.owners):
            server = members[owner][0]
            rows = np.flatnonzero(group.owners == owner)
            take = slice(int(rows[0]), int(rows[-1]) + 1)  # rows are sorted by federation: one contiguous block
            vector = server.global_vector
            deltas = states[take].to(vector) - vector
            int_deltas = ints[take].to(server.global_ints) - server.global_ints if ints.shape[1] else None
            server.submit_cohort(
                [cohort.clients[r] for r in rows], deltas, [losses[r] for r in rows], int_deltas=int_deltas,
                optimizer_states=None if kept is None else [kept[r] for r in rows],
            )


def run_lock_steps(
    groups: Sequence[CohortGroup],
    batch: CohortRound,
    first_step: int,
    apply_config: Callable[[dict], None],
) -> tuple[dict[str, list[tuple[Tensor, np.ndarray]]], dict[str, dict[str, Any]]]:
    """Every local step of a round's groups. Returns what ``self.log`` recorded: for each name, one
    ``(values, owners)`` pair per group and step, the values of the rows that took the step and their federations;
    and each logged name's ``prog_bar`` / ``logger`` / ``reduce_fx``, collected after every step (a cohort keeps only
    its last step's, and a name may be logged at some steps only)."""
    logs: dict[str, list[tuple[Tensor, np.ndarray]]] = {}
    display: dict[str, dict[str, Any]] = {}
    compiled = any(group.cohort.compiled_entry is not None for group in groups)
    # Dynamo's recompile limit raised once for the round: raised and restored at every step (what VmapCohort.step
    # does when called alone, and skips when the limit is already raised) it cost about 25 us a step
    with recompile_budget() if compiled else contextlib.nullcontext():
        for k in range(len(batch)):
            step = first_step + k
            for group, group_batch in zip(groups, batch.lock_step(k)):
                apply_config(group.config)
                _, logged = group.cohort.step(group_batch, step)
                display.update(group.cohort.log_display)
                if not logged:
                    continue
                active = group.cohort.local_steps > step
                for name, values in logged.items():
                    logs.setdefault(name, []).append((values[active.to(values.device)], group.owners[active.numpy()]))
    return logs, display
