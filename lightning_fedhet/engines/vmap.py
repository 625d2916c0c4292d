"""The vmap cohort engine: a whole round's cohort trains at once with ``torch.func``.

One Lightning step is one whole round: :meth:`VmapEngine.training_step` runs every local step of the cohort (a
:class:`~lightning_fedhet.engines.lockstep.CohortRound` yields them one at a time). So ``trainer.global_step``,
``max_steps`` and an integer ``val_check_interval`` count rounds (the interval with ``check_val_every_n_epoch=None``;
without it the strategy refuses an interval above 1, which Lightning would count inside the one-step epoch and never
reach), and Lightning's per-step loop (hooks, closure, optimizer wrapper: about 0.4 ms per step on a 2-core CPU) runs
once per round instead of once per local step.

The engine schedules the round across Lightning's hooks: the round's :class:`~lightning_fedhet.engines.lockstep.
LockStepRound` is made when the round opens, its lock-steps are Lightning's one batch, they all run in
:meth:`VmapEngine.training_step`, and the trained rows go to the server at the batch's end. How a cohort keeps its
clients' stacked state and masks the clients whose local steps are used up is :mod:`lightning_fedhet.engines.cohort`'s;
how a round is split into cohorts and stepped in lock-step is :mod:`lightning_fedhet.engines.lockstep`'s (which
:mod:`lightning_fedhet.multiseed` shares to run many seeds as one batched computation).

``optimizer_state="persist"`` keeps each client's SGD momentum buffers between its rounds (the server holds them as
the sequential engine's do; each cohort starts its rows from them and gives them back).

Limits (each raises :class:`VmapUnsupported` naming the cause and the ``engine="sequential"`` fallback):
BatchNorm with ``momentum=None`` (a cumulative average), optimizers whose state is not elementwise (LBFGS, ...),
``optimizer_state="persist"`` with an optimizer other than SGD (Adam's step count is per client), with SGD
``dampening`` other than 0, or with a rule that trains a different part of the model on each client,
data-dependent Python control flow in ``training_step`` (caught when ``torch.func`` refuses it), manual
optimization, learning-rate schedulers with ``interval="step"`` (they would advance once per round here;
``"epoch"`` schedulers advance once per round under both engines and give the same
run). ``self.log`` inside ``training_step`` works: each logged value is computed per client and step, and the
engine logs, once per round, their reduction as ``reduce_fx`` asks (``"mean"``, ``"sum"``, ``"max"``, ``"min"``;
another reduction raises naming the call), shown where ``prog_bar`` / ``logger`` ask: the epoch value the sequential
engine gives for ``on_epoch=True``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

# re-exported: the names this module published before the cohort and the scheduler had files of their own
from lightning_fedhet.data.streams import stack_batches  # noqa: F401
from lightning_fedhet.engines._compile_policy import compile_mode
from lightning_fedhet.engines._compiled import VmapUnsupported
from lightning_fedhet.engines.base import Engine, log_reduction, reduce_logged
from lightning_fedhet.engines.cohort import (  # noqa: F401
    ELEMENTWISE_OPTIMIZERS,
    VmapCohort,
    check_vmap_support,
)
from lightning_fedhet.engines.cohort_checks import check_vmap_fit
from lightning_fedhet.engines.layout import StateLayout, padded_size  # noqa: F401
from lightning_fedhet.engines.lockstep import (  # noqa: F401
    CohortGroup,
    CohortRound,
    LockStepRound,
    build_groups,
    cat_batches,
    lock_step_batches,
    run_lock_steps,
    submit_groups,
)
from lightning_fedhet.federation import RoundPlan
from lightning_fedhet.server import Server


class VmapEngine(Engine):
    """The round's cohort in lock-step (see the module docstring).

    Clients are grouped by mini-batch size and by the rule's per-client config (Fed-CIS's exit): one
    :class:`VmapCohort` per group, each stepped with the module configured for its group. A config is supported
    exactly only without weight decay: torch.func gives a dense zero gradient to a parameter the client does not
    train, and weight decay would move it, where the sequential engine (gradient ``None``) leaves it untouched.
    """

    name = "vmap"
    keeps_client_optimizer_state = True  # SGD's momentum buffers (check_persistable refuses the rest at setup)
    supports_compile = True
    one_step_per_round = True

    def __init__(self, compile: bool | str = False) -> None:
        super().__init__(compile)
        #: the open round's lock-step cohorts (``None`` between rounds)
        self.round: LockStepRound | None = None
        self._layout: StateLayout | None = None

    @classmethod
    def check_compile(cls, compile: bool | str) -> None:
        compile_mode(compile)  # False, True or a torch.compile mode
        super().check_compile(compile)

    @property
    def cohorts(self) -> list[VmapCohort]:
        """The open round's cohorts."""
        return [] if self.round is None else self.round.cohorts

    def setup(self, module, optimizers, server, flat, to_device) -> None:
        check_vmap_setup(module, optimizers, server)
        # The cohort steps its own stacked copies and returns None to Lightning on purpose.
        warnings.filterwarnings("ignore", message=r"`training_step` returned `None`.*")
        super().setup(module, optimizers, server, flat, to_device)
        self._layout = StateLayout(module)

    def check_lr_schedulers(self, intervals: list[str]) -> None:
        if "step" in intervals:
            # The cohort reads the learning rate when the round starts, and Lightning steps a "step" scheduler once per
            # round here against once per local step of every client under the sequential engine.
            raise VmapUnsupported(
                "a learning-rate scheduler with interval='step' would advance once per round (one Lightning step) "
                "instead of once per local step; use interval='epoch' (once per round)"
            )

    def _begin(self, plan: RoundPlan) -> None:
        self.flat.set(self.server.global_vector)
        members = [(self.server, plan)]
        self.round = LockStepRound(self.module, self.optimizers[0], members, self.apply_config, self.compile,
                                   self._layout)

    def _round_batches(self, plan: RoundPlan) -> Iterator:
        return iter([self.round.batches(self.to_device)])

    def on_batch_start(self) -> None:
        return None

    def training_step(self, default_step, batch: CohortRound, batch_idx: int) -> None:
        logs, display = self.round.run(batch, self.step)
        self.step += len(batch)
        for name, chunks in logs.items():  # every client's steps reduced as the step asked, shown where it asked
            values = torch.cat([values for values, _ in chunks])
            if not values.numel():
                continue
            options = dict(display.get(name, {}))
            reduction = log_reduction(name, options.pop("reduce_fx", "mean"))
            # batch_size: a many-process run weights each process's mean by its count of client steps
            self.module.log(name, reduce_logged(values, reduction), on_step=False, on_epoch=True, reduce_fx=reduction,
                            batch_size=values.numel(), **options)
        # The cohort stepped its own stacked copies; Lightning's optimizer has nothing to do.
        return None

    def on_batch_end(self, output: Any) -> None:
        self.round.submit()
        self.round = None
        self.close_round()


def check_vmap_setup(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], server: Server) -> None:
    """Refuse, before any work, a fit the vmap engine cannot simulate (each error names the cause)."""
    check_vmap_fit(module, optimizers, optimizer_state=server.optimizer_state,
                   sends_client_config=server.algorithm.sends_client_config, rule=type(server.algorithm).__name__)
