"""The federated configuration of a run as one flat, JSON-able dict, for every logger's hyper-parameters.

``federated_config(strategy)`` answers "which federated experiment is this run?": the strategy and every setting of
its :class:`~lightning_fedhet.spec.FederationSpec` (server rule and its arguments, participation process and its
arguments, selection, local steps, channel, latency model, deadline, number of clients, partitioner, engine, compile,
seed, optimizer state, client weights, update bound and its action), and the engine that ran (:func:`engine_ran`:
``engine`` is the setting, ``"auto"`` by default; ``engine.ran`` the engine that trains). Loggers get it as
``log_hyperparams({"fedhet": federated_config(...)})`` (see ``lightning_fedhet.callbacks.RoundMetrics``), so W&B runs
can be grouped by ``fedhet.algorithm``, TensorBoard shows ``fedhet/algorithm`` and CSV runs carry it in
``hparams.yaml``.

Values are ``str``, ``int``, ``float``, ``bool`` or ``None``, or short lists of numbers; objects appear as their
``repr`` (the library's heterogeneity models print their arguments) and long per-client vectors as a summary.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_fedhet.data.datamodule import FederatedDataModule

__all__ = ["engine_ran", "federated_config"]

#: sequences up to this length are logged element by element; longer ones are summarised
MAX_LIST = 16


def federated_config(strategy: Any, datamodule: Any = None) -> dict[str, Any]:
    """Flat description of the federated set-up of ``strategy`` (a ``FedHetStrategy`` or ``FedHetDDPStrategy``):
    every setting of its :class:`~lightning_fedhet.spec.FederationSpec`, one key each.

    Args:
        strategy: the federated strategy; read through ``strategy.spec`` (each field) and ``strategy.seed`` (the
            run's seed, also when the spec leaves it to Lightning's global seed).
        datamodule: optional; when it is a ``FederatedDataModule`` and the spec does not set
            ``num_clients``/``partitioner`` itself (the usual case), they are read from it.

    Returns:
        ``{"strategy", "algorithm", "algorithm.<arg>"..., "participation", "participation.args", "selection",
        "channel", "local_steps", ..., "seed"}``: ``"strategy"`` and one key per field of the spec (the rule's and
        the participation process's arguments as extra keys), plus ``"partition_seed"`` when the split comes from a
        ``FederatedDataModule``, and :func:`engine_ran`'s keys once the engine is known.
    """
    spec = strategy.spec
    config: dict[str, Any] = {"strategy": type(strategy).__name__}
    for field in dataclasses.fields(spec):
        name = field.name
        value = getattr(spec, name)
        if name == "algorithm":
            config["algorithm"] = type(value).__name__
            for key, arg in value.hparams().items():
                config[f"algorithm.{key}"] = _jsonable(arg)
        elif name == "participation":
            config["participation"] = type(value).__name__
            config["participation.args"] = _call_args(repr(value))
        elif name == "selection":
            # None: the algorithm's own select() decides (all available clients unless the rule says otherwise)
            config["selection"] = "algorithm" if value is None else repr(value)
        elif name == "channel":
            config["channel"] = "lossless" if value is None else repr(value)
        elif name == "num_clients":
            config["num_clients"] = _num_clients(value, datamodule)
        elif name == "partitioner":
            if value is None and isinstance(datamodule, FederatedDataModule):
                value = datamodule.partitioner
                config["partition_seed"] = int(datamodule.seed)
            config["partitioner"] = _partitioner(value)
        elif name == "seed":
            config["seed"] = int(strategy.seed)
        else:
            config[name] = _jsonable(value)
    config.update(engine_ran(strategy))
    return config


def engine_ran(strategy: Any) -> dict[str, Any]:
    """The engine that trains ``strategy``'s fit: ``{"engine.ran": "sequential" | "vmap", "engine.compile": ...}``
    (the ``compile`` it was made with: ``False``, ``True`` or a ``torch.compile`` mode).

    For ``engine="auto"`` this is what the fit's choice picked (``strategy.engine_choice``), and ``{}`` before the fit
    chose (the choice needs the first round's data, so it comes after Lightning's ``setup``); a named engine is
    itself. A fit that resumes chooses again, so read it after the fit has started.
    """
    choice = getattr(strategy, "engine_choice", None)
    if choice is not None:
        return {"engine.ran": choice.name, "engine.compile": _jsonable(choice.compile)}
    spec = strategy.spec
    if spec.engine == "auto":  # engines.registry.AUTO (the engines sit above this module's layer)
        return {}
    return {"engine.ran": spec.engine, "engine.compile": _jsonable(spec.compile)}


def _num_clients(num_clients: int | None, datamodule: Any) -> int | None:
    if num_clients is None and isinstance(datamodule, FederatedDataModule):
        num_clients = datamodule.num_clients
    return None if num_clients is None else int(num_clients)


def _call_args(text: str) -> str:
    """``"UniformSample(k=10)" -> "k=10"``; any other text unchanged."""
    match = re.fullmatch(r"\w+\((.*)\)", text, flags=re.DOTALL)
    return match.group(1) if match else text


def _partitioner(partitioner: Any) -> str | None:
    if partitioner is None:
        return None
    if isinstance(partitioner, Sequence) and not isinstance(partitioner, str):
        return f"explicit index lists ({len(partitioner)} clients)"
    return repr(partitioner)


def _jsonable(value: Any) -> Any:
    """A JSON-able stand-in for ``value``: numbers and strings as they are, short vectors as lists."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, list, tuple)):
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            return repr(value)
        if arr.ndim == 0:
            return _jsonable(arr.item())
        if arr.ndim == 1 and arr.size <= MAX_LIST:
            integral = np.all(arr == np.round(arr))
            return [int(v) if integral else float(v) for v in arr]
        if arr.size == 0:
            return []
        return f"{arr.size} values in [{arr.min():g}, {arr.max():g}], mean {arr.mean():g}"
    return repr(value)
