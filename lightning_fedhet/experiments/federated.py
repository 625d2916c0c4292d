"""A study of federated runs from one ``build`` function: the common case, in about twenty lines of user code.

::

    from lightning_fedhet import FedHetStrategy
    from lightning_fedhet.algorithms import FedAvg, FedVARP
    from lightning_fedhet.experiments import federated_study

    ALGORITHMS = {"FedAvg": FedAvg, "FedVARP": FedVARP}

    def build(cell, seed):                  # after seed_everything(seed)
        model = MyModule(lr=cell.config["lr"])
        data = my_datamodule(alpha=cell.config["alpha"])
        strategy = FedHetStrategy(algorithm=ALGORITHMS[cell.method](), engine="vmap", seed=seed)
        return model, data, strategy

    STUDY = federated_study("my-study", build, methods=ALGORITHMS, settings={"iid": {"alpha": 100.0}},
                            seeds=range(5), rounds=50, eval_every=10, metric="val_acc", lr=0.05)

Each run trains ``rounds`` rounds with a quiet Lightning ``Trainer`` (one epoch is one round), validates every
``eval_every`` rounds and after the last, and records the validation curve of the names in ``metrics``
(``{"round": [...], "val_acc": [...]}``), the engine and the training data's checksum.

Stacked seeds (``run_seeds``): the seeds of a cell train as one :func:`lightning_fedhet.multiseed.fit_seeds` run
where the cell allows it, chosen like ``engine="auto"``: a strategy that asks for ``engine="sequential"`` keeps it,
and a cell that ``fit_seeds`` refuses (what the vmap engine cannot run) runs its seeds one at a time; the runner
says which, once. A stacked seed's record equals its one-seed record (same engine, same numbers; the engine
contract) except the timing keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_fedhet.experiments.records import describe_device
from lightning_fedhet.experiments.study import Cell, Study

Build = Callable[[Cell, int], tuple]

#: what a stacked cell's records name as the engine (fit_seeds trains with the vmap engine's lock-step cohorts)
STACKED_ENGINE = "vmap"


def federated_study(
    name: str,
    build: Build,
    *,
    methods: Mapping[str, Mapping] | Sequence[str],
    settings: Mapping[str, Mapping] | Sequence[str],
    seeds: Iterable[int],
    rounds: int,
    eval_every: int | None = None,
    metric: str = "val_acc",
    metrics: Sequence[str] | None = None,
    baseline: str | None = None,
    device: str = "cpu",
    report: Any = None,
    **common: Any,
) -> Study:
    """A :class:`~lightning_fedhet.experiments.Study` whose runs are ``build(cell, seed)`` trained for ``rounds``.

    Args:
        name: the study's name.
        build: ``build(cell, seed) -> (module, datamodule, strategy)``, called right after ``seed_everything(seed)``;
            ``strategy`` is a ``FedHetStrategy`` or a ``FederationSpec`` whose seed is ``seed``. Returning the same
            datamodule object for every seed of a cell lets stacked seeds share its batches' gathering.
        methods, settings: names, or ``{name: config}`` dicts (a value that is not a dict, e.g. the algorithm's
            class, adds no configuration); the cells are every setting x every method, and a cell's config is
            ``common``, then the setting's, then the method's entries (JSON-able).
        seeds: the seeds every cell runs.
        rounds, eval_every: rounds per run; validate every ``eval_every`` rounds (``None``: after the last only).
            Both go into every cell's config, where a setting or method may override them.
        metric: the validation metric the generic report summarises (its final value per run).
        metrics: every validation metric to record (default ``(metric,)``).
        baseline: the method the report's paired differences subtract (default: the first method).
        device: where runs train (``"cpu"`` or ``"cuda"``), recorded as the records' ``device``.
        report: a custom report (default: ``Report(metric=metric, baseline=baseline)``).
        **common: entries of every cell's config, and keyword arguments of :class:`Study` (``title``, ``protocol``,
            ``threads``, ``canary``, ``root``, ...).
    """
    from lightning_fedhet.experiments.report import Report

    study_keys = {f.name for f in Study.__dataclass_fields__.values()} - {"name", "cells", "seeds", "run",
                                                                         "run_seeds", "report"}
    study_kwargs = {k: common.pop(k) for k in list(common) if k in study_keys}
    base = {"rounds": int(rounds), "eval_every": None if eval_every is None else int(eval_every), **common}
    settings, methods = _named(settings, "settings"), _named(methods, "methods")
    cells = tuple(Cell(s, m, {**base, **settings[s], **methods[m]}) for s in settings for m in methods)
    names = tuple(metrics) if metrics is not None else (metric,)
    if metric not in names:
        raise ValueError(f"metric {metric!r} must be one of the recorded metrics {names}")
    return Study(
        name=name, cells=cells, seeds=tuple(seeds),
        run=FederatedRun(build, names, device), run_seeds=StackedRun(build, names, device),
        report=report if report is not None else Report(metric=metric, baseline=baseline), **study_kwargs,
    )


def _named(entries: Mapping[str, Mapping] | Sequence[str], what: str) -> dict[str, dict]:
    if isinstance(entries, Mapping):
        named = {str(k): dict(v) if isinstance(v, Mapping) else {} for k, v in entries.items()}
    else:
        named = {str(k): {} for k in entries}
    if not named:
        raise ValueError(f"{what} must name at least one entry")
    return named


class FederatedRun:
    """``run(cell, seed)`` of :func:`federated_study`: one seed through ``Trainer.fit`` with the strategy's engine."""

    def __init__(self, build: Build, metrics: Sequence[str], device: str = "cpu") -> None:
        self.build, self.metrics, self.device = build, tuple(metrics), device

    def __call__(self, cell: Cell, seed: int) -> dict:
        from lightning.pytorch import seed_everything

        with quiet():
            seed_everything(int(seed), workers=False, verbose=False)
            module, datamodule, strategy = _built(self.build(cell, int(seed)))
            strategy = _as_strategy(strategy)
            curve = fit_curve(module, datamodule, strategy, cell.config["rounds"], cell.config.get("eval_every"),
                              self.metrics, self.device)
        choice = strategy.engine_choice
        return {"metrics": series(curve, self.metrics), "engine": choice.name if choice else strategy.engine,
                "data_checksum": data_checksum(datamodule), "device": describe_device(self.device)}


class StackedRun:
    """``run_seeds(cell, seeds)`` of :func:`federated_study`: the seeds stacked in one ``fit_seeds`` run where the
    cell allows it, else one at a time (with a note saying why)."""

    def __init__(self, build: Build, metrics: Sequence[str], device: str = "cpu") -> None:
        self.build, self.metrics, self.device = build, tuple(metrics), device
        self.single = FederatedRun(build, metrics, device)

    def __call__(self, cell: Cell, seeds: Sequence[int]) -> list[dict]:
        from lightning_fedhet.engines.vmap import VmapUnsupported
        from lightning_fedhet.multiseed import fit_seeds

        seeds = [int(s) for s in seeds]
        datamodules: dict[int, Any] = {}

        def build(seed: int):
            module, datamodule, strategy = _built(self.build(cell, seed))
            if strategy.engine == "sequential":
                raise _SequentialAsked
            datamodules[seed] = datamodule
            return module, datamodule, strategy

        def evaluate(module, seed: int, round: int) -> dict:
            return _eval_trainer(self.device).validate(module, datamodule=datamodules[seed], verbose=False)[0]

        config = cell.config
        try:
            with quiet():
                runs = fit_seeds(build, seeds, config["rounds"], eval_every=config.get("eval_every"),
                                 evaluate=evaluate, device=self.device)
        except _SequentialAsked:
            return self._one_at_a_time(cell, seeds, "its strategy asks for engine='sequential'")
        except VmapUnsupported as error:
            return self._one_at_a_time(cell, seeds, f"fit_seeds refuses it: {error}")
        results = []
        for run in runs:
            curve = [(r, {k: float(v) for k, v in m.items() if k in self.metrics}) for r, m in run.evals]
            results.append({"metrics": series(curve, self.metrics), "engine": STACKED_ENGINE,
                            "data_checksum": data_checksum(datamodules[run.seed]),
                            "device": describe_device(self.device),
                            "note": "seeds stacked with lightning_fedhet.multiseed.fit_seeds (a cell that "
                                    "it refuses runs one seed at a time, and says why)"})
        return results

    def _one_at_a_time(self, cell: Cell, seeds: Sequence[int], why: str) -> list[dict]:
        note = f"{cell.name}: seeds run one at a time ({why})"
        return [{**self.single(cell, seed), "note": note} for seed in seeds]


class _SequentialAsked(Exception):
    """The cell's strategy names the sequential engine: stacking would change the engine, so it is not stacked."""


def _built(built: Any) -> tuple:
    if not (isinstance(built, tuple) and len(built) == 3):
        raise TypeError(f"build(cell, seed) must return (module, datamodule, strategy), got {type(built).__name__}")
    return built


def _as_strategy(strategy: Any):
    from lightning_fedhet import FedHetStrategy

    return strategy if isinstance(strategy, FedHetStrategy) else FedHetStrategy(spec=strategy)


# -------------------------------------------------------------------------------------------------------- training
@contextlib.contextmanager
def quiet():
    """Silence Lightning's banners and per-run notices for the duration (a study runs hundreds of fits)."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning", "pytorch_lightning")
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available.*")
        warnings.filterwarnings("ignore", ".*LightningDataModule.*")
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def _trainer_kwargs(device: str) -> dict:
    accelerator = torch.device(device).type
    return {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False,
            "enable_model_summary": False, "accelerator": accelerator, "devices": 1}


def _eval_trainer(device: str):
    from lightning.pytorch import Trainer

    return Trainer(**_trainer_kwargs(device))


def fit_curve(module, datamodule, strategy, rounds: int, eval_every: int | None, names: Sequence[str],
              device: str = "cpu") -> list[tuple[int, dict[str, float]]]:
    """Train ``rounds`` rounds; ``[(round, {name: value})]`` after every ``eval_every`` rounds and after the last."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback

    curve: list[tuple[int, dict[str, float]]] = []

    class Curve(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            metrics = trainer.callback_metrics
            if not trainer.sanity_checking and all(n in metrics for n in names):
                curve.append((trainer.current_epoch + 1, {n: float(metrics[n]) for n in names}))

    rounds = int(rounds)
    trainer = Trainer(strategy=strategy, max_epochs=rounds, check_val_every_n_epoch=int(eval_every or rounds),
                      callbacks=[Curve()], num_sanity_val_steps=0, **_trainer_kwargs(device))
    trainer.fit(module, datamodule=datamodule)
    if not curve or curve[-1][0] != rounds:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        if curve:  # validate() does not advance current_epoch: this evaluation is after the last round
            curve[-1] = (rounds, curve[-1][1])
    if not curve:
        raise RuntimeError(f"validation logged none of {list(names)}: does validation_step log them?")
    return curve


def series(curve: Sequence[tuple[int, Mapping[str, float]]], names: Sequence[str]) -> dict[str, list]:
    """``{"round": [...], name: [...]}`` from a curve, for a record's ``metrics``."""
    out: dict[str, list] = {"round": [int(r) for r, _ in curve]}
    for name in names:
        out[name] = [float(m[name]) for _, m in curve]
    return out


# ------------------------------------------------------------------------------------------------------ checksums
_CHECKSUMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def data_checksum(datamodule) -> str:
    """sha256 (hex) of the training data a run used: each client's size, then every field of the training set
    (inputs, labels after any relabelling) gathered in client order.

    Two runs with the same checksum trained on the same bytes with the same partition, whatever code made them.
    Computed once per datamodule object (a study's ``build`` usually returns the same one for every seed).
    """
    try:
        return _CHECKSUMS[datamodule]
    except (KeyError, TypeError):
        pass
    value = checksum(datamodule.client_indices, *_fields(datamodule.train_dataset, datamodule.client_indices))
    with contextlib.suppress(TypeError):
        _CHECKSUMS[datamodule] = value
    return value


def _fields(dataset, client_indices) -> tuple:
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset):
        return dataset.tensors
    # any map-style dataset: its items, in index order, stacked field by field (the same bytes as a TensorDataset's)
    n = len(dataset)
    used = np.zeros(n, dtype=bool)
    for indices in client_indices:
        used[np.asarray(indices, dtype=np.int64)] = True
    items = [dataset[i] if used[i] else None for i in range(n)]
    first = next(item for item in items if item is not None)
    fields = []
    for k in range(len(first) if isinstance(first, tuple | list) else 1):
        values = [torch.as_tensor(item[k] if isinstance(item, tuple | list) else item) if item is not None
                  else None for item in items]
        blank = torch.zeros_like(next(v for v in values if v is not None))
        fields.append(torch.stack([v if v is not None else blank for v in values]))
    return tuple(fields)


def checksum(client_indices, *tensors) -> str:
    """sha256 of the clients' sizes and of ``tensors`` gathered in client order (see :func:`data_checksum`)."""
    order = np.concatenate([np.asarray(i, dtype=np.int64).reshape(-1) for i in client_indices])
    digest = hashlib.sha256(np.asarray([len(i) for i in client_indices], dtype=np.int64).tobytes())
    for tensor in tensors:
        gathered = torch.as_tensor(tensor)[torch.from_numpy(order)].contiguous()
        digest.update(str((gathered.dtype, tuple(gathered.shape))).encode())
        digest.update(gathered.numpy().tobytes())
    return digest.hexdigest()
