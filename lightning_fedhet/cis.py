"""Cooperative inference system (CIS) topologies and their serving rates (thesis ch.5, Fed-CIS).

Serving rates follow the thesis's ch. 5 definitions (trees, partitions, serving settings of its experiments).

A CIS is a tree (cloud - edge - devices). Node ``i`` holds exits ``1..E_i`` of an early-exit network (parents hold
strictly deeper exits than their children) and, at inference time, answers with its largest exit ``E_i``.
Requests arrive locally at rate ``lambda^l_i``; a node serves part of what it receives and forwards the rest to its
parent at the transfer rate ``lambda^t_i``, capped by ``mu^max_i``. Offloading as much as possible is optimal
(deeper exits are more accurate), which gives the recurrence (thesis ch. 5, from the leaves up)::

    in_i       = lambda^l_i + sum_{j child of i} lambda^t_j          (requests reaching node i)
    lambda^t_i = min(mu^max_i, in_i)        (0 for a root: it has no parent to forward to)
    lambda^s_i = in_i - lambda^t_i                                   (served by node i with exit E_i)
    Lambda_e   = sum_{i : E_i = e} lambda^s_i                         (serving rate of exit e)

Decisions (not fixed by the thesis): a root's ``transfer_cap`` is ignored (it serves everything it receives);
forests (several roots) are accepted; a node has at most one parent (requests are never split between parents).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice

__all__ = ["CISTopology", "SERVING_SETTINGS", "PARTITIONS"]

#: The seven x-y-z serving settings of Tables 5.1/5.2 (% of requests served by exits 1, 2, 3).
SERVING_SETTINGS = ("80-15-5", "60-30-10", "45-35-20", "33-33-33", "20-35-45", "10-30-60", "5-15-80")

#: Share of the training data held by each tree layer (leaves, middle, root), split evenly within a layer.
#: "biased" is 14.3/28.6/57.1 % = 1/7, 2/7, 4/7 (the released code's 1,607 x4 / 6,428 x2 / 25,714 of 45,000);
#: "highly-biased" is 3.4/19.9/76.7 % taken as the code's exact counts 384 x4 / 4,480 x2 / 34,504 of 45,000.
PARTITIONS: dict[str, tuple[float, float, float]] = {
    "equal": (1 / 3, 1 / 3, 1 / 3),
    "biased": (1 / 7, 2 / 7, 4 / 7),
    "highly-biased": (1536 / 45000, 8960 / 45000, 34504 / 45000),
}

# Released-code settings, 7-node tree (thesis ch. 5): setting -> (leaf arrival, leaf transfer cap, mid transfer cap).
_SEVEN_NODE = {
    "80-15-5": (2.5, 0.5, 0.25),
    "60-30-10": (2.5, 1.0, 0.5),
    "45-35-20": (2.5, 1.375, 1.0),
    "33-33-33": (3.0, 2.0, 2.0),
    "20-35-45": (2.5, 2.0, 2.25),
    "10-30-60": (2.5, 2.25, 3.0),
    "5-15-80": (2.5, 2.375, 4.0),
}
# 17-node tree, leaf arrival 1: the three released settings; 10-30-60 is inferred from the thesis
# (missing from the repository). The other settings are derived with ``from_serving`` (proportional serving).
_SEVENTEEN_NODE = {
    "80-15-5": (1.0, 0.2, 0.15),
    "60-30-10": (1.0, 0.4, 0.3),
    "45-35-20": (1.0, 0.55, 0.6),
    "10-30-60": (1.0, 0.9, 1.8),
}
_TREES = {
    # node 0 = root (cloud, exit 3); [CODE] edges 0->{1,2}, 1->{3,4}, 2->{5,6}
    "7-node": ([[1, 2], [3, 4], [5, 6], [], [], [], []], [3, 2, 2, 1, 1, 1, 1]),
    # 0->{1..4}, mid node m in 1..4 -> {5+3(m-1), 6+3(m-1), 7+3(m-1)}
    "17-node": (
        [[1, 2, 3, 4]] + [[5 + 3 * (m - 1) + k for k in range(3)] for m in range(1, 5)] + [[] for _ in range(12)],
        [3, 2, 2, 2, 2] + [1] * 12,
    ),
}


def _as_vector(name: str, values, n: int, allow_inf: bool = False) -> Tensor:
    try:
        v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a sequence of {n} non-negative numbers, got {values!r}") from err
    if v.numel() == 1 and n != 1:
        v = v.expand(n).clone()
    if v.numel() != n:
        raise ValueError(f"{name} must have one entry per node ({n}), got {v.numel()}")
    bad = torch.isnan(v) | (v < 0) | (torch.isinf(v) if not allow_inf else torch.zeros_like(v, dtype=torch.bool))
    if bad.any():
        rng = "[0, inf]" if allow_inf else "[0, inf)"
        raise ValueError(f"{name} must be in {rng}, got {v.tolist()}")
    return v


class CISTopology:
    """A CIS tree with request rates; computes transfer/serving rates and the per-exit serving rates ``Lambda_e``.

    Args:
        children: ``children[i]`` = ids of node ``i``'s children (0-based ids, ``len(children) = N``). Each node
            has at most one parent and there is no cycle; node 0 is the root in the presets.
        max_exit: ``E_i`` per node (1-based exit index, ``>= 1``), strictly larger than every child's.
        arrival: local request rates ``lambda^l_i >= 0`` (a scalar is broadcast); their sum must be ``> 0``.
        transfer_cap: ``mu^max_i >= 0`` (``inf`` = no cap; a scalar is broadcast); ignored for roots.
        data_fraction: optional share of the training data held by each node (``>= 0``, normalised to sum 1);
            ``None`` = equal shares. Used by Fed-CIS for ``|D_i|``; not by the rates.

    All rates are ``float64`` tensors of shape ``[N]``; ``serving_rates()`` has shape ``[num_exits]``.

    Example (7-node tree, 80-15-5)::

        topo = CISTopology.preset("7-node", "80-15-5")
        topo.serving_rates()          # tensor([8.0, 1.5, 0.5]) (of 10 requests/s)
    """

    def __init__(
        self,
        children: Sequence[Sequence[int]],
        max_exit: Sequence[int],
        arrival: Sequence[float] | float,
        transfer_cap: Sequence[float] | float,
        data_fraction: Sequence[float] | None = None,
    ) -> None:
        n = len(children)
        if n == 0:
            raise ValueError("children must describe at least one node")
        parent = [-1] * n
        kids: list[tuple[int, ...]] = []
        for i, ch in enumerate(children):
            ch = tuple(ch)
            for j in ch:
                if isinstance(j, bool) or not isinstance(j, numbers.Integral) or not 0 <= j < n or j == i:
                    raise ValueError(f"children[{i}] must hold node ids in [0, {n - 1}] other than {i}, got {j!r}")
                if parent[j] != -1:
                    raise ValueError(f"children: node {j} has two parents ({parent[j]} and {i}); a tree is required")
                parent[j] = i
            kids.append(tuple(int(j) for j in ch))
        # children before parents (post-order from each root); detects cycles (unreachable nodes)
        order: list[int] = []
        roots = [i for i in range(n) if parent[i] == -1]
        stack = [(r, False) for r in reversed(roots)]
        while stack:
            i, done = stack.pop()
            if done:
                order.append(i)
                continue
            stack.append((i, True))
            stack.extend((j, False) for j in reversed(kids[i]))
        if len(order) != n:
            raise ValueError("children must describe a forest (no cycles): some nodes are not reachable from a root")

        if len(max_exit) != n:
            raise ValueError(f"max_exit must have one entry per node ({n}), got {len(max_exit)}")
        ex = []
        for i, e in enumerate(max_exit):
            if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1:
                raise ValueError(f"max_exit[{i}] must be an int >= 1, got {e!r}")
            ex.append(int(e))
        for i in range(n):
            for j in kids[i]:
                if ex[i] <= ex[j]:
                    raise ValueError(
                        f"max_exit must be strictly larger at a parent than at its children: node {i} has {ex[i]}, "
                        f"child {j} has {ex[j]}"
                    )
        self.children: tuple[tuple[int, ...], ...] = tuple(kids)
        self.parent: tuple[int, ...] = tuple(parent)
        self.roots: tuple[int, ...] = tuple(roots)
        self.order: tuple[int, ...] = tuple(order)  # leaves -> roots
        self.max_exit: tuple[int, ...] = tuple(ex)
        self.arrival = _as_vector("arrival", arrival, n)
        if float(self.arrival.sum()) <= 0:
            raise ValueError(f"arrival must have a positive total, got {self.arrival.tolist()}")
        self.transfer_cap = _as_vector("transfer_cap", transfer_cap, n, allow_inf=True)
        if data_fraction is None:
            self.data_fraction = torch.full((n,), 1.0 / n, dtype=torch.float64)
        else:
            d = _as_vector("data_fraction", data_fraction, n)
            if float(d.sum()) <= 0:
                raise ValueError(f"data_fraction must have a positive total, got {d.tolist()}")
            self.data_fraction = d / d.sum()
        self._compute_rates()

    # ------------------------------------------------------------------ rates
    def _compute_rates(self) -> None:
        n = self.num_nodes
        incoming = torch.zeros(n, dtype=torch.float64)
        transfer = torch.zeros(n, dtype=torch.float64)
        for i in self.order:
            incoming[i] = float(self.arrival[i]) + sum(float(transfer[j]) for j in self.children[i])
            transfer[i] = 0.0 if self.parent[i] == -1 else min(float(self.transfer_cap[i]), float(incoming[i]))
        self._incoming = incoming
        self._transfer = transfer
        self._served = incoming - transfer

    @property
    def num_nodes(self) -> int:
        return len(self.children)

    @property
    def num_exits(self) -> int:
        """``E = max_i E_i``."""
        return max(self.max_exit)

    @property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_nodes) if not self.children[i])

    def nodes_with_exit(self, e: int) -> tuple[int, ...]:
        """``N_e = {i : E_i = e}``."""
        return tuple(i for i, ei in enumerate(self.max_exit) if ei == e)

    def incoming_rates(self) -> Tensor:
        """``lambda^l_i + sum_children lambda^t_j``, shape ``[N]``."""
        return self._incoming.clone()

    def transfer_rates(self) -> Tensor:
        """``lambda^t_i = min(mu^max_i, incoming_i)`` (0 at roots), shape ``[N]``."""
        return self._transfer.clone()

    def node_serving_rates(self) -> Tensor:
        """``lambda^s_i`` = requests node ``i`` answers with its exit ``E_i``, shape ``[N]``."""
        return self._served.clone()

    def serving_rates(self, normalize: bool = False) -> Tensor:
        """``Lambda_e`` for ``e = 1..E`` (shape ``[E]``); ``normalize=True`` divides by the total (sums to 1)."""
        lam = torch.zeros(self.num_exits, dtype=torch.float64)
        for i, e in enumerate(self.max_exit):
            lam[e - 1] += self._served[i]
        return lam / lam.sum() if normalize else lam

    def __repr__(self) -> str:
        return (
            f"CISTopology(num_nodes={self.num_nodes}, max_exit={list(self.max_exit)}, "
            f"serving_rates={[round(float(v), 6) for v in self.serving_rates()]})"
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_serving(
        cls,
        children: Sequence[Sequence[int]],
        max_exit: Sequence[int],
        arrival: Sequence[float] | float,
        serving: str | Sequence[float],
        data_fraction: Sequence[float] | None = None,
    ) -> CISTopology:
        """Derive the transfer caps that realise a target per-exit serving split.

        Args:
            serving: either an ``"x-y-z"`` string of percentages per exit (normalised, so ``"33-33-33"`` is equal
                thirds) or a sequence of absolute per-exit serving rates ``Lambda_e`` that must sum to the total
                arrival rate.

        The nodes with exit ``e`` serve ``Lambda_e`` in proportion to the requests they receive (the same fraction
        ``r_e`` at each of them, which is how every released spec is built), processed from exit 1 up.
        Raises ``ValueError`` (naming ``serving``) when the split is infeasible on this tree: a level would have to
        serve more than reaches it, or a root would have to forward requests.
        """
        n = len(children)
        ex = list(max_exit)
        if not ex or len(ex) != n:
            raise ValueError(f"max_exit must have one entry per node ({n}), got {len(ex)}")
        num_exits = max(ex)
        arr = _as_vector("arrival", arrival, n)
        total = float(arr.sum())
        if isinstance(serving, str):
            try:
                parts = [float(p) for p in serving.split("-")]
            except ValueError as err:
                raise ValueError(f"serving must look like '80-15-5', got {serving!r}") from err
            if len(parts) != num_exits or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
                raise ValueError(f"serving must give {num_exits} non-negative percentages, got {serving!r}")
            target = [p / sum(parts) * total for p in parts]
        else:
            target = [float(v) for v in serving]
            if len(target) != num_exits or any(v < 0 or not math.isfinite(v) for v in target):
                raise ValueError(f"serving must give {num_exits} non-negative rates, got {list(serving)}")
            if not math.isclose(sum(target), total, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(
                    f"serving rates must sum to the total arrival rate {total}, got {target} (sum {sum(target)}); "
                    "pass percentages as an 'x-y-z' string"
                )
        # provisional topology (no caps) for the tree checks and the parent map
        probe = cls(children, ex, arr, float("inf"), data_fraction)
        caps = torch.zeros(n, dtype=torch.float64)
        transfer = torch.zeros(n, dtype=torch.float64)
        tol = 1e-9 * max(total, 1.0)
        for e in range(1, num_exits + 1):
            nodes = probe.nodes_with_exit(e)
            inc = {i: float(arr[i]) + sum(float(transfer[j]) for j in probe.children[i]) for i in nodes}
            reach = sum(inc.values())
            if target[e - 1] > reach + tol:
                raise ValueError(
                    f"serving is infeasible on this tree: exit {e} must serve {target[e - 1]:.6g} but only "
                    f"{reach:.6g} reaches its nodes"
                )
            r = 1.0 if reach <= tol else min(1.0, target[e - 1] / reach)
            for i in nodes:
                if probe.parent[i] == -1 and r < 1.0 - 1e-12 and inc[i] > tol:
                    raise ValueError(
                        f"serving is infeasible on this tree: root {i} (exit {e}) would have to forward requests"
                    )
                transfer[i] = 0.0 if probe.parent[i] == -1 else inc[i] * (1.0 - r)
                caps[i] = transfer[i]
        return cls(children, ex, arr, caps, data_fraction)

    @classmethod
    def preset(cls, tree: str = "7-node", serving: str = "80-15-5", partition: str = "equal") -> CISTopology:
        """The thesis's topologies (ch. 5 experiments).

        Args:
            tree: ``"7-node"`` (4 leaves with exit 1, 2 middle nodes with exit 2, root 0 with exit 3; main
                experiments) or ``"17-node"`` (12 leaves, 4 middle nodes, root; Table D.2).
            serving: one of :data:`SERVING_SETTINGS` (``"x-y-z"`` = % served by exits 1/2/3). 7-node: the released
                spec values (leaf arrival 2.5, or 3 for 33-33-33, requests arrive only at leaves). 17-node: leaf
                arrival 1; 80-15-5, 60-30-10, 45-35-20 from the released code, 10-30-60 inferred caps
                (0.9, 1.8), the rest derived by :meth:`from_serving`.
            partition: ``"equal"``, ``"biased"`` or ``"highly-biased"`` (:data:`PARTITIONS`), the data share per
                layer split evenly within a layer (``data_fraction``).
        """
        check_choice(tree, "tree", sorted(_TREES))
        check_choice(serving, "serving", SERVING_SETTINGS)
        check_choice(partition, "partition", sorted(PARTITIONS))
        children, max_exit = _TREES[tree]
        layer_counts = [max_exit.count(e) for e in (1, 2, 3)]
        share = PARTITIONS[partition]
        data = [share[e - 1] / layer_counts[e - 1] for e in max_exit]
        table = _SEVEN_NODE if tree == "7-node" else _SEVENTEEN_NODE
        leaf_rate = table[serving][0] if serving in table else 1.0
        arrival = [leaf_rate if e == 1 else 0.0 for e in max_exit]
        if serving not in table:
            return cls.from_serving(children, max_exit, arrival, serving, data)
        _, leaf_cap, mid_cap = table[serving]
        caps = [leaf_cap if e == 1 else mid_cap if e == 2 else 0.0 for e in max_exit]
        return cls(children, max_exit, arrival, caps, data)
