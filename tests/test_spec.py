"""FederationSpec: one object holds every federation setting, checks it once with the strategies' messages, is what
the strategies and fit_seeds run, and builds the Server from the clients' data or from their sizes alone."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from lightning_fedhet import FederatedDataModule, FederationSpec, FedHetDDPStrategy, FedHetStrategy, UniformSample
from lightning_fedhet.algorithms import FedAvg, FedVARP
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.multiseed import fit_seeds
from lightning_fedhet.participation import Bernoulli, Full
from lightning_fedhet.system import LossyChannel, UniformSteps
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset


def test_defaults_are_settled_once():
    spec = FederationSpec()
    assert isinstance(spec.algorithm, FedAvg) and isinstance(spec.participation, Full)
    assert spec.engine == "auto" and spec.compile is None  # the default engine, 'auto', decides compiling too
    assert FederationSpec(engine="sequential").compile is False  # an explicit engine compiles only when asked
    assert type(FederationSpec(num_clients=np.int64(3)).num_clients) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.local_steps = 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"engine": "gpu"}, r"engine must be one of \('sequential', 'vmap', 'auto'\), got 'gpu'"),
        ({"optimizer_state": "keep"}, r"optimizer_state must be one of \('reset', 'persist'\), got 'keep'"),
        ({"client_weights": "sample"}, r"client_weights must be one of \('uniform', 'samples'\), got 'sample'"),
        ({"update_norm_action": "drop"}, r"update_norm_action must be one of \('reject', 'clip'\), got 'drop'"),
        ({"max_update_norm": -1.0}, r"max_update_norm must lie in \(0, inf\), got -1.0"),
        ({"max_update_norm": 10**400}, r"max_update_norm must be finite"),
        ({"local_steps": 0}, r"local_steps"),
        ({"seed": -1}, r"seed"),
        ({"deadline": 2.0}, re.escape("deadline needs a latency model (latency=ShiftedExponential(...))")),
        ({"num_clients": 0}, r"num_clients"),
        ({"num_clients": 2, "local_steps": [1, 2, 3]}, r"local_steps"),
        ({"num_clients": 2, "participation": Bernoulli([0.5, 0.2, 0.9])}, r"\bp\b"),
        ({"num_clients": 2, "channel": LossyChannel(uplink=[0.1, 0.2, 0.3])}, r"uplink"),
        ({"engine": "sequential", "compile": True}, r"compile=True is not supported by engine='sequential'"),
        ({"engine": "auto", "compile": "fastest"}, r"compile must be False, True or one of"),
    ],
)
def test_a_bad_setting_fails_with_the_same_message_as_a_spec_and_as_a_strategy_argument(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FederationSpec(**settings)
    with pytest.raises((ValueError, TypeError), match=message):
        FedHetStrategy(**settings)


def test_per_client_lengths_are_checked_without_setting_up_the_runs_objects():
    participation, channel = Bernoulli([0.5, 0.2]), LossyChannel(uplink=[0.1, 0.2])
    FederationSpec(num_clients=2, participation=participation, channel=channel)
    # set up once, by the round planner, with the run's seed (not here with seed 0 only to check lengths)
    assert participation.num_clients == 0 and channel.num_clients == 0


def test_a_strategy_runs_its_spec_and_shows_its_settings():
    spec = FederationSpec(algorithm=FedVARP(), participation=Bernoulli(0.5), local_steps=[1, 2, 3], num_clients=3,
                          optimizer_state="persist", client_weights="samples", seed=4)
    strategy = FedHetStrategy(spec=spec)
    assert strategy.spec is spec
    assert strategy.algorithm is spec.algorithm and strategy.participation is spec.participation
    assert (strategy.optimizer_state_mode, strategy.client_weights, strategy.seed) == ("persist", "samples", 4)
    with pytest.raises(AttributeError, match="setting of the strategy's FederationSpec"):
        strategy.local_steps = 2
    flat = FedHetStrategy(local_steps=2, seed=1)
    assert (flat.spec.local_steps, flat.spec.seed) == (2, 1)


def test_a_spec_and_flat_settings_together_are_refused():
    with pytest.raises(TypeError, match="as spec= or as keyword arguments, not both: got spec= and local_steps, seed"):
        FedHetStrategy(local_steps=2, seed=1, spec=FederationSpec())
    with pytest.raises(TypeError, match=r"FedHetStrategy\(spec=...\) takes a FederationSpec, got dict"):
        FedHetStrategy(spec={"local_steps": 2})
    # a flat argument equal to its default is no conflict (LightningCLI passes every argument)
    FedHetStrategy(local_steps=1, engine="auto", spec=FederationSpec(local_steps=3))


def test_the_many_process_strategy_takes_a_spec_and_refuses_what_it_cannot_run():
    strategy = FedHetDDPStrategy(spec=FederationSpec(local_steps=2, engine="vmap"))
    assert (strategy.engine, strategy.local_steps, strategy.compile) == ("vmap", 2, False)
    with pytest.raises(ValueError, match="FedHetDDPStrategy takes engine='sequential' or 'vmap'"):
        FedHetDDPStrategy(spec=FederationSpec(engine="auto"))
    # the spec's default engine is 'auto': the message says to name one
    with pytest.raises(ValueError, match=r"name one, in a FederationSpec too \(its default is 'auto'\)"):
        FedHetDDPStrategy(spec=FederationSpec())
    with pytest.raises(ValueError, match="placement='balanced' cannot keep optimizer_state='persist'"):
        FedHetDDPStrategy(placement="balanced", spec=FederationSpec(optimizer_state="persist", engine="sequential"))


def _datamodule():
    return FederatedDataModule(toy_dataset(48), [np.arange(i * 8, (i + 1) * 8) for i in range(6)], batch_size=4)


def _settings():
    return dict(algorithm=FedVARP(), participation=Bernoulli(0.6), local_steps=UniformSteps(1, 3),
                channel=LossyChannel(uplink=0.2), seed=5)


def test_a_spec_trains_what_the_flat_arguments_train():
    runs = []
    for strategy in (FedHetStrategy(**_settings()), FedHetStrategy(spec=FederationSpec(**_settings()))):
        torch.manual_seed(0)
        model = TinyClassifier()
        quiet_trainer(strategy=strategy, max_epochs=3).fit(model, datamodule=_datamodule())
        runs.append(strategy)
    flat, spec = runs
    assert torch.equal(flat.global_params, spec.global_params)
    assert [r["received"].tolist() for r in flat.history] == [r["received"].tolist() for r in spec.history]


def test_fit_seeds_takes_a_spec():
    def build(seed, as_spec):
        settings = dict(algorithm=FedAvg(), participation=Bernoulli(0.7), local_steps=2, seed=seed)
        return TinyClassifier(), _datamodule(), FederationSpec(**settings) if as_spec else FedHetStrategy(**settings)

    by_spec = fit_seeds(lambda seed: build(seed, True), seeds=[0, 1], rounds=2)
    by_strategy = fit_seeds(lambda seed: build(seed, False), seeds=[0, 1], rounds=2)
    for a, b in zip(by_spec, by_strategy):
        assert isinstance(a.strategy, FedHetStrategy) and torch.equal(a.global_params, b.global_params)


def test_the_server_is_built_from_client_sizes_when_the_clients_train_elsewhere():
    sizes = [5, 0, 7, 3]
    spec = FederationSpec(participation=Bernoulli(0.8), selection=UniformSample(2), local_steps=[1, 2, 3, 1],
                          client_weights="samples")
    server = spec.build_server(torch.zeros(3), 3, seed=2, client_sizes=sizes)
    assert server.streams is None and server.client_sizes.tolist() == sizes
    streams = ClientStreams(None, [np.arange(n) for n in sizes], batch_size=2, seed=2)
    with_data = FederationSpec(participation=Bernoulli(0.8), selection=UniformSample(2), local_steps=[1, 2, 3, 1],
                               client_weights="samples").build_server(torch.zeros(3), 3, seed=2, streams=streams)
    for t in range(4):
        plan, reference = server.begin_round(t), with_data.begin_round(t)
        # the same plan, without mini-batches (nobody trains here)
        assert torch.equal(plan.trained, reference.trained) and plan.schedule == reference.schedule
        assert plan.batches == [] and len(reference.batches) == len(reference.schedule)
        for client in plan.trained_ids:
            server.submit(client, torch.ones(3), 0.5)
            with_data.submit(client, torch.ones(3), 0.5)
        assert torch.equal(server.close_round(), with_data.close_round())
    assert server.history[-1]["weights"] == with_data.history[-1]["weights"]


def test_a_round_planner_takes_streams_or_sizes():
    streams = ClientStreams(None, [np.arange(2)], batch_size=1)
    for kwargs in ({}, {"streams": streams, "client_sizes": [2]}):
        with pytest.raises(ValueError, match="streams or their client_sizes"):
            RoundPlanner(Full(), FedAvg(), **kwargs)
    with pytest.raises(ValueError, match="client_sizes"):
        RoundPlanner(Full(), FedAvg(), client_sizes=[2, -1])
