"""The engines by name, the one place that makes them, and the engine a strategy asks for once per fit.

``FederationSpec(engine=...)`` names an engine of :data:`ENGINES`, or ``"auto"``. The spec checks the name and the
engine's own settings (:func:`check_engine_name`, :func:`check_engine_options`) when it is made. A strategy asks
:func:`choose` once, when its fit's server exists: a named engine is made as named; ``"auto"`` is decided by
:func:`~lightning_fedhet.engines.auto.decide` and comes back with its
:class:`~lightning_fedhet.engines.auto.EngineChoice`, whose ``describe()`` the strategy says once. With ``comm=``
(several processes) the engine runs on each process's part of every round (:mod:`lightning_fedhet.engines.sharded`).

A new engine subclasses :class:`~lightning_fedhet.engines.base.Engine`, is added to :data:`ENGINES` (and, to run on
several processes, gets a :class:`~lightning_fedhet.engines.sharded.ShardedEngine` subclass mixed with it), and must
pass the engine contract test (``tests/engines/test_contract.py``).
"""

from __future__ import annotations

from lightning_fedhet._checks import check_choice
from lightning_fedhet.distributed import ProcessGroupComm
from lightning_fedhet.engines.auto import EngineChoice, FitFacts, decide
from lightning_fedhet.engines.base import Engine
from lightning_fedhet.engines.sequential import SequentialEngine
from lightning_fedhet.engines.sharded import sharded_engine
from lightning_fedhet.engines.vmap import VmapEngine
from lightning_fedhet.server import Server

__all__ = ["AUTO", "ENGINES", "ENGINE_NAMES", "build_engine", "check_engine_name", "check_engine_options",
           "check_val_interval", "choose"]

#: the engines by name (``engine=``)
ENGINES: dict[str, type[Engine]] = {engine.name: engine for engine in (SequentialEngine, VmapEngine)}
#: the engine decided per fit from the module, the optimizer, the device and one trial step (:mod:`.auto`)
AUTO = "auto"
#: every value ``engine=`` takes
ENGINE_NAMES = (*ENGINES, AUTO)


def check_engine_name(engine: str) -> None:
    """Refuse an ``engine=`` that names no engine."""
    check_choice(engine, "engine", ENGINE_NAMES)


def check_engine_options(engine: str, compile: bool | str | None, optimizer_state: str) -> None:
    """Refuse what the named engine cannot do: ``optimizer_state="persist"`` without per-client optimizer state, a
    ``compile=`` it does not take (``"auto"`` may pick vmap, so vmap's check applies; ``None`` is "not asked")."""
    if engine != AUTO and optimizer_state == "persist" and not ENGINES[engine].keeps_client_optimizer_state:
        raise ValueError(f"optimizer_state='persist' is not supported by engine={engine!r}; use 'sequential'")
    ENGINES[VmapEngine.name if engine == AUTO else engine].check_compile(False if compile is None else compile)


def check_val_interval(engine: str, interval: int | None) -> None:
    """Refuse ``Trainer(val_check_interval=N)``, ``N > 1``, counted inside each epoch (``interval``; ``None`` when it
    is not) for an engine that runs a round as one Lightning step: it would never be reached. ``"auto"`` never picks
    such an engine for it."""
    if engine in ENGINES and ENGINES[engine].one_step_per_round and interval is not None and interval > 1:
        raise ValueError(
            f"Trainer(val_check_interval={interval}) counts steps inside an epoch, but with "
            f"engine={engine!r} a round (an epoch) is one Lightning step, so validation would never run: "
            f"add check_val_every_n_epoch=None to validate every {interval} rounds, or pass "
            f"check_val_every_n_epoch={interval} instead"
        )


def build_engine(
    engine: str, compile: bool | str = False, *, comm: ProcessGroupComm | None = None, placement: str = "balanced"
) -> Engine:
    """The engine named ``engine``; with ``comm``, its form for one process of several (clients placed by
    ``placement``, see :mod:`lightning_fedhet.distributed`)."""
    engine_class = ENGINES[engine]
    if comm is None:
        return engine_class(compile=compile)
    return sharded_engine(engine_class)(comm, placement, compile=compile)


def choose(
    engine: str,
    compile: bool | str | None,
    fit: FitFacts,
    server: Server,
    *,
    comm: ProcessGroupComm | None = None,
    placement: str = "balanced",
) -> tuple[Engine, EngineChoice | None]:
    """The engine of a fit whose ``server`` is built: the one ``engine`` names (and ``None``), or for ``"auto"`` the
    one :func:`~lightning_fedhet.engines.auto.decide` picks from ``fit`` and ``server`` (and that choice, to be
    said once)."""
    choice = None
    if engine == AUTO:
        choice = decide(fit, server, compile)
        engine, compile = choice.name, choice.compile
    return build_engine(engine, compile, comm=comm, placement=placement), choice
