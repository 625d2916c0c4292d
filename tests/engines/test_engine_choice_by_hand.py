"""engine="auto" end to end without a fit: :func:`decide` on a stand-in server (its rule's per-client config, its
``optimizer_state``, the first client with data), :func:`registry.choose` passing the fit's ``compile``, ``comm`` and
``placement`` through, and the registry's defaults. Written for the survivors of the ``engine-choice`` mutation chunk
(docs/testing.md): each case names the slip it catches.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_fedhet.distributed import ProcessGroupComm
from lightning_fedhet.engines import registry
from lightning_fedhet.engines.auto import EngineChoice, FitFacts, decide, vmap_trial
from lightning_fedhet.engines.sequential import SequentialEngine
from lightning_fedhet.engines.sharded import ShardedSequentialEngine, ShardedVmapEngine
from lightning_fedhet.engines.vmap import VmapEngine
from tests.helpers import TinyClassifier

CPU = torch.device("cpu")
VMAP_CPU = "the model passes vmap's checks and a cohort in lock-step pays on a CPU for a model without convolutions"


class _Streams:
    """A client's mini-batch of 4 rows of 5 features, stacked ``[1, 4, ...]``; records the (round, client) asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def probe_indices(self, round: int, client: int) -> np.ndarray:
        self.asked.append((round, client))
        return np.arange(4)

    def stacked_batch(self, indices: np.ndarray):
        gen, rows = torch.Generator().manual_seed(0), len(indices[0])
        return torch.randn(1, rows, 5, generator=gen), torch.randint(0, 3, (1, rows), generator=gen)


class _Rule(SimpleNamespace):
    """A rule stand-in: the reason names the rule by its class."""


def _server(sends_client_config: bool = False, optimizer_state: str = "reset", has_data=(True, True)):
    """What :func:`decide` reads of a server: the rule (its name and ``sends_client_config``), ``optimizer_state``,
    the streams and which clients hold data."""
    return SimpleNamespace(algorithm=_Rule(sends_client_config=sends_client_config),
                           optimizer_state=optimizer_state, streams=_Streams(),
                           planner=SimpleNamespace(has_data=np.array(has_data)))


def _fit(module=None, weight_decay: float = 0.0, val_interval=None, rounds=3, moved: list | None = None) -> FitFacts:
    module = TinyClassifier() if module is None else module
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=weight_decay)

    def to_device(batch):
        if moved is not None:
            moved.append(batch)
        return batch

    return FitFacts(module=module, optimizers=[optimizer], scheduler_intervals=["epoch"],
                    val_interval_inside_epoch=val_interval, device=CPU, rounds=rounds, to_device=to_device)


def test_decide_reads_the_rules_per_client_config_and_the_fits_validation_interval():
    # weight decay refuses vmap only when the rule trains a different part of the model on each client
    decayed = _fit(weight_decay=1e-4)
    assert decide(decayed, _server(sends_client_config=True), None) == EngineChoice(
        "sequential", False, "_Rule trains a different part of the model on each client and the optimizer has "
                             "weight_decay=[0.0001], which would move the parts a client does not train")
    assert decide(decayed, _server(sends_client_config=False), None) == EngineChoice("vmap", False, VMAP_CPU)
    assert decide(_fit(val_interval=2), _server(), None) == EngineChoice(
        "sequential", False, "val_check_interval=2 is counted inside each round, which vmap runs as one step")
    # persist: SGD's momentum buffers ride in the cohort; a rule with per-client configs does not (a kept buffer would
    # move the parts a client does not train)
    assert decide(_fit(), _server(optimizer_state="persist"), None) == EngineChoice("vmap", False, VMAP_CPU)
    assert decide(_fit(), _server(sends_client_config=True, optimizer_state="persist"), None) == EngineChoice(
        "sequential", False, "optimizer_state='persist' with a rule that trains a different part of the model on each "
                             "client: a kept momentum buffer would move the parts a client does not train")


@pytest.mark.without_compiler  # names compile, compiles nothing: mutation testing runs it
def test_decide_follows_an_explicit_compile_and_else_decides_it_by_the_runs_length():
    # on a CPU, 3 rounds are below the 200 from which auto compiles; an explicit compile=True is kept
    assert decide(_fit(rounds=3), _server(), True) == EngineChoice("vmap", True, VMAP_CPU)
    assert decide(_fit(rounds=3), _server(), "max-autotune") == EngineChoice("vmap", "max-autotune", VMAP_CPU)
    assert decide(_fit(rounds=3), _server(), None) == EngineChoice("vmap", False, VMAP_CPU)
    assert decide(_fit(rounds=200), _server(), None) == EngineChoice("vmap", True, VMAP_CPU)


def test_decide_tries_the_first_client_with_data_and_no_one_when_nobody_has_data():
    moved: list = []
    server = _server(has_data=(False, True, True))
    assert decide(_fit(moved=moved), server, None) == EngineChoice("vmap", False, VMAP_CPU)
    assert server.streams.asked == [(0, 1)] and len(moved) == 1  # one trial step, on client 1's round-0 batch
    # nobody holds data: no trial step is taken (there is no batch to take it on), vmap's choice stands
    moved.clear()
    nobody = _server(has_data=(False, False))
    assert decide(_fit(moved=moved), nobody, None) == EngineChoice("vmap", False, VMAP_CPU)
    assert nobody.streams.asked == [] and moved == []


class _BranchesOnAWeight(TinyClassifier):
    """Python control flow on a parameter's value: fine for one model, not for torch.func's vmapped parameters."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.linear.weight.sum() > 0:
            loss = loss * 2
        return loss


def test_a_step_that_branches_on_a_parameter_fails_the_trial_and_decide_picks_sequential():
    # the trial must vmap the parameters themselves (not only the buffers): a step that branches on a weight runs
    # on the module's own parameters, but not under vmap, where the vmap engine would meet it at round 0
    cause = vmap_trial(_BranchesOnAWeight(), _Streams().stacked_batch(np.arange(4)[None, :]), lambda b: b)
    assert cause is not None and cause.startswith("torch.func could not transform training_step (")
    choice = decide(_fit(_BranchesOnAWeight()), _server(), None)
    assert choice == EngineChoice("sequential", False, cause)


@pytest.mark.without_compiler  # names compile, compiles nothing: mutation testing runs it
def test_choose_passes_auto_the_compile_asked_for_and_places_the_engine_on_the_processes():
    engine, choice = registry.choose("auto", True, _fit(rounds=3), _server())
    assert type(engine) is VmapEngine and engine.compile is True  # 3 rounds alone would not compile
    assert choice == EngineChoice("vmap", True, VMAP_CPU)
    comm = ProcessGroupComm()
    engine, choice = registry.choose("auto", False, _fit(), _server(), comm=comm, placement="by_client")
    assert type(engine) is ShardedVmapEngine and engine.comm is comm and engine.placement == "by_client"
    assert engine.compile is False and choice.name == "vmap"
    engine, _ = registry.choose("auto", None, _fit(), _server(), comm=comm)
    assert engine.placement == "balanced"  # the default placement


@pytest.mark.without_compiler  # names compile, compiles nothing: mutation testing runs it
def test_choose_makes_a_named_engine_with_its_compile_comm_and_placement():
    engine, choice = registry.choose("vmap", True, fit=None, server=None)
    assert type(engine) is VmapEngine and engine.compile is True and choice is None
    comm = ProcessGroupComm()
    engine, _ = registry.choose("sequential", False, None, None, comm=comm)
    assert type(engine) is ShardedSequentialEngine and engine.comm is comm and engine.placement == "balanced"
    engine, _ = registry.choose("vmap", "max-autotune", None, None, comm=comm, placement="by_client")
    assert type(engine) is ShardedVmapEngine and engine.placement == "by_client" and engine.compile == "max-autotune"
    assert type(registry.choose("sequential", False, None, None)[0]) is SequentialEngine


@pytest.mark.without_compiler  # names compile, compiles nothing: mutation testing runs it
def test_build_engine_defaults_and_a_sharded_engine_keeps_its_compile():
    comm = ProcessGroupComm()
    assert registry.build_engine("sequential", comm=comm).placement == "balanced"
    sharded = registry.build_engine("vmap", "max-autotune", comm=comm)
    assert type(sharded) is ShardedVmapEngine and sharded.compile == "max-autotune"
    assert registry.build_engine("vmap").compile is False


def test_the_validation_interval_is_refused_from_two_steps_on():
    # 2 is the smallest interval a one-step round never reaches; the message says both ways out
    with pytest.raises(ValueError) as refused:
        registry.check_val_interval("vmap", 2)
    assert str(refused.value) == (
        "Trainer(val_check_interval=2) counts steps inside an epoch, but with engine='vmap' a round (an epoch) is one "
        "Lightning step, so validation would never run: add check_val_every_n_epoch=None to validate every 2 rounds, "
        "or pass check_val_every_n_epoch=2 instead")
