"""The engines' one registry: the names ``engine=`` takes, the one place engines are made, and the choice a strategy
asks for once per fit. Each case names the slip it catches."""

from __future__ import annotations

import pytest

from lightning_fedhet import FederationSpec, FedHetStrategy, spec
from lightning_fedhet.distributed import ProcessGroupComm
from lightning_fedhet.engines import registry
from lightning_fedhet.engines.sequential import SequentialEngine
from lightning_fedhet.engines.sharded import ShardedSequentialEngine, ShardedVmapEngine, sharded_engine
from lightning_fedhet.engines.vmap import VmapEngine


def test_one_registry_names_every_engine_and_the_spec_reads_it():
    # a second registry would let the spec accept a name the strategies cannot build (or the reverse)
    assert registry.ENGINES == {"sequential": SequentialEngine, "vmap": VmapEngine}
    assert registry.ENGINE_NAMES == ("sequential", "vmap", "auto")
    assert spec.ENGINES is registry.ENGINES  # the earlier home re-exports it
    with pytest.raises(ValueError, match="engine"):
        FederationSpec(engine="fast")


def test_build_engine_makes_the_named_engine_for_one_process_or_for_one_of_several():
    vmap = registry.build_engine("vmap", True)
    assert type(vmap) is VmapEngine and vmap.compile is True
    comm = ProcessGroupComm()
    sharded = registry.build_engine("vmap", comm=comm, placement="by_client")
    assert type(sharded) is ShardedVmapEngine and sharded.comm is comm and sharded.placement == "by_client"
    assert type(registry.build_engine("sequential", comm=comm)) is ShardedSequentialEngine
    assert sharded_engine(SequentialEngine) is ShardedSequentialEngine


def test_a_named_engine_is_chosen_as_named_and_says_nothing():
    # only engine='auto' has a choice to announce; a named engine needs nothing of the fit
    engine, choice = registry.choose("sequential", False, fit=None, server=None)
    assert type(engine) is SequentialEngine and choice is None


def test_the_engines_own_settings_are_refused_with_the_messages_users_get():
    with pytest.raises(ValueError, match=r"compile=True is not supported by engine='sequential'; use engine='vmap'"):
        registry.check_engine_options("sequential", True, "reset")
    with pytest.raises(ValueError, match="compile must be False, True or one of"):
        registry.check_engine_options("auto", "fast", "reset")  # 'auto' may pick vmap: vmap's check applies
    registry.check_engine_options("vmap", False, "persist")  # SGD's momentum rides in the cohort (setup checks others)
    registry.check_engine_options("auto", None, "persist")
    with pytest.raises(ValueError, match=r"val_check_interval=3\) counts steps inside an epoch, but with engine='vm"):
        registry.check_val_interval("vmap", 3)
    for engine, interval in (("vmap", 1), ("vmap", None), ("sequential", 3), ("auto", 3)):
        registry.check_val_interval(engine, interval)


def test_an_engine_without_per_client_optimizer_state_refuses_persist(monkeypatch):
    # every engine of today keeps it; the refusal stays for one that does not (a stand-in registered for the test)
    class Stateless(SequentialEngine):
        name = "stateless"
        keeps_client_optimizer_state = False

    monkeypatch.setitem(registry.ENGINES, "stateless", Stateless)
    with pytest.raises(ValueError, match=r"^optimizer_state='persist' is not supported by engine='stateless'; "
                                         r"use 'sequential'$"):
        registry.check_engine_options("stateless", False, "persist")
    registry.check_engine_options("stateless", False, "reset")


def test_a_strategy_has_no_engine_before_its_fit_chooses_one():
    # the engine is made once, with the fit's server; nothing is built (or announced) before
    strategy = FedHetStrategy(engine="auto")
    assert strategy._engine is None and strategy.engine_choice is None
