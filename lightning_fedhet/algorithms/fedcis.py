"""Fed-CIS: federated training of an early-exit network for a cooperative inference system (thesis ch. 5,
Kaplan, Rodio et al. 2024; Algorithm 6, App. D and the released code).

The nodes of a :class:`~lightning_fedhet.cis.CISTopology` are the clients (client ``i`` = node ``i``). Node ``i``
holds exits ``1..E_i``; each round every selected node trains **one** exit ``e``, drawn with probability
``p_{i,e}`` (Algorithm 6, line 4), on the loss of that exit only (line 9). The server then applies line 11::

    w_{t+1} = w_t + server_lr * sum_{(i, e) in N_t}  Lt_e * |D_i| / |D_{e,p}| * (1 / p_{i,e}) * delta_i

with ``delta_i = w_i^{(t,K)} - w_t``, ``Lt = Lambda-tilde`` the per-exit aggregation weights,
``C_e = {i : p_{i,e} > 0}`` and ``|D_{e,p}| = sum_{i in C_e} |D_i|`` (all nodes that *may* train exit ``e``, not
only this round's). ``Lt`` (``lambda_tilde``):

================ =================================================================== ===========================
``"serving_rate"`` ``Lambda_e / sum Lambda`` (serving rates of the topology)            "Serving Rate", §5.3.4
``"equal"``        ``1 / E``                                                         "Equal Weight" baseline
``"flops"``        ``F_e / sum F`` (``F_e`` = cost of exit ``e``, ``flops=``)            "FLOPS Prop" baseline
``"balanced"``     ``(Lambda_e / sum Lambda + o_e) / 2``, ``o_e`` normalised,        "Balanced Adj" (code's
                   ``o_e ∝ 1 / (sigma2_e * sum_{i in C_e} (|D_i| / |D_{e,p}|)^2)``     strategy 11), §2.4
tensor ``[E]``     given values, normalised to sum 1 unless ``normalize=False``
================ =================================================================== ===========================

Every named strategy sums to 1 (the released code normalises every ``Lt``).

**Decisions on the thesis-vs-code discrepancies**:

1. *Inverse vs direct probability.* Default ``prob_weighting="inverse"``: ``÷ p_{i,e}`` as in Algorithm 6 and
   (D.11), which makes the update unbiased for the surrogate objective. ``"direct"`` multiplies by ``p_{i,e}``
   like the released code (``lambda_tilde_e * c_ds_scale_factor * p_ce``). Identical when ``p = 0``.
2. *Base of the update* (``aggregation_base``). ``"literal"`` (default) is Algorithm 6, line 11: pseudo-gradients
   are taken w.r.t. the broadcast global model ``w_t`` and added to ``w_t`` (the formula above). Parameters used
   only by the deepest exit then move with total weight ``server_lr * Lt_E`` per round (0.05 under Serving Rate at
   80-15-5), and parameters used by exits ``e..E`` only with ``sum_{e' >= e} Lt_e'``; nothing is renormalised per
   parameter (that would not be Algorithm 6). ``"root_local"`` (the released code's base: the root's locally
   trained model) and *exit heads* (``aggregate_heads=False``: the released ``aggregate()``, which aggregates no
   head), with the masks they need, are given in :mod:`lightning_fedhet.algorithms.fedcis_bases`.
3. *Meaning of p.* A scalar ``p`` is the thesis's parametrisation (§5.4, App. G: "the probability that a given
   client will train **each** of its smaller exits"): ``p_{i,e} = p`` for ``e < E_i`` and
   ``p_{i,E_i} = 1 - (E_i - 1) p`` (:func:`sampling_matrix`), so ``0 <= p <= 1 / (max_i E_i - 1)``. Any other
   scheme is an explicit ``[N, E]`` matrix; the released code's ``--sampled-probability-per-layer a-b`` (total
   probability ``a``/``b`` of training a smaller exit for nodes with ``E_i = 2``/``3``, split uniformly) is
   :func:`code_sampling_matrix` ``(topology, {2: a, 3: b})``. Its only ``p > 0`` scripts use ``0.4-0.8``, i.e.
   ``p = 0.4`` per smaller exit in the thesis's notation, while the thesis labels those results "p = 0.2": we do
   not resolve that label.
4. *|S_i| vs |D_i|.* ``|D_i|`` (Algorithm 6, D.11, D.53 and the code), the ``client_sizes`` given to
   :meth:`setup` (the server passes every client's sample count); when that is ``None`` (another runtime, unit
   tests) the topology's ``data_fraction`` is used (only ratios of sizes enter the rule). ``|D_{e,p}|`` is over
   ``C_e`` as defined above, which is exactly the code's ``e_ds_size`` for the experiments' parametrisation.
5. *Projection and server step.* No projection (the set ``W`` of the analysis is never specified; the code has
   none); ``server_lr`` (``eta_s``) is free, default 1 as in the code.
6. *FLOPS Prop.* and 7. *Balanced Adj.*: the two strategies' choices are given where they are computed,
   :mod:`lightning_fedhet.algorithms.fedcis_weights`.
8. *Partial participation and losses.* ``p`` is the exit distribution **given** that node ``i`` is selected
   (``select`` keeps every available node by default; the thesis runs use full participation). With
   ``correct_participation=True`` the weight is also divided by ``RoundContext.participation_probs[i]``, so the
   pair probability of Algorithm 6 line 4 is ``q_i p_{i,e}``. A lost or rejected update just contributes nothing
   (no renormalisation), as in line 11.
9. *Sub-models and BatchNorm.* FedCIS does not mask coordinates: it relies on the client leaving the parameters
   deeper than its trained exit untouched (zero delta), which :class:`~lightning_fedhet.EarlyExitClassifier` does
   (its forward stops at exit ``e``). BatchNorm running means/variances (and ``num_batches_tracked``) are buffers,
   which the server averages, not the rule (the rule's ``1/p`` weights need not sum to one and would drive a
   running variance negative). They are averaged **per sub-model**, like the parameters: each entry over the
   arrived nodes whose trained exit holds it (those that changed it), with sample weights ``|D_i|`` normalised over
   those nodes (``buffers_per_submodel``); a node that trained a shallower exit does not pull a deeper exit's
   statistics towards the old global values.

Exit draws happen in :meth:`select` with the round's generator (one uniform per node, for every node, so the draws
are a pure function of the seed and the round) and reach the client through :meth:`client_config`
(``{"train_exit": e}``). A strategy-level ``selection=`` bypasses :meth:`select`, which :meth:`open_round` reports.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_bool, check_choice, check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares

# the rule's three other ideas, in files of their own; re-exported here, where they were first published
from lightning_fedhet.algorithms.fedcis_bases import (
    AGGREGATION_BASES,  # noqa: F401 (re-exported: fedcis.AGGREGATION_BASES stays importable)
    check_aggregation_base,
    check_head_mask,
    check_mask_widths,
    term_masks,
)
from lightning_fedhet.algorithms.fedcis_exits import (
    check_exit_masks,
    check_p_matrix,
    code_sampling_matrix,
    exit_masks,
    sampling_matrix,
)
from lightning_fedhet.algorithms.fedcis_weights import (
    BALANCED_SIGMA2,
    FLOPS_SCHEDULES,
    FLOPS_WARMUP_RATE,
    LAMBDA_TILDE_STRATEGIES,
    PROB_WEIGHTINGS,
    TABLE_D1,
    check_exit_weights,
    lambda_tilde_weights,
    pair_weight_matrix,
)
from lightning_fedhet.cis import CISTopology

__all__ = [
    "FedCIS",
    "exit_masks",
    "sampling_matrix",
    "code_sampling_matrix",
    "lambda_tilde_weights",
    "TABLE_D1",
    "BALANCED_SIGMA2",
    "LAMBDA_TILDE_STRATEGIES",
    "FLOPS_SCHEDULES",
    "FLOPS_WARMUP_RATE",
]


class FedCIS(Algorithm):
    """Fed-CIS server rule (Algorithm 6): each node trains one sampled exit; weights ``Lt_e |D_i|/|D_{e,p}| / p_ie``.

    Args:
        topology: the CIS tree; its nodes are the clients (``num_clients`` must equal ``topology.num_nodes``) and
            ``topology.max_exit`` gives ``E_i``.
        lambda_tilde: ``"serving_rate"`` (default), ``"equal"``, ``"flops"``, ``"balanced"`` or a tensor of ``E``
            non-negative weights (see module docstring).
        p: scalar ``p`` of the thesis's parametrisation (probability of training **each** smaller exit; 0 = every
            node trains its largest exit), or an ``[N, E]`` matrix of ``p_{i,e}`` whose rows sum to 1 and are 0
            beyond ``E_i`` (:func:`code_sampling_matrix` builds the released code's convention).
        server_lr: ``eta_s > 0``.
        flops: per-exit cost ``[E]`` (> 0), required by ``lambda_tilde="flops"``.
        flops_schedule: ``"static"`` (thesis) or ``"warmup"`` (released code), for ``lambda_tilde="flops"``.
        grad_variance: ``sigma2_e`` per exit for ``"balanced"`` (numbers, or ``"cifar10"``/``"cifar100"`` for the
            code's constants); default ``"cifar10"`` when ``E = 3``.
        prob_weighting: ``"inverse"`` (``÷ p_{i,e}``, thesis, default) or ``"direct"`` (``× p_{i,e}``, code).
        normalize: normalise an explicit ``lambda_tilde`` tensor to sum 1 (named strategies always are).
        correct_participation: also divide by the node's selection probability
            (``RoundContext.participation_probs``); only useful under partial participation.
        aggregation_base: ``"literal"`` (Algorithm 6: deltas added to ``w_t``, default) or ``"root_local"`` (the
            released code's base: deltas relative to the root's trained model, added to it, heads included, which
            the released code means but does not do; :mod:`~lightning_fedhet.algorithms.fedcis_bases`).
        exit_masks: bool ``[E, d]``, coordinate ``j`` of the flat vector belongs to exit ``e``'s sub-model; required
            by ``"root_local"`` (and only used there), checked against ``d`` at :meth:`setup`. See
            :func:`exit_masks`.
        aggregate_heads: ``True`` (Algorithm 6 as written, default): the exits' heads are aggregated like the rest of
            each sub-model; ``False`` (the released code): they are not
            (:mod:`~lightning_fedhet.algorithms.fedcis_bases`).
        head_mask: bool ``[d]``, coordinate ``j`` belongs to an exit's head; required by ``aggregate_heads=False``
            (and only used there), checked against ``d`` at :meth:`setup`.

    Attributes:
        p_matrix: ``[N, E]`` float64 exit-sampling probabilities.
        exits: int64 ``[N]``, exit (1-based) each node draws in the current round (0 before the first draw).
        last_exits: ``{client: exit}`` of the updates absorbed in the last closed round.
        last_lambda_tilde: ``[E]`` weights used in the last opened round.

    Example (7-node tree, 80-15-5: ``Lt = (0.8, 0.15, 0.05)``)::

        algo = FedCIS(CISTopology.preset("7-node", "80-15-5"), lambda_tilde="serving_rate", p=0.0)
        strategy = FedHetStrategy(algorithm=algo, local_steps=10)
        # with an EarlyExitClassifier, node i trains exit E_i each round
    """

    #: FedCIS's select() draws each node's exit; a separate strategy-level selection would bypass the draw.
    selects_clients: ClassVar[bool] = True
    sends_client_config: ClassVar[bool] = True
    shares_rounds: ClassVar[bool] = True
    #: each node trains one exit's sub-model: its buffers are averaged over the nodes that hold them
    buffers_per_submodel: ClassVar[bool] = True

    def __init__(
        self,
        topology: CISTopology,
        lambda_tilde: str | Sequence[float] | Tensor = "serving_rate",
        p: float | Sequence[Sequence[float]] | Tensor = 0.0,
        server_lr: float = 1.0,
        flops: Sequence[float] | Tensor | None = None,
        flops_schedule: str = "static",
        grad_variance: str | Sequence[float] | Tensor | None = None,
        prob_weighting: str = "inverse",
        normalize: bool = True,
        correct_participation: bool = False,
        aggregation_base: str = "literal",
        exit_masks: Tensor | None = None,
        aggregate_heads: bool = True,
        head_mask: Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(topology, CISTopology):
            raise ValueError(f"topology must be a CISTopology, got {type(topology).__name__}")
        server_lr = check_real(server_lr, "server_lr", 0.0, low_open=True, high_open=True)
        check_choice(prob_weighting, "prob_weighting", PROB_WEIGHTINGS)
        check_bool(normalize, "normalize")
        check_bool(correct_participation, "correct_participation")
        check_choice(flops_schedule, "flops_schedule", FLOPS_SCHEDULES)
        check_aggregation_base(aggregation_base, exit_masks, topology)
        head_mask = check_head_mask(aggregate_heads, head_mask)
        self.aggregate_heads = bool(aggregate_heads)
        self.head_mask = head_mask
        self.topology = topology
        self.aggregation_base = aggregation_base
        self.exit_masks = None if exit_masks is None else check_exit_masks(exit_masks, topology.num_exits)
        self._term_masks = self.exit_masks  # setup() takes the heads out where they are not aggregated
        self.num_exits = topology.num_exits
        self.server_lr = float(server_lr)
        self.prob_weighting = prob_weighting
        self.flops_schedule = flops_schedule
        self.normalize = bool(normalize)
        self.correct_participation = bool(correct_participation)

        if isinstance(p, numbers.Real) and not isinstance(p, bool):
            self.p = float(p)
            self.p_matrix = sampling_matrix(topology, p)
        elif isinstance(p, bool):
            raise ValueError(f"p must be a number or an [N, E] matrix, got {p!r}")
        else:
            self.p = None
            self.p_matrix = check_p_matrix(p, topology)

        self.flops = None if flops is None else check_exit_weights("flops", flops, self.num_exits, positive=True)
        self.grad_variance = grad_variance
        if isinstance(lambda_tilde, str):
            if lambda_tilde not in LAMBDA_TILDE_STRATEGIES:
                raise ValueError(
                    f"lambda_tilde must be one of {LAMBDA_TILDE_STRATEGIES} or a tensor of {self.num_exits} weights, "
                    f"got {lambda_tilde!r}"
                )
            self.lambda_tilde = lambda_tilde
            self._fixed_lt = None
            # validate the strategy's own arguments now (sizes are checked again once known)
            self._lambda_tilde_at(0, None)
        else:
            lt = check_exit_weights("lambda_tilde", lambda_tilde, self.num_exits)
            self.lambda_tilde = "custom"
            self._fixed_lt = lt / lt.sum() if self.normalize else lt

        self.exits = torch.zeros(topology.num_nodes, dtype=torch.int64)
        self._draw_round: int | None = None
        self._coef: Tensor | None = None
        self._sum: WeightedSum | None = None
        self._root_delta: Tensor | None = None
        self.last_exits: dict[int, int] = {}
        self.last_lambda_tilde: Tensor | None = None

    # ------------------------------------------------------------------ weights
    def hparams(self) -> dict:
        lt = self.lambda_tilde if self._fixed_lt is None else [round(float(v), 6) for v in self._fixed_lt]
        return {
            "lambda_tilde": lt,
            "p": self.p if self.p is not None else "matrix",
            "server_lr": self.server_lr,
            "prob_weighting": self.prob_weighting,
            "flops_schedule": self.flops_schedule,
            "correct_participation": self.correct_participation,
            "aggregation_base": self.aggregation_base,
            "aggregate_heads": self.aggregate_heads,
        }

    def _sizes(self) -> Tensor:
        # setup() checked client_sizes (N = num_nodes entries, integers >= 0)
        if self.client_sizes is not None:
            return self.client_sizes.to(torch.float64)
        return self.topology.data_fraction.clone()

    def _lambda_tilde_at(self, round: int, sizes: Tensor | None) -> Tensor:
        if self._fixed_lt is not None:
            return self._fixed_lt.clone()
        return lambda_tilde_weights(
            self.lambda_tilde,
            self.topology,
            p_matrix=self.p_matrix,
            sizes=sizes,
            flops=self.flops,
            flops_schedule=self.flops_schedule,
            grad_variance=self.grad_variance,
            round=round,
        )

    def lambda_tilde_at(self, round: int = 0) -> Tensor:
        """``Lt`` (shape ``[E]``) used in round ``round`` with the current ``client_sizes``."""
        return self._lambda_tilde_at(round, self._sizes())

    def exit_data_sizes(self) -> Tensor:
        """``|D_{e,p}| = sum_{i : p_{i,e} > 0} |D_i|`` per exit, shape ``[E]`` (float64)."""
        return (self._sizes()[:, None] * (self.p_matrix > 0)).sum(0)

    def pair_weights(self, round: int = 0) -> Tensor:
        """``[N, E]``: weight ``Lt_e |D_i| / |D_{e,p}| * (1/p_{i,e} or p_{i,e})`` (without ``server_lr``); 0 where
        ``p_{i,e} = 0``."""
        sizes = self._sizes()
        return pair_weight_matrix(self._lambda_tilde_at(round, sizes), sizes, self.p_matrix, self.prob_weighting)

    # ------------------------------------------------------------------ round
    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        if int(num_clients) != self.topology.num_nodes:
            raise ValueError(
                f"num_clients={num_clients} but the topology has {self.topology.num_nodes} nodes (client i = node i)"
            )
        check_mask_widths(self.exit_masks, self.head_mask, init_params.numel())
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self.exit_masks is not None:
            self.exit_masks = self.exit_masks.to(self.params.device)
        if self.head_mask is not None:
            self.head_mask = self.head_mask.to(self.params.device)
        self._term_masks = term_masks(self.exit_masks, self.head_mask)  # M_e, less the heads where not aggregated
        self.exits = torch.zeros(self.num_clients, dtype=torch.int64)
        self._draw_round = None

    def select(self, round: int, available: Tensor, rng: np.random.Generator) -> Tensor:
        """Keep every available node and draw each node's exit ``e ~ p_{i,.}`` (one uniform per node, all nodes)."""
        u = np.asarray(rng.random(self.topology.num_nodes), dtype=np.float64)
        cum = np.cumsum(self.p_matrix.numpy(), axis=1)
        idx = (u[:, None] >= cum).sum(axis=1)  # first e with cum_e > u (0-based)
        last_pos = self.p_matrix.shape[1] - 1 - np.argmax((self.p_matrix.numpy() > 0)[:, ::-1], axis=1)
        idx = np.minimum(idx, last_pos)  # rounding guard: cum[-1] may fall a hair below 1
        self.exits = torch.from_numpy(idx.astype(np.int64) + 1)
        self._draw_round = int(round)
        return torch.as_tensor(available).clone().to(torch.bool)

    def selection_probs(self, round: int) -> Tensor:
        """Fed-CIS keeps every available node: ``P(selected | available) = 1``."""
        return torch.ones(self.num_clients, dtype=torch.float64)

    def client_config(self, client: int) -> dict:
        if self._draw_round is None:
            raise RuntimeError("FedCIS.client_config() called before select() drew this round's exits")
        return {"train_exit": int(self.exits[client])}

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        if self._draw_round != int(round):
            raise RuntimeError(
                f"FedCIS draws each node's exit in select(), but select() was not called for round {round}: do not "
                "pass a strategy-level selection= with FedCIS (it keeps every available node)"
            )
        weights = self.pair_weights(round)
        self.last_lambda_tilde = self._lambda_tilde_at(round, self._sizes())
        coef = weights[torch.arange(self.num_clients), self.exits - 1]
        if self.correct_participation:
            probs = None if ctx is None else ctx.participation_probs
            coef = coef / self._context_probs(probs, "participation_probs", "correct_participation=True")
        self._coef = coef
        self._sum = WeightedSum(self.params)
        self._root_delta = None

    @property
    def root(self) -> int:
        """The root node (the code's node 0, whose model the ``"root_local"`` base aliases)."""
        return self.topology.roots[0]

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._sum, self._sum)
        w = float(self._coef[client])
        if self.aggregation_base == "literal":
            if self.head_mask is not None:  # aggregate_heads=False: the heads stay w_t
                delta = torch.where(self.head_mask, 0.0, delta.to(self.params))
            self._sum.add(client, delta, w)
            return
        if client == self.root:
            # w_r - w_r = 0: the root's pair term vanishes; its delta is the base (kept until close_round)
            self._root_delta = delta.to(self.params, copy=True)
            self._sum.add(client, delta, 1.0, coef=0.0)
            return
        e = int(self.exits[client])
        mask = self._term_masks[e - 1]
        self._sum.add(client, torch.where(mask, delta.to(self.params), 0.0), w)  # a_c M_e ⊙ delta_c

    def round_shares(self) -> RoundShares:
        shares = self._sum.shares()
        if self.aggregation_base == "root_local":
            # the root's delta is the base: zero on the processes that did not train the root, so the sum is it
            if self._root_delta is None:
                self._root_delta = torch.zeros_like(self.params)
            shares.sums.append(self._root_delta)
        return shares

    def _exit_coefficients(self) -> list[float]:
        """``A_e = sum_{c != root, exit e} a_c`` over the round's non-root arrivals, in arrival order."""
        coef = [0.0] * self.num_exits
        for client, w in self._sum.weights.items():
            if client != self.root:
                coef[int(self.exits[client]) - 1] += w
        return coef

    def close_round(self) -> Tensor:
        if self._sum is None:
            raise RuntimeError("close_round() called without open_round()")
        self.last_weights = dict(self._sum.weights)
        self.last_exits = {c: int(self.exits[c]) for c in self._sum}
        if len(self._sum) > 0:
            step = self._sum.total
            if self.aggregation_base == "root_local" and self.root in self._sum:
                # - sum_e A_e M_e ⊙ delta_r, then the base w_r = w_t + delta_r
                for e, a in enumerate(self._exit_coefficients()):
                    if a != 0.0:
                        step.sub_(torch.where(self._term_masks[e], self._root_delta, 0.0), alpha=a)
                self.params = self.params + self._root_delta + self.server_lr * step
            else:
                self.params = self.params + self.server_lr * step
        self._sum = None
        self._root_delta = None
        return self.params

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(
            {
                "exits": self.exits.clone(),
                "draw_round": self._draw_round,
                "last_exits": dict(self.last_exits),
            }
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.exits = state["exits"].clone()
        self._draw_round = state["draw_round"]
        self.last_exits = dict(state.get("last_exits", {}))
