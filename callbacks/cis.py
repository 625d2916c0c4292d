"""Cooperative-inference (CIS) accuracy of an early-exit network on a tree of nodes (Fed-CIS, thesis ch.5).

Evaluation procedure (spec ``thesis_ch4_ch5_upgapl_fedcis.md`` §2.9, the released code's ``validate_thinned``):

1. Every node with local arrivals (the leaves in the thesis) receives the **whole** evaluation set; each of the
   ``n`` points carries mass ``lambda^l_i / n``.
2. Node ``i`` scores the points with its largest exit ``E_i``: ``"norm_entropy"`` = entropy of the softmax divided by
   ``log C`` (in ``[0, 1]``), or ``"max_softmax"`` = minus the largest softmax probability. Lower = easier.
3. From the leaves up, each node sorts the mass it holds (its own arrivals plus what its children forwarded) from
   easy to hard and serves it until the served mass reaches its serving rate
   ``lambda^s_i = lambda^l_i + sum_children lambda^t_j - lambda^t_i``; the point at the boundary is split
   fractionally; a root serves everything it receives.
4. The unserved mass goes to the parent.
5. Node accuracy = served-mass-weighted accuracy of its exit ``E_i`` on what it served; overall CIS accuracy =
   ``sum_i acc_i * mass_i / sum_i mass_i`` = correct mass / total arrival rate.

Decisions: ties in the score are broken by the point's index (stable sort), which only matters at the boundary;
several validation dataloaders are pooled; the callback uses the data this process saw (no cross-rank gather).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_fedhet.cis import CISTopology

__all__ = ["cis_accuracy", "cis_evaluate", "cis_evaluate_scores", "exit_confidence", "CISResult", "CISAccuracy"]

_CONFIDENCE = ("norm_entropy", "max_softmax")


def exit_confidence(logits: Tensor, confidence: str = "norm_entropy") -> Tensor:
    """Difficulty score per sample from one exit's logits ``[n, C]`` (``C >= 2``) -> ``[n]`` float64, lower = easier.

    ``"norm_entropy"``: ``-sum_c p_c log p_c / log C`` with ``p = softmax(logits)``; ``"max_softmax"``: ``-max_c p_c``.
    """
    if confidence not in _CONFIDENCE:
        raise ValueError(f"confidence must be one of {list(_CONFIDENCE)}, got {confidence!r}")
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"exit logits must have shape [n, C] with C >= 2, got {tuple(logits.shape)}")
    p = torch.softmax(logits.detach().double(), dim=1)
    if confidence == "max_softmax":
        return -p.max(dim=1).values
    return torch.special.entr(p).sum(dim=1) / math.log(logits.shape[1])


@dataclass
class CISResult:
    """Outcome of :func:`cis_evaluate`.

    Attributes:
        accuracy: overall CIS accuracy (correct served mass / total served mass).
        node_accuracy: ``[N]`` float64, accuracy of each node's exit on what it served (``nan`` if it served nothing).
        node_mass: ``[N]`` float64, mass served by each node (equals ``topology.node_serving_rates()``).
        exit_accuracy: ``[E]`` float64, plain accuracy of each exit on the whole evaluation set (for reference).
    """

    accuracy: float
    node_accuracy: Tensor
    node_mass: Tensor
    exit_accuracy: Tensor


def _check_inputs(topology: CISTopology, num_exits: int, n: int) -> None:
    if not isinstance(topology, CISTopology):
        raise ValueError(f"topology must be a CISTopology, got {type(topology).__name__}")
    if num_exits < topology.num_exits:
        raise ValueError(f"exit_logits must hold at least the topology's {topology.num_exits} exits, got {num_exits}")
    if n == 0:
        raise ValueError("exit_logits and labels must hold at least one sample")


def cis_evaluate_scores(topology: CISTopology, scores: Tensor, correct: Tensor) -> CISResult:
    """The serving simulation on precomputed per-exit scores and correctness.

    Args:
        topology: the CIS tree and its rates.
        scores: ``[E', n]`` difficulty scores (lower = easier), ``E' >= topology.num_exits``; exit ``e`` is row ``e-1``.
        correct: ``[E', n]`` bool/0-1, whether exit ``e`` classifies point ``j`` correctly.
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    correct = torch.as_tensor(correct).to(torch.float64)
    if scores.dim() != 2 or scores.shape != correct.shape:
        raise ValueError(
            f"scores and correct must both be [E, n], got {tuple(scores.shape)} and {tuple(correct.shape)}"
        )
    num_exits, n = scores.shape
    _check_inputs(topology, num_exits, n)
    served_rate = topology.node_serving_rates()
    forward: dict[int, Tensor] = {}
    node_mass = torch.zeros(topology.num_nodes, dtype=torch.float64)
    node_correct = torch.zeros(topology.num_nodes, dtype=torch.float64)
    for i in topology.order:  # leaves first
        m = torch.full((n,), float(topology.arrival[i]) / n, dtype=torch.float64)
        for j in topology.children[i]:
            m = m + forward.pop(j)
        e = topology.max_exit[i]
        if topology.parent[i] == -1:
            served = m
        else:
            order = torch.argsort(scores[e - 1], stable=True)
            ms = m[order]
            before = torch.cumsum(ms, 0) - ms
            take = torch.minimum(ms, (float(served_rate[i]) - before).clamp(min=0.0))
            served = torch.zeros_like(m)
            served[order] = take
        forward[i] = m - served
        node_mass[i] = served.sum()
        node_correct[i] = (served * correct[e - 1]).sum()
    node_acc = torch.where(node_mass > 0, node_correct / node_mass.clamp(min=1e-300), torch.nan)
    return CISResult(
        accuracy=float(node_correct.sum() / node_mass.sum()),
        node_accuracy=node_acc,
        node_mass=node_mass,
        exit_accuracy=correct.mean(dim=1),
    )


def _scores_correct(exit_logits, labels: Tensor, confidence: str) -> tuple[Tensor, Tensor]:
    if isinstance(exit_logits, Tensor):
        if exit_logits.dim() != 3:
            raise ValueError(
                f"exit_logits must be a list of [n, C] tensors or one [E, n, C] tensor, "
                f"got shape {tuple(exit_logits.shape)}"
            )
        exit_logits = list(exit_logits)
    exit_logits = list(exit_logits)
    labels = torch.as_tensor(labels).reshape(-1)
    if not exit_logits:
        raise ValueError("exit_logits must hold at least one exit")
    for k, lg in enumerate(exit_logits):
        if lg.dim() != 2 or lg.shape[0] != labels.shape[0]:
            raise ValueError(
                f"exit_logits[{k}] must have shape [n, C] with n = len(labels) = {labels.shape[0]}, "
                f"got {tuple(lg.shape)}"
            )
    labels = labels.to(exit_logits[0].device)
    scores = torch.stack([exit_confidence(lg, confidence) for lg in exit_logits]).cpu()
    correct = torch.stack([lg.detach().argmax(dim=1) == labels for lg in exit_logits]).cpu()
    return scores, correct


def cis_evaluate(
    topology: CISTopology,
    exit_logits: Sequence[Tensor] | Tensor,
    labels: Tensor,
    confidence: str = "norm_entropy",
) -> CISResult:
    """CIS accuracy with per-node detail.

    Args:
        topology: the CIS tree and its rates (:class:`~lightning_fedhet.cis.CISTopology`).
        exit_logits: per exit (shallow first) logits ``[n, C]`` on the evaluation set, as returned by an
            ``EarlyExitNet`` (a list, or one ``[E, n, C]`` tensor); at least ``topology.num_exits`` exits.
        labels: ``[n]`` integer class labels.
        confidence: ``"norm_entropy"`` (thesis/code default) or ``"max_softmax"``.
    """
    scores, correct = _scores_correct(exit_logits, labels, confidence)
    return cis_evaluate_scores(topology, scores, correct)


def cis_accuracy(
    topology: CISTopology,
    exit_logits: Sequence[Tensor] | Tensor,
    labels: Tensor,
    confidence: str = "norm_entropy",
) -> float:
    """Overall cooperative-inference accuracy (see module docstring); arguments as :func:`cis_evaluate`."""
    return cis_evaluate(topology, exit_logits, labels, confidence).accuracy


class CISAccuracy(Callback):
    """Logs the CIS accuracy of the (global) early-exit model at the end of validation and test.

    Logged names: ``cis_acc`` and ``cis_acc_node{i}`` (nodes that served something) after validation, and
    ``test_cis_acc`` / ``test_cis_acc_node{i}`` after ``trainer.test``; ``name`` replaces ``cis_acc`` in each, so
    several instances can score one model under different topologies (e.g. every serving setting from one run whose
    training does not depend on the setting). Skipped during the sanity check.

    Per batch it reads ``outputs["exit_logits"]`` (and ``outputs["labels"]``) when ``validation_step``/``test_step``
    returns them (``EarlyExitClassifier`` does); otherwise it runs ``pl_module(x)`` on ``batch = (x, y, ...)``, which
    must return the list of exit logits. Only the per-exit scores and correctness (``[E, n]``) are kept, not the
    logits.

    Args:
        topology: the CIS tree and rates.
        confidence: ``"norm_entropy"`` or ``"max_softmax"``.
        log_per_node: also log the per-node accuracies.
        prog_bar: show ``cis_acc`` in the progress bar.
        name: the logged name in place of ``cis_acc``; instances in one Trainer need distinct names.
    """

    def __init__(
        self,
        topology: CISTopology,
        confidence: str = "norm_entropy",
        log_per_node: bool = True,
        prog_bar: bool = False,
        name: str = "cis_acc",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(topology, CISTopology):
            raise ValueError(f"topology must be a CISTopology, got {type(topology).__name__}")
        if confidence not in _CONFIDENCE:
            raise ValueError(f"confidence must be one of {list(_CONFIDENCE)}, got {confidence!r}")
        self.topology = topology
        self.confidence = confidence
        self.log_per_node = log_per_node
        self.prog_bar = prog_bar
        self.name = name
        self._scores: list[Tensor] = []
        self._correct: list[Tensor] = []
        self.last_result: CISResult | None = None

    @property
    @override
    def state_key(self) -> str:
        # Lightning keys a callback's checkpoint state by this; distinct per name, so instances may coexist
        return self._generate_state_key(name=self.name)

    def _reset(self) -> None:
        self._scores, self._correct = [], []

    def _collect(self, pl_module: pl.LightningModule, outputs, batch) -> None:
        if isinstance(outputs, dict) and "exit_logits" in outputs:
            logits = outputs["exit_logits"]
            labels = outputs["labels"] if "labels" in outputs else batch[1]
        else:
            x, labels = batch[0], batch[1]
            with torch.no_grad():
                logits = pl_module(x)
        s, c = _scores_correct(logits, labels, self.confidence)
        self._scores.append(s)
        self._correct.append(c)

    def _finish(self, pl_module: pl.LightningModule, prefix: str) -> None:
        if not self._scores:
            return
        result = cis_evaluate_scores(self.topology, torch.cat(self._scores, 1), torch.cat(self._correct, 1))
        self._reset()
        self.last_result = result
        pl_module.log(f"{prefix}{self.name}", result.accuracy, prog_bar=self.prog_bar)
        if self.log_per_node:
            for i, acc in enumerate(result.node_accuracy.tolist()):
                if not math.isnan(acc):
                    pl_module.log(f"{prefix}{self.name}_node{i}", acc)

    # validation
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._collect(pl_module, outputs, batch)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            self._reset()
            return
        self._finish(pl_module, "")

    # test
    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(pl_module, outputs, batch)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(pl_module, "test_")
