"""The federated configuration of a run as one flat, JSON-able dict, for every logger's hyper-parameters.

``federated_config(strategy)`` answers "which federated experiment is this run?": strategy, server rule and its
arguments, participation process and its arguments, selection, channel, local steps, engine, number of clients,
partitioner and seed. Loggers get it as ``log_hyperparams({"fedhet": federated_config(...)})`` (see
``lightning_fedhet.callbacks.RoundMetrics``), so W&B runs can be grouped by ``fedhet.algorithm``, TensorBoard shows
``fedhet/algorithm`` and CSV runs carry it in ``hparams.yaml``.

Values are ``str``, ``int``, ``float``, ``bool`` or ``None``, or short lists of numbers; objects appear as their
``repr`` (the library's heterogeneity models print their arguments) and long per-client vectors as a summary.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_fedhet.data.datamodule import FederatedDataModule

__all__ = ["federated_config"]

#: sequences up to this length are logged element by element; longer ones are summarised
MAX_LIST = 16


def federated_config(strategy: Any, datamodule: Any = None) -> dict[str, Any]:
    """Flat description of the federated set-up of ``strategy`` (a ``FedHetStrategy``).

    Args:
        strategy: the federated strategy; read through its public attributes ``algorithm``, ``participation``,
            ``selection``, ``channel``, ``local_steps``, ``engine``, ``num_clients``, ``partitioner``, ``seed``.
        datamodule: optional; when it is a ``FederatedDataModule`` and the strategy does not set
            ``num_clients``/``partitioner`` itself (the usual case), they are read from it.

    Returns:
        ``{"strategy", "algorithm", "algorithm.<arg>"..., "participation", "participation.args", "selection",
        "channel", "local_steps", "engine", "num_clients", "partitioner", "seed"}`` (plus ``"partition_seed"``
        when the split comes from a ``FederatedDataModule``).
    """
    algorithm = strategy.algorithm
    config: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "algorithm": type(algorithm).__name__,
    }
    for key, value in algorithm.hparams().items():
        config[f"algorithm.{key}"] = _jsonable(value)
    config["participation"] = type(strategy.participation).__name__
    config["participation.args"] = _call_args(repr(strategy.participation))
    # None: the algorithm's own select() decides (all available clients unless the rule says otherwise)
    config["selection"] = "algorithm" if strategy.selection is None else repr(strategy.selection)
    config["channel"] = "lossless" if strategy.channel is None else repr(strategy.channel)
    config["local_steps"] = _jsonable(strategy.local_steps)
    config["engine"] = str(strategy.engine)
    num_clients, partitioner = strategy.num_clients, strategy.partitioner
    if isinstance(datamodule, FederatedDataModule):
        num_clients = datamodule.num_clients if num_clients is None else num_clients
        if partitioner is None:
            partitioner = datamodule.partitioner
            config["partition_seed"] = int(datamodule.seed)
    config["num_clients"] = None if num_clients is None else int(num_clients)
    config["partitioner"] = _partitioner(partitioner)
    config["seed"] = None if strategy.seed is None else int(strategy.seed)
    return config


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
