"""The server-rule protocol shared by every aggregation algorithm.

Algorithms are framework-free: they see flat parameter vectors (``torch.Tensor`` of shape ``[d]``)
and per-client metadata, never a LightningModule. A round is streamed, so the server never holds
all of a cohort's updates at once. The server drives a rule in this order::

    algo.setup(num_clients=N, init_params=w0, client_weights=alpha, client_sizes=sizes)
    algo.check_client_solver(optimizer, optimizer_state)   # once, with the module's first optimizer
    for t in range(T):
        algo.observe_system(t, success_probs=..., local_steps=..., participation_probs=...)
        if algo.wants_probe_losses():
            algo.observe_losses(t, losses)                 # one-batch losses at w_t, NaN where not probed
        selected = algo.select(t, available, rng)          # bool[N] (or counts[N])
        config_i = algo.client_config(i)                   # for each client that trains
        algo.open_round(t, RoundContext(...))
        for i in arrived:
            algo.add(i, delta_i, ClientInfo(num_samples=n_i, local_steps=K_i, loss=l_i))
        w = algo.close_round()                             # new global parameters, shape [d]

Every hook other than :meth:`Algorithm.add` and :meth:`Algorithm.close_round` has a no-op (or identity)
default, so a rule overrides only what it uses.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_int, check_round, check_vector, check_weights


@dataclass
class RoundContext:
    """What the server can know about round ``round`` before it aggregates.

    All masks are tensors of shape ``[num_clients]``.

    Attributes:
        round: 0-based round index ``t``.
        num_clients: ``N``.
        available: bool, clients the participation process made available.
        selected: bool, clients the server asked to train (subset of ``available``).
        received: bool, clients whose update reached the server this round.
        participation_probs: float, the probability that client ``i``'s update is **aggregated** this round:
            ``P(available) x P(selected | available) x P(downlink) x P(uplink) x P(on time)``, computed by the
            server from the participation process, the selection, the channel and the deadline (``None`` when
            it has no closed form). This is the ``p_i`` that unbiased ``1/p_i`` weights divide by (FedAU paper
            Algorithm 1, FedStale paper Eq. 7/9: ``p_i`` is the probability that the update enters the
            aggregate, not merely that the client is asked). Rules that must not know it ignore it.
            A rule that selects clients itself enters through :meth:`Algorithm.selection_probs` (``None`` there
            makes this ``None``). Entries may be 0 (a client that can never be aggregated, see
            :meth:`Algorithm._context_probs`).
        success_probs: float, probability that a **selected** client's update reaches the server this round:
            ``P(downlink) x P(uplink) x P(on time | K_i(t))`` (the lossy links and the deadline; ``None`` when
            every selected client's update arrives).
        local_steps: int, local steps each client was asked to run this round (0 if not selected).
        availability_probs: float, probability that each client is available this round (the participation
            process's ``p_i``; ``None`` if unknown): what availability-aware rules (AdaFed's ``pi_i``, the samplers'
            ``unavailable="drop"``) divide by.

    ``selected`` holds int64 draw counts instead of a bool mask when the rule's own sampler draws with
    replacement (FedACS and its baselines); ``selected > 0`` is the mask.
    """

    round: int
    num_clients: int
    available: Tensor
    selected: Tensor
    received: Tensor
    participation_probs: Tensor | None = None
    success_probs: Tensor | None = None
    local_steps: Tensor | None = None
    availability_probs: Tensor | None = None

    def __post_init__(self) -> None:
        self.round = check_round(self.round)
        self.num_clients = check_int(self.num_clients, "num_clients")
        for name in ("available", "selected", "received"):
            mask = getattr(self, name)
            if not isinstance(mask, Tensor) or tuple(mask.shape) != (self.num_clients,):
                got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
                raise ValueError(f"{name} must be a tensor of shape ({self.num_clients},) (one entry per client), "
                                 f"got {got}")


@dataclass
class ClientInfo:
    """Metadata that travels with one client's update.

    Attributes:
        num_samples: number of training samples the client holds, ``|D_i|``.
        local_steps: local optimizer steps the client actually ran this round.
        loss: mean training loss over the client's local steps (``nan`` if not reported).
    """

    num_samples: int
    local_steps: int
    loss: float = float("nan")

    def __post_init__(self) -> None:
        self.num_samples = check_int(self.num_samples, "num_samples", 0)
        self.local_steps = check_int(self.local_steps, "local_steps", 0)
        if isinstance(self.loss, (bool, np.bool_)) or not isinstance(self.loss, (numbers.Real, Tensor)):
            raise ValueError(f"loss must be a real number (nan if not reported), got {self.loss!r}")
        if isinstance(self.loss, Tensor):
            if self.loss.numel() != 1 or self.loss.dtype.is_complex or self.loss.dtype == torch.bool:
                raise ValueError(f"loss must be a real number (nan if not reported), got {self.loss!r}")
            self.loss = self.loss.item()
        self.loss = float(self.loss)


@dataclass
class RoundShares:
    """One process's part of an open round, when a round's clients are split over several processes.

    The many-process strategy combines every process's shares **in place** before :meth:`Algorithm.close_round`:

    * each tensor of ``sums`` (a partial sum over this process's clients, e.g. ``WeightedSum.total``) is replaced
      by its elementwise sum over the processes;
    * each container of ``tables`` (keyed by client id: a ``dict`` of per-client values or a ``list`` of ids) is
      replaced by the union over the processes, in increasing client-id order (a client belongs to one process).

    After that every process holds the same round state as one process that had added every update, up to the
    summation order of the floating-point sums.
    """

    sums: list[Tensor] = field(default_factory=list)
    tables: list[dict | list] = field(default_factory=list)

    def extend(self, other: RoundShares) -> RoundShares:
        """Append ``other``'s sums and tables (returns ``self``)."""
        self.sums += other.sums
        self.tables += other.tables
        return self


@dataclass
class ShardedRows:
    """Per-client rows kept by one process (``rows[k]`` is the client id of ``values[k]``) out of ``num_rows``.

    A rule whose per-client state is sharded over processes (:meth:`Algorithm.shard_client_state`) puts this in its
    :meth:`Algorithm.state_dict` in place of the full ``[num_rows, ...]`` tensor; the many-process strategy gathers
    the shards into that full tensor before writing a checkpoint, so checkpoints do not depend on the process count.
    """

    rows: Tensor
    values: Tensor
    num_rows: int


class Algorithm:
    """Base class of a server rule. Subclasses override :meth:`add` and :meth:`close_round`.

    The base class keeps the global parameters (``self.params``, shape ``[d]``, fp32 on CPU unless
    ``setup`` received another dtype/device), the relative client weights ``self.client_weights``
    (``alpha_i``, shape ``[N]``, summing to 1), the clients' data sizes ``self.client_sizes`` and the round
    bookkeeping. ``self.last_weights`` maps client id -> weight applied to its fresh update in the last closed
    round; the server copies it into ``history``.

    Attributes:
        selects_clients: ``True`` for rules with their own sampler (their :meth:`select` is the selection);
            the server then refuses a separate strategy-level selection at setup. ``False`` (default): the
            rule keeps whatever the participation process and the strategy's selection give it.
    """

    selects_clients: ClassVar[bool] = False
    #: ``True`` for rules whose :meth:`client_config` is not always ``{}`` (Fed-CIS sends each node its exit), so
    #: engines can refuse at setup what they cannot apply per client
    sends_client_config: ClassVar[bool] = False
    #: ``True`` for rules that implement :meth:`round_shares` (every rule of this package), so a round's clients can
    #: be split over several processes (``FedHetDDPStrategy``); the many-process strategy refuses the others
    shares_rounds: ClassVar[bool] = False
    #: ``True`` for rules whose clients train different sub-models of the network (Fed-CIS: one exit each): the
    #: server then averages each floating buffer entry (BatchNorm statistics) and integer buffer entry only over the
    #: arrived clients that changed it, with their sample weights normalised over them, instead of over every arrival
    buffers_per_submodel: ClassVar[bool] = False

    def __init__(self) -> None:
        self.num_clients: int = 0
        self.params: Tensor | None = None
        self.client_weights: Tensor | None = None
        self.ctx: RoundContext | None = None
        self.last_weights: dict[int, float] = {}
        # |D_i| of every client (int64 [N]) from setup(); rules that weigh by data held by *other* clients
        # (FedCIS's |D_{e,p}|) read it. None when unknown.
        self.client_sizes: Tensor | None = None
        self._warned_never_aggregated: set[tuple[int, ...]] = set()
        #: multiplier of every client's learning rate in the open round (1.0 for every rule but FedACS and
        #: c-a-FedAvg with ``calibrate="client"``, App. I.2); set by :meth:`open_round`, applied by the engines to
        #: the optimizer's ``lr`` for that round only
        self.client_lr_scale: float = 1.0

    # ------------------------------------------------------------------ lifecycle
    def setup(
        self,
        num_clients: int,
        init_params: Tensor,
        client_weights: Tensor | None = None,
        client_sizes: Tensor | None = None,
    ) -> None:
        """Initialise server state. Called once by the server before the first round (and before
        :meth:`check_client_solver`); subclasses that override it forward every argument.

        Args:
            num_clients: ``N >= 1``.
            init_params: initial global parameters ``w_0``, shape ``[d]``.
            client_weights: ``alpha_i`` (e.g. ``|D_i|``), shape ``[N]``, non-negative; normalised to
                sum to 1. ``None`` means uniform ``1/N``.
            client_sizes: ``|D_i|``, the number of training samples each client holds, integers ``>= 0`` of
                shape ``[N]`` (stored as int64 ``self.client_sizes``), or ``None`` when unknown.
        """
        num_clients = check_int(num_clients, "num_clients")
        if not isinstance(init_params, Tensor) or init_params.dim() != 1:
            got = f"shape {tuple(init_params.shape)}" if isinstance(init_params, Tensor) else type(init_params).__name__
            raise ValueError(f"init_params must be a flat tensor of shape [d], got {got}")
        if client_weights is None:
            client_weights = torch.full((num_clients,), 1.0 / num_clients, dtype=torch.float64)
        else:
            client_weights = check_weights(client_weights, "client_weights")
            if client_weights.numel() != num_clients:
                raise ValueError(f"client_weights must have num_clients={num_clients} entries, got "
                                 f"{client_weights.numel()}")
        self.num_clients = num_clients
        self.params = init_params.detach().clone()
        self.client_weights = client_weights
        self.client_sizes = None if client_sizes is None else self._check_sizes(client_sizes)

    def _check_sizes(self, client_sizes) -> Tensor:
        try:
            raw = client_sizes.detach() if isinstance(client_sizes, Tensor) else np.asarray(client_sizes)
            sizes = torch.as_tensor(raw)
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ValueError(f"client_sizes must be integers |D_i| >= 0, one per client, got {client_sizes!r}") from err
        if sizes.is_floating_point():
            if not torch.isfinite(sizes).all() or (sizes != sizes.round()).any():
                raise ValueError(f"client_sizes must be whole numbers |D_i| >= 0, got {sizes.flatten().tolist()}")
        elif sizes.dtype == torch.bool or sizes.is_complex():
            raise ValueError(f"client_sizes must be integers |D_i| >= 0, got dtype {sizes.dtype}")
        sizes = sizes.flatten().to(torch.int64).cpu().clone()
        if sizes.numel() != self.num_clients:
            raise ValueError(f"client_sizes must have num_clients={self.num_clients} entries, got {sizes.numel()}")
        if (sizes < 0).any():
            raise ValueError(f"client_sizes must be >= 0 (|D_i|), got {sizes.tolist()}")
        return sizes

    def check_client_solver(self, optimizer: torch.optim.Optimizer, optimizer_state: str) -> None:
        """Refuse a local solver this rule's formula does not describe. Default: accept any.

        Called once by the server at setup, after :meth:`setup`, with the module's first optimizer and the
        strategy's ``optimizer_state`` (``"reset"``: fresh optimizer state every round; ``"persist"``: each
        client's state, e.g. momentum buffers, carried across rounds). Rules whose weights assume a particular
        solver (FedNova's ``||a_i||_1``) raise ``ValueError`` naming the conflict.
        """

    def observe_system(
        self,
        round: int,
        *,
        success_probs: Tensor | None = None,
        local_steps: Tensor | None = None,
        participation_probs: Tensor | None = None,
    ) -> None:
        """The system oracle of round ``round``. Default: ignored.

        Called by the server at the start of every round, before :meth:`select`, with float64 ``[N]``
        round-trip success probabilities (``None`` without a channel), int64 ``[N]`` local steps each client
        would run this round, and the participation probabilities (as in :class:`RoundContext`, ``None`` when
        unknown). Samplers that need them (FedACS) override it.
        """

    def selection_probs(self, round: int) -> Tensor | None:
        """``P(selected | available)`` of this rule's own :meth:`select` in round ``round``, float64 ``[N]``, or
        ``None`` when it has no closed form. Called by the server when it plans the round (before :meth:`select`)
        to compute ``RoundContext.participation_probs``.

        Default: all ones for a rule that keeps every available client (``selects_clients = False``), ``None`` for
        a rule with its own sampler; such a rule that keeps every available client overrides it (AdaFed, Fed-CIS).
        """
        if self.selects_clients:
            return None
        return torch.ones(self.num_clients, dtype=torch.float64)

    def wants_probe_losses(self) -> bool:
        """Whether the server must compute probe losses for :meth:`observe_losses` this round. Default: ``False``.

        Asked by the server at the start of every round, before :meth:`select`; probing costs one forward
        pass per available client, so rules that do not use it leave this ``False``.
        """
        return False

    def observe_losses(self, round: int, losses: Tensor) -> None:
        """Probe losses at ``w_t`` (CA-Fed's ``F_i(w_t)``, thesis Alg. 3 line 3). Default: ignored.

        Called by the server before :meth:`select` of round ``round``, only when :meth:`wants_probe_losses`
        returned ``True``, with float64 ``[N]`` one-batch losses of the global model on each available
        client's data, ``NaN`` where a client was not probed.
        """

    def select(self, round: int, available: Tensor, rng: np.random.Generator) -> Tensor:
        """Which available clients the server asks to train. Default: all available.

        Args:
            round: 0-based round index.
            available: bool tensor ``[N]``.
            rng: generator seeded from (seed, round) by the caller.

        Returns:
            bool tensor ``[N]`` (or int counts ``[N]`` for samplers with replacement).
        """
        return available.clone()

    def client_config(self, client: int) -> dict:
        """Instructions for ``client``'s local training this round. Default: ``{}``.

        Called by the server after :meth:`select`, once per client that trains, before its first local step;
        a non-empty dict goes to the LightningModule's ``configure_client(**config)`` (FedCIS sends
        ``{"train_exit": e}``).
        """
        return {}

    @property
    def scales_client_lr(self) -> bool:
        """Whether :attr:`client_lr_scale` can differ from 1 (the rule scales the clients' learning rate per round);
        runtimes that cannot send a per-round learning rate refuse such a rule at setup."""
        return False

    @property
    def memory_bytes(self) -> int:
        """Bytes of per-client server state beyond the global model (0 unless the rule keeps some, e.g. the
        ``N x d`` stale memories of FedVARP/MIFA/FedStale). Read by the server after every round for
        ``history``."""
        return 0

    def open_round(self, round: int, ctx: RoundContext) -> None:
        """Start aggregating round ``round``; ``ctx`` holds what the server may know. Called by the server
        after every client of the round has trained, before the first :meth:`add`."""
        self._check_ready()
        self.ctx = ctx
        self.last_weights = {}

    def add(self, client: int, delta: Tensor, info: ClientInfo) -> None:
        """Absorb one arrived update ``delta = w_i - w_t`` (shape ``[d]``) of ``client``. Called by the server
        once per accepted update (not for lost uploads nor non-finite updates), in any order."""
        raise NotImplementedError

    def close_round(self) -> Tensor:
        """Finish the round and return the new global parameters ``w_{t+1}`` (shape ``[d]``). Called by the
        server once per round, after the last :meth:`add` (also when nobody arrived)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ several processes
    def round_shares(self) -> RoundShares:
        """This process's part of the open round: its partial sums and per-client tables (see
        :class:`RoundShares`). Default: nothing.

        Called by the many-process strategy after this process's last :meth:`add` and before :meth:`close_round`;
        the strategy then combines every process's shares in place, so :meth:`close_round` sees the whole round. A
        rule returns references to its own round accumulators (tensors and dicts), and sets ``shares_rounds = True``.
        """
        return RoundShares()

    def shard_client_state(self, rank: int, world_size: int) -> bool:
        """Keep per-client server state (e.g. stale-update memories) only for clients ``i`` with
        ``i % world_size == rank``. Called before :meth:`setup` by the many-process strategy, which then trains
        client ``i`` on process ``i % world_size`` every round. Returns whether the rule keeps such state (default:
        ``False``, nothing to shard)."""
        return False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to resume exactly (global params included)."""
        return {
            "num_clients": self.num_clients,
            "params": None if self.params is None else self.params.clone(),
            "client_weights": None if self.client_weights is None else self.client_weights.clone(),
            "client_sizes": None if self.client_sizes is None else self.client_sizes.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_clients = int(state["num_clients"])
        self.params = None if state["params"] is None else state["params"].clone()
        self.client_weights = None if state["client_weights"] is None else state["client_weights"].clone()
        sizes = state.get("client_sizes")
        self.client_sizes = None if sizes is None else sizes.clone()

    # ------------------------------------------------------------------ helpers
    def _check_ready(self) -> None:
        if self.params is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before the first round")

    def _check_update(self, client: int, delta: Tensor, accumulator: object, seen) -> None:
        """The checks every :meth:`add` starts with: the round is open (``accumulator`` is set), the client id
        and the delta's shape are valid, and ``client`` is not already in ``seen`` this round (``seen`` supports
        ``in``: a dict or a :class:`~lightning_fedhet.algorithms._weighted_sum.WeightedSum`)."""
        if accumulator is None:
            raise RuntimeError("add() called without open_round()")
        self._check_client(client, delta)
        if client in seen:
            raise ValueError(f"client {client} already added in this round")

    def _context_probs(self, values, name: str, needed_by: str) -> Tensor:
        """``RoundContext.<name>`` for a rule that divides by it: float64 CPU ``[N]`` with entries in ``[0, 1]``
        (a scalar is broadcast). ``needed_by`` names the rule's setting in the error when the value is unknown.

        A client whose probability is 0 can never be aggregated (``p_i = 0``, or a deadline it cannot meet): the
        rule runs on, its ``1/p_i`` weight is never used, and a warning (once per rule and set of such clients)
        says that its data is never seen, so the rule is unbiased only for the objective over the other clients.
        """
        if values is None:
            raise ValueError(f"{needed_by} needs RoundContext.{name}")
        probs = check_vector(values, f"RoundContext.{name}", 0.0, 1.0, num_clients=self.num_clients)
        never = tuple(torch.nonzero(probs == 0).flatten().tolist())
        if never and never not in self._warned_never_aggregated:
            self._warned_never_aggregated.add(never)
            shown = ", ".join(map(str, never[:10])) + (", ..." if len(never) > 10 else "")
            warnings.warn(
                f"{type(self).__name__} ({needed_by}): {len(never)} client(s) have RoundContext.{name} = 0 (ids "
                f"{shown}): they are never aggregated, so their data is never seen and the update is unbiased only "
                "for the objective over the other clients",
                RuntimeWarning,
                stacklevel=3,
            )
        return probs

    def _check_client(self, client: int, delta: Tensor) -> None:
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client id {client} out of range [0, {self.num_clients})")
        if delta.shape != self.params.shape:
            raise ValueError(
                f"delta of client {client} has shape {tuple(delta.shape)}, expected {tuple(self.params.shape)}"
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({fields})"

    def hparams(self) -> dict:
        """Constructor arguments, for logging."""
        return {}
