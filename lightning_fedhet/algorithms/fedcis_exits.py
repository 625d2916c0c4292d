"""Which exit each Fed-CIS node trains and what an exit's sub-model holds (the rule:
:mod:`lightning_fedhet.algorithms.fedcis`).

* the exit-sampling matrix ``p`` (``[N, E]``, row ``i`` the distribution of node ``i``'s trained exit): the thesis's
  parametrisation (:func:`sampling_matrix`) and the released code's (:func:`code_sampling_matrix`);
* the sub-model masks (bool ``[E, d]``): which coordinates of the flat parameter vector each exit uses
  (:func:`exit_masks`), for ``FedCIS(aggregation_base="root_local")``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_fedhet.cis import CISTopology
from lightning_fedhet.flat import FlatModel

__all__ = ["sampling_matrix", "code_sampling_matrix", "exit_masks", "check_p_matrix", "check_exit_masks"]

_ROW_TOL = 1e-6


def sampling_matrix(topology: CISTopology, p: float) -> Tensor:
    """The thesis's exit-sampling matrix ``[N, E]`` (float64): ``p_{i,e} = p`` for ``e < E_i``,
    ``p_{i,E_i} = 1 - (E_i - 1) p`` and 0 beyond ``E_i``.

    Raises ``ValueError`` unless ``0 <= p`` and ``(E_i - 1) p <= 1`` for every node.
    """
    e_max = max(topology.max_exit)
    p_max = 1.0 if e_max <= 1 else 1.0 / (e_max - 1)
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= p_max + 1e-12:
        raise ValueError(
            f"p must be a number in [0, {p_max:.6g}] (= 1/(max E_i - 1), so that p_(i,E_i) = 1 - (E_i - 1) p >= 0), "
            f"got {p!r}"
        )
    p = min(float(p), p_max)
    mat = torch.zeros(topology.num_nodes, topology.num_exits, dtype=torch.float64)
    for i, ei in enumerate(topology.max_exit):
        mat[i, : ei - 1] = p
        mat[i, ei - 1] = max(0.0, 1.0 - (ei - 1) * p)
    return mat


def code_sampling_matrix(topology: CISTopology, smaller_exit_prob: Mapping[int, float]) -> Tensor:
    """The released code's convention ``--sampled-probability-per-layer a-b`` as an ``[N, E]`` matrix.

    A node with largest exit ``E_i`` trains a smaller exit with total probability ``smaller_exit_prob[E_i]``
    (0 when missing), chosen uniformly among ``1..E_i - 1``, and its own exit ``E_i`` otherwise; nodes with
    ``E_i = 1`` always train exit 1. The code's ``0.4-0.8`` on the 3-exit tree is ``{2: 0.4, 3: 0.8}``.
    """
    if not isinstance(smaller_exit_prob, Mapping):
        raise ValueError(f"smaller_exit_prob must map E_i -> probability, got {smaller_exit_prob!r}")
    for k, v in smaller_exit_prob.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"smaller_exit_prob[{k!r}] must be a probability in [0, 1], got {v!r}")
    mat = torch.zeros(topology.num_nodes, topology.num_exits, dtype=torch.float64)
    for i, ei in enumerate(topology.max_exit):
        a = float(smaller_exit_prob.get(ei, 0.0)) if ei > 1 else 0.0
        if ei > 1:
            mat[i, : ei - 1] = a / (ei - 1)
        mat[i, ei - 1] = 1.0 - a
    return mat


def check_p_matrix(p, topology: CISTopology) -> Tensor:
    """``p`` as a checked ``[N, E]`` exit-sampling matrix (each row sums to 1, nothing beyond a node's exits)."""
    n, e = topology.num_nodes, topology.num_exits
    try:
        mat = torch.as_tensor(p, dtype=torch.float64).clone()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"p must be a number or an [N, E] = [{n}, {e}] matrix, got {p!r}") from err
    if mat.shape != (n, e):
        raise ValueError(f"p must be a number or an [N, E] = [{n}, {e}] matrix, got shape {tuple(mat.shape)}")
    if not torch.isfinite(mat).all() or (mat < 0).any() or (mat > 1).any():
        raise ValueError(f"p entries must be probabilities in [0, 1], got {mat.tolist()}")
    sums = mat.sum(dim=1)
    bad = torch.nonzero((sums - 1).abs() > _ROW_TOL).flatten().tolist()
    if bad:
        raise ValueError(
            f"each row of p must sum to 1 (one exit per node per round): row {bad[0]} sums to {float(sums[bad[0]])}"
        )
    for i, ei in enumerate(topology.max_exit):
        if (mat[i, ei:] > 0).any():
            raise ValueError(f"p[{i}] gives positive probability to exits beyond node {i}'s largest exit E_i={ei}")
    return mat / sums[:, None]


def exit_masks(module: nn.Module, exit_modules: Sequence[Sequence[nn.Module]]) -> Tensor:
    """bool ``[E, d]``: which parameters of ``module``'s flat parameter vector belong to each exit's sub-model.

    The vector is the one the rule aggregates: :class:`~lightning_fedhet.flat.FlatModel`'s parameter part, in
    ``module.parameters()`` order, ``d = num_parameters`` (the server averages floating buffers such as BatchNorm
    statistics itself). ``exit_modules[e]`` lists the modules exit ``e + 1`` uses: for an
    :class:`~lightning_fedhet.model_zoo.EarlyExitNet` ``net``, the released code's sub-model is
    ``list(net.blocks[: net.exit_blocks[e]]) + [net.heads[e]]`` (the blocks up to the exit and that exit's head).
    Every parameter of those modules is marked.
    """
    flat = FlatModel(module)
    masks = torch.zeros(len(exit_modules), flat.num_parameters, dtype=torch.bool)
    starts = torch.tensor([0, *flat.numels]).cumsum(0).tolist()
    parameters = flat.tensors[: len(list(module.parameters()))]
    position = {id(t): (starts[k], starts[k + 1]) for k, t in enumerate(parameters)}
    for e, mods in enumerate(exit_modules):
        for m in mods:
            for t in m.parameters():
                if id(t) in position:
                    lo, hi = position[id(t)]
                    masks[e, lo:hi] = True
        if not masks[e].any():
            raise ValueError(f"exit_modules[{e}] holds no tensor of the module's flat vector")
    return masks


def check_exit_masks(masks, num_exits: int) -> Tensor:
    """``masks`` as a checked bool ``[E, d]`` tensor (a copy), every exit marking some coordinate."""
    m = torch.as_tensor(masks)
    if m.dtype != torch.bool or m.dim() != 2 or m.shape[0] != num_exits:
        raise ValueError(
            f"exit_masks must be a bool tensor of shape [E, d] with E = {num_exits} exits, got dtype {m.dtype} and "
            f"shape {tuple(m.shape)}"
        )
    empty = [e + 1 for e in range(num_exits) if not m[e].any()]
    if empty:
        raise ValueError(f"exit_masks marks no coordinate for exit(s) {empty}")
    return m.clone()

