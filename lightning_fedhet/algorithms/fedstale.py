"""FedStale (Rodio & Neglia 2024; thesis ch. 3) and the stale-update memory shared with FedVARP and MIFA.

FedStale mixes fresh and stale client updates ([P] Eq. 9, thesis Eq. 3.9, [P] Algorithm 2)::

    w_{t+1} = w_t + server_lr * [ beta * sum_{j=1..N} alpha_j h_j  +  sum_{i in R_t} c_i (delta_i - beta h_i) ]

with ``h_i`` the memory **before** this round's replacement, after which ``h_i <- delta_i`` for ``i in R_t``
(Algorithm 2, lines 4-6; ``h_i = 0`` initially). ``R_t`` are the clients whose update arrived (one :meth:`add`
each), ``delta_i = w_i - w_t`` and ``alpha`` the client weights of :meth:`setup` (uniform ``1/N`` by default,
which gives the paper's ``1/N``). The fresh weights ``c_i``:

============== =========================================== ==============================================
weighting      c_i                                         source
============== =========================================== ==============================================
known_p        ``alpha_i / p_i``  (``1/(N p_i)`` uniform)    FedStale paper Eq. 9 (unbiased, "U-FedVARP")
participating  ``alpha_i / sum_{j in R_t} alpha_j``          FedAU paper's FedVarp code (``1/|R_t|``)
============== =========================================== ==============================================

``beta = 0`` is unbiased FedAvg (:class:`~lightning_fedhet.algorithms.fedavg.FedAvg` with ``weighting="known_p"``,
identical arithmetic, and no memory is allocated); ``beta = 1`` is FedVARP (Eq. 7). ``p_i`` is the true
participation probability from ``RoundContext.participation_probs`` (``p_source="known"``; the probability that the
update is aggregated) or FedAU's online estimate ``1/omega_i`` from rounds ``< t`` (``p_source="fedau"`` or an
:class:`~lightning_fedhet.algorithms.fedau.IntervalEstimator`; FedStale paper §5.3). The estimator counts a
client as participating when its update was absorbed by :meth:`add`. Its cut-off ``fedau_K`` defaults to 50, the
FedAU paper's best value; the FedStale paper gives none and its code's default is ``1e8``, i.e. effectively no
cut-off (``fedau_K=None`` here).

**Empty rounds** (nobody arrives). Eq. 9 read literally gives a purely stale step ``beta * sum_j alpha_j h_j``;
both reference codes (FedStale's and FedAU's FedVarp) skip the round instead (a zero update).
``empty_round="skip"`` (default) leaves ``w`` unchanged; ``empty_round="stale"`` applies the stale term.

**Memory.** :class:`StaleMemory` stores one update per client, ``N x d`` values at ``memory_dtype`` on
``memory_device`` (default fp32 on CPU): **N * d * bytes-per-element** (e.g. N=250, d=551,786, fp32: 552 MB;
bfloat16 halves it), allocated at :meth:`setup` (none when ``beta == 0``) and reported by ``memory_bytes``. It also
keeps the running total ``H = sum_j alpha_j h_j`` (fp64, on the parameters' device, ``8 d`` bytes) so a round costs
``O(|R_t| d)`` rather than ``O(N d)`` (the FedStale paper's "efficient server implementation"). The stored update is
``delta_i`` itself (Algorithm 2), not ``delta_i / (eta_c K)`` (Algorithm 3); they agree for constant ``eta_c, K``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_device, check_real
from lightning_fedhet.algorithms._weighted_sum import WeightedSum
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares, ShardedRows
from lightning_fedhet.algorithms.fedau import IntervalEstimator
from lightning_fedhet.algorithms.weighting import NORMALISED, check_weighting, raw_weight, weightings

STALE_WEIGHTINGS = weightings("participating", "known_p")
EMPTY_ROUNDS = ("skip", "stale")


class StaleMemory:
    """Per-client stale updates ``h_i`` (``[N, d]``) and their weighted total ``H = sum_j alpha_j h_j``.

    Args:
        dtype: floating dtype of the ``N x d`` buffer (``torch.float32``, ``torch.bfloat16``, ...).
        device: where the buffer lives (``"cpu"`` by default; rows are moved to the parameters' device on read).

    ``H`` is updated incrementally from the values *as stored* (after rounding to ``dtype``), in fp64, so it
    always equals the sum of what the buffer holds up to fp64 rounding.

    **Several processes** (:meth:`shard`): a process keeps only the rows of the clients ``i`` with
    ``i % world_size == rank`` (the clients it trains), about ``N / world_size`` rows; its writes of a round
    accumulate the change of ``H`` in ``pending``, which the processes sum (:meth:`shares`) before :meth:`settle`
    adds it to ``H``, so every process keeps the same ``H``. :meth:`state_dict` then holds the rows as
    :class:`~lightning_fedhet.algorithms.base.ShardedRows`, which the many-process strategy gathers into the full
    ``[N, d]`` tensor before a checkpoint is written; :meth:`load_state_dict` takes the full tensor and keeps its rows.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"memory_dtype must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")
        self.dtype = dtype
        self.device = check_device(device, "memory_device")
        self.data: Tensor | None = None
        self.total: Tensor | None = None
        self.weights: Tensor | None = None
        self.num_clients = 0
        self.rank, self.world_size = 0, 1
        self.pending: Tensor | None = None

    def shard(self, rank: int, world_size: int) -> None:
        """Keep only the rows of clients ``i`` with ``i % world_size == rank`` (call before :meth:`allocate`)."""
        if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank must be in [0, world_size) and world_size >= 1, got rank={rank}, {world_size=}")
        self.rank, self.world_size = int(rank), int(world_size)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def _local_rows(self, num_clients: int) -> Tensor:
        return torch.arange(self.rank, int(num_clients), self.world_size, dtype=torch.int64)

    def _row(self, client: int) -> int:
        if client % self.world_size != self.rank:
            raise ValueError(
                f"client {client}'s memory row is kept by process {client % self.world_size}, not by this one "
                f"({self.rank}): a client with per-client server state must train on process client % world_size"
            )
        return client // self.world_size

    def allocate(self, num_clients: int, dim: int, weights: Tensor, total_device: torch.device) -> None:
        """Allocate ``h = 0`` (``num_clients * dim * element_size`` bytes, divided among the processes when
        sharded) and ``H = 0``."""
        self.num_clients = int(num_clients)
        rows = len(self._local_rows(num_clients))
        self.data = torch.zeros((rows, int(dim)), dtype=self.dtype, device=self.device)
        self.total = torch.zeros(int(dim), dtype=torch.float64, device=total_device)
        self.pending = torch.zeros_like(self.total) if self.sharded else None
        self.weights = weights

    @property
    def nbytes(self) -> int:
        """Bytes of the ``N x d`` buffer, over all processes when sharded (0 before :meth:`allocate`)."""
        return 0 if self.data is None else self.num_clients * self.data.shape[1] * self.data.element_size()

    def read(self, client: int, like: Tensor) -> Tensor:
        """``h_client`` as a new tensor with the dtype and device of ``like``."""
        return self.data[self._row(client)].to(device=like.device, dtype=like.dtype, copy=True)

    def write(self, client: int, value: Tensor) -> None:
        """``h_client <- value`` (rounded to the memory dtype) and update ``H`` (or ``pending`` when sharded)."""
        row = self.data[self._row(client)]
        # copy=True: when the memory is already fp64 on the total's device, .to() would return the row itself, the
        # copy_ below would overwrite ``old`` too, and H would never move.
        old = row.to(device=self.total.device, dtype=torch.float64, copy=True)
        row.copy_(value)
        new = row.to(device=self.total.device, dtype=torch.float64)
        target = self.pending if self.sharded else self.total
        target.add_(new - old, alpha=float(self.weights[client]))

    def shares(self) -> RoundShares:
        """The round's change of ``H`` on this process (summed over the processes), when sharded."""
        return RoundShares(sums=[self.pending]) if self.sharded else RoundShares()

    def settle(self) -> None:
        """Add the round's (summed) change of ``H`` when sharded; called when the round closes."""
        if self.sharded:
            self.total.add_(self.pending)
            self.pending.zero_()

    def state_dict(self) -> dict:
        data = None if self.data is None else self.data.clone()
        if data is not None and self.sharded:
            data = ShardedRows(self._local_rows(self.num_clients), data, self.num_clients)
        return {"data": data, "total": None if self.total is None else self.total.clone()}

    def load_state_dict(self, state: dict, weights: Tensor, total_device: torch.device) -> None:
        data = state["data"]
        if isinstance(data, ShardedRows):
            if len(data.rows) != data.num_rows:
                raise ValueError(
                    f"the memory state holds {len(data.rows)} of {data.num_rows} clients' rows (one process's shard): "
                    "save checkpoints through the strategy, which gathers every process's rows"
                )
            data = data.values[torch.argsort(data.rows)]
        if data is not None:
            self.num_clients = data.shape[0]
            data = data[self._local_rows(self.num_clients)]
        self.data = None if data is None else data.to(device=self.device, dtype=self.dtype, copy=True)
        total = state["total"]
        self.total = None if total is None else total.to(device=total_device, dtype=torch.float64, copy=True)
        self.pending = torch.zeros_like(self.total) if self.sharded and self.total is not None else None
        self.weights = weights


class FedStale(Algorithm):
    """Convex mix of unbiased FedAvg (``beta=0``) and FedVARP (``beta=1``) through per-client stale updates.

    Args:
        beta: weight of the stale updates, in ``[0, 1]`` (paper grid 0, 0.2, 0.5, 0.8, 1; 0.5 "without tuning").
        weighting: ``"known_p"`` (``c_i = alpha_i/p_i``, default) or ``"participating"``
            (``c_i = alpha_i / sum_{R_t} alpha``); see the module doc.
        p_source: where ``p_i`` comes from for ``"known_p"``: ``"known"`` (``RoundContext.participation_probs``),
            ``"fedau"`` (FedAU's Algorithm 2 with cut-off ``fedau_K``) or an :class:`IntervalEstimator` instance
            (owned by this algorithm from then on; do not share it).
        fedau_K: cut-off of the ``"fedau"`` estimator (``None`` for none). Default 50 (FedAU paper); the FedStale
            code's default is ``1e8``, effectively ``None``.
        memory_dtype, memory_device: storage of the ``N x d`` memory (cost ``N * d * element_size`` bytes).
        server_lr: ``eta_s > 0``.
        empty_round: ``"skip"`` (default) or ``"stale"``; what to do when nobody arrives (module doc).

    Example::

        >>> algo = FedStale(beta=0.5)
        >>> algo.setup(num_clients=2, init_params=torch.zeros(1))
        >>> ctx = lambda t: RoundContext(t, 2, *(torch.ones(2, dtype=torch.bool),) * 3,
        ...                              participation_probs=torch.tensor([1.0, 0.5]))
        >>> algo.open_round(0, ctx(0))
        >>> algo.add(1, torch.tensor([2.0]), ClientInfo(1, 1))     # (1/2)(2 - 0.5*0)/0.5 = 2
        >>> algo.close_round()
        tensor([2.])
        >>> algo.open_round(1, ctx(1))
        >>> algo.add(0, torch.tensor([4.0]), ClientInfo(1, 1))     # 0.5*(0+2)/2 + (1/2)(4 - 0)/1 = 2.5
        >>> algo.close_round()
        tensor([4.5000])
    """

    shares_rounds = True

    def __init__(
        self,
        beta: float,
        weighting: str = "known_p",
        p_source: str | IntervalEstimator = "known",
        fedau_K: int | None = 50,
        memory_dtype: torch.dtype = torch.float32,
        memory_device: str | torch.device = "cpu",
        server_lr: float = 1.0,
        empty_round: str = "skip",
    ) -> None:
        super().__init__()
        self.beta = check_real(beta, "beta", 0.0, 1.0)
        check_weighting(weighting, STALE_WEIGHTINGS)
        server_lr = check_real(server_lr, "server_lr", 0.0, math.inf, low_open=True, high_open=True)
        check_choice(empty_round, "empty_round", EMPTY_ROUNDS)
        self.weighting = weighting
        self.server_lr = float(server_lr)
        self.empty_round = empty_round
        self.estimator: IntervalEstimator | None = None
        if isinstance(p_source, IntervalEstimator):
            self.estimator = p_source
            self.p_source = "fedau"
        elif isinstance(p_source, str) and p_source == "fedau":
            self.estimator = IntervalEstimator(fedau_K)
            self.p_source = "fedau"
        elif isinstance(p_source, str) and p_source == "known":
            self.p_source = "known"
        else:
            raise ValueError(f"p_source must be 'known', 'fedau' or an IntervalEstimator, got {p_source!r}")
        if self.estimator is not None and weighting != "known_p":
            raise ValueError("p_source='fedau' only applies to weighting='known_p' ('participating' uses no p_i)")
        self.fedau_K = None if self.estimator is None else self.estimator.K
        self.memory = StaleMemory(memory_dtype, memory_device)
        self._fresh: WeightedSum | None = None
        self._stale: Tensor | None = None
        self._probs: Tensor | None = None

    # ------------------------------------------------------------------ config
    def hparams(self) -> dict:
        return {
            "beta": self.beta,
            "weighting": self.weighting,
            "p_source": self.p_source,
            "fedau_K": self.fedau_K,
            "memory_dtype": str(self.memory.dtype),
            "memory_device": str(self.memory.device),
            "server_lr": self.server_lr,
            "empty_round": self.empty_round,
        }

    @property
    def uses_memory(self) -> bool:
        return self.beta > 0

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the ``N x d`` stale memory (``N * d * element_size``; 0 when ``beta == 0``)."""
        return self.memory.nbytes

    # ------------------------------------------------------------------ lifecycle
    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        super().setup(num_clients, init_params, client_weights, client_sizes)
        if self.uses_memory:
            self.memory.allocate(self.num_clients, self.params.numel(), self.client_weights, self.params.device)
        if self.estimator is not None:
            self.estimator.setup(self.num_clients)

    def shard_client_state(self, rank: int, world_size: int) -> bool:
        if not self.uses_memory:
            return False
        self.memory.shard(rank, world_size)
        return True

    def open_round(self, round: int, ctx: RoundContext | None) -> None:
        super().open_round(round, ctx)
        self._probs = None
        if self.weighting == "known_p":
            if self.estimator is not None:
                self._probs = self.estimator.estimates()
            else:
                probs = None if ctx is None else ctx.participation_probs
                self._probs = self._context_probs(
                    probs, "participation_probs", "weighting='known_p' with p_source='known'"
                )
        self._fresh = WeightedSum(self.params)
        # beta * sum_j alpha_j h_j with the memory *before* this round's replacements.
        self._stale = (self.beta * self.memory.total) if self.uses_memory else None

    def _raw_weight(self, client: int, info: ClientInfo) -> float:
        prob = float(self._probs[client]) if self.weighting == "known_p" else None
        return raw_weight(self.weighting, float(self.client_weights[client]), info.num_samples, prob)

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        self._check_update(client, delta, self._fresh, self._fresh)
        raw = self._raw_weight(client, info)
        delta = delta.to(self._fresh.total)
        if self.uses_memory:
            old = self.memory.read(client, like=self._fresh.total)
            self._fresh.add(client, delta - self.beta * old, raw)  # c_i (delta_i - beta h_i)
            self.memory.write(client, delta)
        else:
            self._fresh.add(client, delta, raw)

    def round_shares(self) -> RoundShares:
        shares = self._fresh.shares()
        return shares.extend(self.memory.shares()) if self.uses_memory else shares

    def close_round(self) -> Tensor:
        if self._fresh is None:
            raise RuntimeError("close_round() called without open_round()")
        if self.uses_memory:
            self.memory.settle()  # H for the next round (this round's stale term was taken at open_round)
        scale = 1.0
        arrived = len(self._fresh) > 0
        if self.weighting in NORMALISED:
            total = self._fresh.weight_sum
            scale = 1.0 / total if total > 0 else 0.0
        self.last_weights = self._fresh.scaled_weights(scale)
        apply_stale = self.uses_memory and (arrived or self.empty_round == "stale")
        if arrived or apply_stale:
            step = (self.server_lr * scale) * self._fresh.total
            if apply_stale:
                step = step + (self.server_lr * self._stale).to(step)
            self.params = self.params + step
        if self.estimator is not None:
            mask = torch.zeros(self.num_clients, dtype=torch.bool)
            if arrived:
                mask[list(self._fresh)] = True
            self.estimator.update(mask)
        self._fresh = self._stale = None
        return self.params

    def participation_estimates(self) -> Tensor | None:
        """FedAU's ``p_hat`` for the next round (``p_source="fedau"``), else ``None``."""
        return None if self.estimator is None else self.estimator.estimates()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["memory"] = self.memory.state_dict()
        state["estimator"] = None if self.estimator is None else self.estimator.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        device = self.params.device if self.params is not None else torch.device("cpu")
        self.memory.load_state_dict(state["memory"], self.client_weights, device)
        if self.estimator is not None:
            if state.get("estimator") is None:
                raise ValueError("state has no participation estimator but p_source='fedau'")
            self.estimator.load_state_dict(state["estimator"])
