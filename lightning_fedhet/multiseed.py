"""Many seeds in one run: ``S`` independent federations of one configuration, trained as one batched computation.

A study needs 5 to 10 seeds of every configuration. The seeds differ only in their draws (participation, selection,
channel, local steps, data order), their initial global model and their rule's state, so their rounds can share
the work: every round, the cohorts of all ``S`` federations are stacked into one ``torch.func.vmap`` cohort (the
vmap engine's lock-step scheduler, :mod:`lightning_fedhet.engines.lockstep`), and each trained row goes back to its own
federation's :class:`~lightning_fedhet.server.Server`, which aggregates it with its own rule. Each seed's result is
its own single-seed run's (``Trainer(strategy=FedHetStrategy(seed=s, ...)).fit(...)``) within float tolerance;
the engine contract test checks it.

Why a function and not ``FedHetStrategy(seed=[0, 1, 2])``: a Lightning ``Trainer`` fits and validates one module,
while ``S`` federations have ``S`` global models (each seed initialises its own). :func:`fit_seeds` therefore takes
a ``build(seed)`` function that makes a seed's module, datamodule and strategy exactly as its single-seed run does
(after ``seed_everything(seed)``), and returns one :class:`SeedRun` per seed: the module holding that seed's final
global model (validate or test it with an ordinary ``Trainer``), the history, per-round metrics, and the evaluations
an ``evaluate`` callback made at chosen rounds::

    from lightning.pytorch import Trainer
    from lightning_fedhet import FederatedDataModule, FederationSpec
    from lightning_fedhet.multiseed import fit_seeds

    def build(seed):
        model = MyModule()                      # after seed_everything(seed): seed's own initial model
        spec = FederationSpec(algorithm=FedAvg(), participation=Bernoulli(0.5), local_steps=5, seed=seed)
        return model, datamodule, spec          # the same datamodule object for every seed: one gather per step

    def evaluate(module, seed, round):          # every 10 rounds and after the last
        return Trainer(logger=False, enable_progress_bar=False).validate(module, datamodule, verbose=False)[0]

    runs = fit_seeds(build, seeds=range(10), rounds=200, eval_every=10, evaluate=evaluate)
    runs[3].history, runs[3].evals, runs[3].module     # seed 3's rounds, [(round, metrics)], final global model

What runs: everything the vmap engine runs (:class:`~lightning_fedhet.engines.cohort.VmapCohort`; ``compile`` as the
strategy asks), with every rule (each seed has its own rule instance: stale memories, estimators and CA-Fed's probe
losses included), participation process, channel, latency model and deadline. Learning-rate schedulers with
``interval="epoch"`` step once per round as Lightning steps them (they are the same for every seed).

Refused before any work, naming the cause (run the seeds one at a time with ``Trainer.fit`` instead): what the vmap
engine refuses (``optimizer_state="persist"`` with an optimizer other than SGD, non-elementwise optimizers, several
optimizers, manual optimisation, BatchNorm with ``momentum=None``), ``interval="step"`` and metric-monitoring
schedulers, seeds whose modules or optimizer settings differ, ``FedHetDDPStrategy``. Not available here: Lightning
callbacks, loggers, checkpoints and precision plugins of a training ``Trainer`` (there is none); ``self.trainer``
inside ``training_step``.
Dropout draws differ from the single-seed runs (as between the vmap and sequential engines).

Resuming: with ``checkpoint=PATH``, every ``checkpoint_every`` rounds the whole state of the run (every seed's module,
server, rule state, participation process and data streams, the optimizer, the schedulers, the rounds done, the
evaluations so far and the global random generators) is written to ``PATH`` (atomically: a kill leaves the previous
checkpoint), and a call that finds ``PATH`` continues after its last round. The resumed run equals the uninterrupted
one bit for bit on the same machine and code (the tests check it); ``checkpoint_key`` (e.g. the commit and the
processor) makes a call refuse a checkpoint written under another key. A checkpoint is a pickle: load only your own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch import seed_everything
from torch import Tensor

from lightning_fedhet._checks import check_int
from lightning_fedhet.engines._compiled import VmapUnsupported
from lightning_fedhet.engines.base import apply_client_config, log_reduction, probe_losses, reduce_logged
from lightning_fedhet.engines.layout import StateLayout
from lightning_fedhet.engines.lockstep import LockStepRound
from lightning_fedhet.engines.vmap import check_vmap_setup
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.history import round_metrics
from lightning_fedhet.server import Server
from lightning_fedhet.spec import FederationSpec
from lightning_fedhet.strategy import FedHetStrategy

Build = Callable[[int], tuple[pl.LightningModule, pl.LightningDataModule, FedHetStrategy | FederationSpec]]
Evaluate = Callable[[pl.LightningModule, int, int], dict]


@dataclasses.dataclass
class SeedRun:
    """One seed's federation after :func:`fit_seeds`.

    Attributes:
        seed: the seed.
        module: the seed's LightningModule, holding its final global model (parameters, floating and integer buffers).
        strategy: the seed's strategy as ``build`` made it (a spec made into ``FedHetStrategy(spec=...)``); it ran
            no Trainer.
        server: the seed's server (global vector, rule state, history).
        metrics: one dict per round: ``round`` (0-based), the ``round/...`` counts of
            :func:`~lightning_fedhet.history.round_metrics`, ``train_loss`` (mean training loss of the clients that
            trained, NaN if none) and every value ``training_step`` logged with ``self.log``, reduced over the round's
            client steps as its ``reduce_fx`` asks (the mean by default).
        evals: ``(round, metrics)`` pairs returned by ``evaluate`` (``round`` counts completed rounds, 1-based).
        resumed: ``None`` when the run went from round 0 in this call; else ``{"from_rounds": [r, ...], "wall_s",
            "cpu_s"}``: the rounds done when each resume found its checkpoint, and the wall and CPU seconds the
            earlier calls spent on the rounds the last checkpoint holds (the whole stacked run, all seeds together).
    """

    seed: int
    module: pl.LightningModule
    strategy: FedHetStrategy
    server: Server
    flat: FlatModel
    metrics: list[dict] = dataclasses.field(default_factory=list)
    evals: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    resumed: dict | None = None

    @property
    def history(self) -> list[dict]:
        """The seed's round records, as ``FedHetStrategy.history`` gives them."""
        return self.server.history

    @property
    def global_params(self) -> Tensor:
        """The seed's global model as a flat vector ``[d]`` (parameters, then floating buffers)."""
        return self.server.global_vector

    def load_global(self) -> pl.LightningModule:
        """Put the seed's current global model (integer buffers included) into :attr:`module` and return it."""
        self.flat.set(self.server.global_vector)
        if self.server.global_ints.numel():
            self.flat.set_ints(self.server.global_ints)
        return self.module


def fit_seeds(
    build: Build,
    seeds: Sequence[int],
    rounds: int,
    *,
    eval_every: int | None = None,
    evaluate: Evaluate | None = None,
    device: str | torch.device = "cpu",
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    checkpoint_key: Mapping[str, Any] | None = None,
) -> list[SeedRun]:
    """Train ``rounds`` rounds of every seed's federation at once (see the module docstring).

    Args:
        build: ``build(seed) -> (module, datamodule, strategy)``, called once per seed right after
            ``lightning.seed_everything(seed)``; ``strategy`` is a :class:`FedHetStrategy` or a
            :class:`~lightning_fedhet.spec.FederationSpec` whose seed is ``seed`` (or ``None``, which takes it); its
            ``engine`` is not used (the seeds always train stacked in vmap cohorts), its ``compile`` is (``None``,
            the default, runs uncompiled).
        seeds: distinct ints, one federation each (``S >= 1``).
        rounds: communication rounds, ``>= 1``.
        eval_every: call ``evaluate`` after every ``eval_every`` rounds and after the last; ``None``: only after the
            last (when ``evaluate`` is given).
        evaluate: ``evaluate(module, seed, round) -> dict`` with ``module`` holding that seed's global model after
            ``round`` rounds (1-based); e.g. ``Trainer(...).validate(module, datamodule)[0]``. It may change nothing
            that training uses (the module's state is restored from the server afterwards anyway).
        device: where the modules and the cohort train.
        checkpoint: a file to write the run's state to every ``checkpoint_every`` rounds (after that round's
            evaluation; not after the last round), and to resume from when it exists at the call (``build`` is still
            called for every seed, so its side effects happen; the checkpoint's modules and servers replace what it
            made). ``None``: no checkpoint. The caller removes the file once the results are safe.
        checkpoint_every: rounds between checkpoints, ``>= 1``.
        checkpoint_key: what must match for a resume (JSON-able; e.g. the code's commit, the processor); a
            checkpoint written under another key, seeds, rounds or ``eval_every`` is refused with a ``ValueError``.

    Returns:
        One :class:`SeedRun` per seed, in the order of ``seeds``.
    """
    seeds = [check_int(seed, "seeds", 0, 2**32 - 1) for seed in seeds]
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds}")
    rounds = check_int(rounds, "rounds", 1)
    if eval_every is not None:
        eval_every = check_int(eval_every, "eval_every", 1)
    checkpoint_every = check_int(checkpoint_every, "checkpoint_every", 1)
    device = torch.device(device)
    started = (time.perf_counter(), time.process_time())
    runs, optimizers, schedulers = [], [], []
    for seed in seeds:
        run, optimizer, scheduler_configs = _build_seed(build, seed, device)
        runs.append(run)
        optimizers.append(optimizer)
        schedulers.append(scheduler_configs)
    _check_same_configuration(runs, optimizers)
    optimizer, epoch_schedulers = optimizers[0], schedulers[0]
    identity = {"seeds": seeds, "rounds": rounds, "eval_every": eval_every, "key": _canonical(checkpoint_key)}
    first, prior = 0, {"wall_s": 0.0, "cpu_s": 0.0}
    if checkpoint is not None and Path(checkpoint).exists():
        state = _load_checkpoint(Path(checkpoint), identity, device)
        runs, optimizer, epoch_schedulers, first = state["runs"], state["optimizer"], state["schedulers"], state["done"]
        prior = state["elapsed"]
        for run in runs:
            run.resumed = {"from_rounds": [*state["resumed_at"], first], **prior}
    carrier = runs[0].module
    layout = StateLayout(carrier)
    # None: engine="auto" (the default) left compiling to its per-fit choice, which a stacked run does not make
    compile = runs[0].strategy.compile or False
    algorithm = runs[0].server.algorithm

    def to_device(batch: Any) -> Any:
        batch = carrier.transfer_batch_to_device(batch, device, 0)
        return carrier.on_after_batch_transfer(batch, 0)

    def configure(config: dict) -> None:
        apply_client_config(carrier, algorithm, config)

    carrier.train()
    for t in range(first, rounds):
        members = []
        for run in runs:
            server = run.server

            def probe(round: int, available: Tensor, run: SeedRun = run) -> Tensor:
                return probe_losses(run.module, run.flat, run.server, to_device, round, available)

            members.append((server, server.begin_round(server.next_round, probe=probe)))
        lock_steps = LockStepRound(carrier, optimizer, members, configure, compile, layout)
        logs: dict = {}
        display: dict = {}
        if lock_steps.groups:
            logs, display = lock_steps.run(lock_steps.batches(to_device))
            lock_steps.submit()
        losses = lock_steps.member_losses()
        # per logged name, the reduction training_step asked for (as the vmap engine logs it)
        reductions = {name: log_reduction(name, shown.get("reduce_fx", "mean")) for name, shown in display.items()}
        for owner, run in enumerate(runs):
            run.server.close_round()
            record = run.server.history[-1]
            metrics = {"round": record["round"], **round_metrics(record), "train_loss": losses[owner]}
            for name, chunks in logs.items():
                # every logged name has a chunk per lock-step that logged it, so the list is never empty; a seed
                # with no client among them gets an empty tensor, hence NaN
                values = torch.cat([v[torch.from_numpy(o == owner).to(v.device)] for v, o in chunks])
                reduced = reduce_logged(values, reductions.get(name, "mean")) if values.numel() else torch.nan
                metrics[name] = float(reduced)
            run.metrics.append(metrics)
        for config in epoch_schedulers:  # as Lightning steps them at the end of every `frequency`-th epoch
            if (t + 1) % config.frequency == 0:
                with warnings.catch_warnings():
                    # the cohort applies the optimizer's update itself, so torch never sees optimizer.step() and
                    # would warn that the schedule runs ahead of it: it does not (the round read the rate first)
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                    config.scheduler.step()
        done = t + 1
        if evaluate is not None and (done == rounds or (eval_every is not None and done % eval_every == 0)):
            for run in runs:
                run.evals.append((done, evaluate(run.load_global(), run.seed, done)))
                carrier.train()
        if checkpoint is not None and done % checkpoint_every == 0 and done < rounds:
            elapsed = {"wall_s": prior["wall_s"] + time.perf_counter() - started[0],
                       "cpu_s": prior["cpu_s"] + time.process_time() - started[1]}
            resumed_at = runs[0].resumed["from_rounds"] if runs[0].resumed else []
            _save_checkpoint(Path(checkpoint), {**identity, "format": _CHECKPOINT_FORMAT, "done": done, "runs": runs,
                                                "optimizer": optimizer, "schedulers": epoch_schedulers,
                                                "elapsed": elapsed, "resumed_at": resumed_at,
                                                "rng": _rng_state(device)})
    for run in runs:
        run.load_global()
    return runs


_CHECKPOINT_FORMAT = 1


def _canonical(key: Mapping[str, Any] | None) -> str:
    """``key`` as one JSON text (sorted keys), so that a key read back from a checkpoint compares equal."""
    return json.dumps(dict(key or {}), sort_keys=True, default=str)


def _rng_state(device: torch.device) -> dict:
    """The global random generators a round may draw from (torch's, CUDA's on a CUDA device, NumPy's, Python's)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` through a temporary file and a rename: a kill mid-write keeps the last checkpoint.
    One ``torch.save`` keeps the objects' sharing (the optimizer holds the first seed's parameters)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def _load_checkpoint(path: Path, identity: dict, device: torch.device) -> dict:
    """The state at ``path``, its global random generators restored; refused unless written by the same run."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as error:  # a truncated or foreign file: say which, and how to start afresh
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); "
                         "delete it to start the run from round 0") from error
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not a fit_seeds checkpoint of format {_CHECKPOINT_FORMAT}; "
                         "delete it to start the run from round 0")
    for name, value in identity.items():
        if state.get(name) != value:
            raise ValueError(f"checkpoint {str(path)!r} was written by another run: its {name} is {state.get(name)!r}, "
                             f"this call's is {value!r}; delete it to start the run from round 0")
    _set_rng_state(state["rng"])
    return state


def _build_seed(build: Build, seed: int, device: torch.device) -> tuple[SeedRun, torch.optim.Optimizer, list]:
    """One seed's module, server and optimizer, checked for what the stacked run cannot do."""
    seed_everything(seed, workers=False, verbose=False)
    built = build(seed)
    if not (isinstance(built, tuple) and len(built) == 3):
        raise TypeError(f"build(seed) must return (module, datamodule, strategy), got {type(built).__name__}")
    module, datamodule, strategy = built
    if isinstance(strategy, FederationSpec):
        strategy = FedHetStrategy(spec=strategy)
    if not isinstance(strategy, FedHetStrategy):
        raise TypeError(
            f"build({seed}) returned a {type(strategy).__name__}: fit_seeds runs FedHetStrategy configurations "
            "(one process); run other strategies one seed at a time with Trainer.fit"
        )
    if strategy.seed != seed:
        raise ValueError(f"build({seed}) returned FedHetStrategy(seed={strategy.seed}): pass seed={seed} to it")
    if not isinstance(module, pl.LightningModule):
        raise TypeError(f"build({seed}) must return a LightningModule first, got {type(module).__name__}")
    module.to(device)
    datamodule.prepare_data()
    datamodule.setup("fit")
    dataloader = datamodule.train_dataloader()
    server, flat = strategy.build_server(module, dataloader, datamodule)
    optimizer, scheduler_configs = _optimizer(module, seed)
    strategy.algorithm.check_client_solver(optimizer, strategy.optimizer_state_mode)
    if strategy.algorithm.scales_client_lr:
        # each seed's rule picks its own learning rate every round, but the stacked seeds step one optimizer
        raise VmapUnsupported(
            f"seed {seed}'s {strategy.algorithm!r} scales the clients' learning rate every round (calibrate='client'), "
            "which differs between seeds and cannot be stacked: fit the seeds one at a time with Trainer.fit"
        )
    check_vmap_setup(module, [optimizer], server)
    return SeedRun(seed, module, strategy, server, flat), optimizer, scheduler_configs


@dataclasses.dataclass
class _EpochScheduler:
    scheduler: Any
    frequency: int


def _optimizer(module: pl.LightningModule, seed: int) -> tuple[torch.optim.Optimizer, list[_EpochScheduler]]:
    """The one optimizer of ``configure_optimizers`` and its per-epoch schedulers (Lightning's return forms)."""
    conf = module.configure_optimizers()
    schedulers: list = []
    if isinstance(conf, dict):
        optimizers = [conf["optimizer"]]
        if conf.get("lr_scheduler") is not None:
            schedulers = [conf["lr_scheduler"]]
    elif isinstance(conf, torch.optim.Optimizer):
        optimizers = [conf]
    elif isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple)):
        optimizers, schedulers = list(conf[0]), list(conf[1])
    elif isinstance(conf, (list, tuple)):
        optimizers = list(conf)
    else:
        raise VmapUnsupported(f"configure_optimizers returned {type(conf).__name__}; return an optimizer or a dict")
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise VmapUnsupported(f"configure_optimizers gave {len(optimizers)} optimizers; the cohort steps exactly one")
    out = []
    for entry in schedulers:
        config = entry if isinstance(entry, dict) else {"scheduler": entry}
        interval, frequency = config.get("interval", "epoch"), int(config.get("frequency", 1))
        if interval != "epoch" or config.get("monitor") is not None or _monitors(config["scheduler"]):
            raise VmapUnsupported(
                f"seed {seed}'s learning-rate scheduler (interval={interval!r}, monitor={config.get('monitor')!r}) "
                "is not a per-round schedule fit_seeds can step; use interval='epoch' without a monitor, or fit the "
                "seeds one at a time with Trainer.fit"
            )
        out.append(_EpochScheduler(config["scheduler"], frequency))
    return optimizers[0], out


def _monitors(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _check_same_configuration(runs: Sequence[SeedRun], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Every seed must train the same architecture with the same optimizer settings (one stacked cohort)."""
    first = runs[0]
    for name in ("algorithm", "participation", "selection", "channel", "latency"):
        seen: dict[int, int] = {}
        for run in runs:
            part = getattr(run.strategy, name)
            if part is None:
                continue
            if id(part) in seen:
                raise ValueError(
                    f"seeds {seen[id(part)]} and {run.seed} were given the same {type(part).__name__} object as "
                    f"{name}: it keeps per-run state, so build(seed) must create a new one for every seed"
                )
            seen[id(part)] = run.seed
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in first.module.state_dict().items()]
    hyper = _hyper(optimizers[0])
    for run, optimizer in zip(runs[1:], optimizers[1:]):
        other = [(name, tuple(t.shape), t.dtype) for name, t in run.module.state_dict().items()]
        if other != shapes:
            raise ValueError(
                f"seed {run.seed}'s module differs from seed {first.seed}'s in its tensors: fit_seeds stacks seeds "
                "of one configuration; fit different models one at a time"
            )
        if type(optimizer) is not type(optimizers[0]) or _hyper(optimizer) != hyper:
            raise ValueError(
                f"seed {run.seed}'s optimizer settings differ from seed {first.seed}'s: fit_seeds stacks seeds of one "
                "configuration; fit different optimizers one at a time"
            )
        if run.strategy.compile != first.strategy.compile:
            raise ValueError(
                f"seed {run.seed}'s strategy has compile={run.strategy.compile!r}, seed {first.seed}'s "
                f"{first.strategy.compile!r}: pass the same to every seed"
            )


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
