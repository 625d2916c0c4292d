"""Fed-CIS's base of the update and its exit heads: the released code's aggregation beside Algorithm 6's
(``FedCIS(aggregation_base=..., aggregate_heads=...)``; the rule: :mod:`lightning_fedhet.algorithms.fedcis`), and
the checks and coordinate masks it needs.

Decision 2 of the rule (the thesis against the released code). ``"literal"`` (default) is Algorithm 6, line 11, as
the rule's docstring writes it: deltas w.r.t. the broadcast ``w_t``, added to ``w_t``. ``"root_local"`` is the
released code, whose global model *is* the root node's model object, trained locally before the aggregation reads
it::

    w_{t+1} = w_r + server_lr * sum_{(c, e) in N_t, c != r}  a_c * M_e ⊙ (w_c - w_r),     w_r = w_t + delta_r

with ``r`` the root, ``a_c`` the pair weight of line 11 and ``M_e`` the 0/1 mask of the coordinates of exit ``e``'s
sub-model (the blocks up to exit ``e`` and exit ``e``'s own head, parameters and BatchNorm statistics: the code's loop
over ``blocks[:e_block]`` and ``classifiers[e_block - 1]``), given as ``exit_masks``
(:func:`~lightning_fedhet.algorithms.fedcis_exits.exit_masks` builds them from a module). The root's own term vanishes
(``w_r - w_r``); coordinates no arriving non-root node trains are the root's model as is. When the root's update did not
arrive (partial participation, a lost upload; the code always has it) ``w_r = w_t``. In delta form, as computed here
(one stored ``delta_r`` and one running sum): ``w_{t+1} = w_t + delta_r + server_lr * (sum_c a_c M_{e_c} ⊙ delta_c -
sum_e A_e M_e ⊙ delta_r)``, ``A_e = sum_{c != r, e_c = e} a_c``. It needs a single root. This is what the released
``aggregate()`` *means* to do; as released (commit 7c7f1bc) it never writes the aggregated exit heads back (it
accumulates them in ``classifiers[e_block - 1]`` but applies ``classifiers[block]`` for the blocks 3 and 9, which hold
nothing), so in the authors' runs every head stays the root's own. Here the heads are aggregated; the blocks agree with
the released code within 9e-16 (``scripts/referee/fedcis.py``), the heads do not.

*Exit heads* (``aggregate_heads``). Algorithm 6, line 11, aggregates each node's whole trained sub-model, its
exit's head included: ``aggregate_heads=True`` (default), with either base. The released ``aggregate()`` (commit
7c7f1bc) aggregates no head at all, as just said: ``aggregate_heads=False`` does what it does. Every coordinate of
``head_mask`` (bool ``[d]``, the parameters of every exit's head, e.g. ``exit_masks(module, [[h] for h in
net.heads]).any(0)``) is left out of every node's term, so the global heads are:

- ``"root_local"``: the root's own, ``w_{t+1} = w_t + delta_r`` on the head coordinates (the released code, whose
  global model *is* the root's and whose ``broadcast()`` then copies those heads to every node). At ``p = 0`` the
  root trains its deepest exit only, so the heads of the other exits keep their initial values for the whole run
  and every other node's trained head is dropped each round;
- ``"literal"``: unchanged, ``w_{t+1} = w_t`` on the head coordinates (the released ``aggregate()`` applied to a
  global model kept apart from the root's: its heads never move).

The blocks are aggregated exactly as with the heads (``exit_masks`` and ``head_mask`` may overlap only on head
coordinates, which are then dropped). ``scripts/referee/fedcis.py`` compares both bases with the released
``aggregate()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedhet._checks import check_bool, check_choice
from lightning_fedhet.cis import CISTopology

__all__ = ["AGGREGATION_BASES", "check_aggregation_base", "check_head_mask", "check_mask_widths", "term_masks"]

#: ``FedCIS(aggregation_base=...)``: Algorithm 6's (deltas added to ``w_t``) or the released code's (to the root's)
AGGREGATION_BASES = ("literal", "root_local")


def check_aggregation_base(aggregation_base: str, exit_masks: Tensor | None, topology: CISTopology) -> None:
    """A known base, with ``exit_masks`` and a single root where ``"root_local"`` needs them and no masks elsewhere
    (the masks' own checks: :func:`~lightning_fedhet.algorithms.fedcis_exits.check_exit_masks`)."""
    check_choice(aggregation_base, "aggregation_base", AGGREGATION_BASES)
    if aggregation_base == "root_local":
        if exit_masks is None:
            raise ValueError(
                "aggregation_base='root_local' needs exit_masks (bool [E, d]: the coordinates of each exit's "
                "sub-model), e.g. fedcis.exit_masks(module, exit_modules)"
            )
        if len(topology.roots) != 1:
            raise ValueError(
                f"aggregation_base='root_local' needs a tree with one root, got roots {list(topology.roots)}"
            )
    elif exit_masks is not None:
        raise ValueError("exit_masks only applies to aggregation_base='root_local'")


def check_head_mask(aggregate_heads: bool, head_mask: Tensor | None) -> Tensor | None:
    """A copy of ``head_mask`` as a checked bool ``[d]`` tensor marking some coordinate where
    ``aggregate_heads=False`` needs it, ``None`` where the heads are aggregated (a mask then is refused)."""
    check_bool(aggregate_heads, "aggregate_heads")
    if not aggregate_heads:
        if head_mask is None:
            raise ValueError(
                "aggregate_heads=False needs head_mask (bool [d]: the coordinates of the exits' heads), e.g. "
                "fedcis.exit_masks(module, [[head] for head in net.heads]).any(0)"
            )
        head_mask = torch.as_tensor(head_mask)
        if head_mask.dtype != torch.bool or head_mask.dim() != 1 or not head_mask.any():
            raise ValueError(
                f"head_mask must be a bool tensor of shape [d] marking at least one coordinate, got dtype "
                f"{head_mask.dtype}, shape {tuple(head_mask.shape)}"
            )
        head_mask = head_mask.clone()
    elif head_mask is not None:
        raise ValueError("head_mask only applies to aggregate_heads=False")
    return head_mask


def check_mask_widths(exit_masks: Tensor | None, head_mask: Tensor | None, d: int) -> None:
    """Each given mask has one entry per coordinate of the flat parameter vector (``d`` of them)."""
    if exit_masks is not None and exit_masks.shape[1] != d:
        raise ValueError(f"exit_masks has {exit_masks.shape[1]} columns but the parameter vector has d = {d} entries")
    if head_mask is not None and head_mask.numel() != d:
        raise ValueError(f"head_mask has {head_mask.numel()} entries but the parameter vector has d = {d} entries")


def term_masks(exit_masks: Tensor | None, head_mask: Tensor | None) -> Tensor | None:
    """The coordinates a node's term may move: its exit's sub-model ``M_e`` (``"root_local"``), without the heads
    if they are not aggregated; ``None`` under ``"literal"``. The root's base (its whole delta) is not masked."""
    if head_mask is not None and exit_masks is not None:
        return exit_masks & ~head_mask
    return exit_masks
