"""FederationSpec by hand: the exact messages of its checks, the Lightning dataloader's settings carried into the
client streams, every setting handed to the Server it builds, and spec= against flat arguments. Written for the
survivors of the ``spec`` mutation chunk (docs/testing.md): each case names the slip it catches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_fedhet import FederatedDataModule, FederationSpec, FedHetStrategy, UniformSample
from lightning_fedhet.participation import Bernoulli, Full
from lightning_fedhet.spec import SpecSetting
from lightning_fedhet.system import LossyChannel, ShiftedExponential, UniformSteps
from tests.helpers import toy_dataset


def _refused(error: type[Exception], **settings) -> str:
    with pytest.raises(error) as refused:
        FederationSpec(**settings)
    return str(refused.value)


def test_the_settings_errors_name_the_setting_whole():
    # the checks' messages, read back whole: a check that names another setting sends the user to the wrong one
    assert _refused(ValueError, num_clients=0) == "num_clients must be an integer >= 1, got 0"
    # a max_update_norm that is no number is refused (the range check sees numbers only; the server's check the rest)
    assert _refused(TypeError, max_update_norm="1.0") == "max_update_norm must be a number > 0 or None, got '1.0'"
    assert _refused(TypeError, max_update_norm=True) == "max_update_norm must be a number > 0 or None, got True"


@pytest.mark.without_compiler  # the engine's settings are checked, nothing is compiled
def test_an_engine_refuses_what_it_cannot_run_when_the_spec_is_made():
    # (test_spec.py's cases of these carry 'compile' in their ids, which mutation runs leave out)
    assert _refused(ValueError, engine="sequential", compile=True) == (
        "compile=True is not supported by engine='sequential'; use engine='vmap'")
    assert _refused(ValueError, engine="auto", compile="fastest").startswith("compile must be False, True or one of")
    assert FederationSpec(engine="vmap", compile="max-autotune").compile == "max-autotune"


def test_a_deadline_with_a_latency_model_is_accepted():
    latency = ShiftedExponential()
    spec = FederationSpec(deadline=2.0, latency=latency)
    assert spec.deadline == 2.0 and spec.latency is latency


def test_a_per_round_draw_of_local_steps_is_checked_against_num_clients():
    # the draw is asked for once, for round 0, to check its length: a per-client range of the wrong length is refused
    assert FederationSpec(num_clients=3, local_steps=UniformSteps(1, 3)).num_clients == 3
    with pytest.raises(ValueError, match="local_steps"):
        FederationSpec(num_clients=3, local_steps=UniformSteps([1, 1], [2, 2]))


# ------------------------------------------------------------------ the client streams from Lightning's dataloader
def _datamodule(clients: int = 6) -> FederatedDataModule:
    return FederatedDataModule(toy_dataset(6 * clients), [np.arange(6 * i, 6 * (i + 1)) for i in range(clients)],
                               batch_size=2)


def test_client_streams_refuse_what_they_cannot_split_with_the_messages_users_get():
    with pytest.raises(TypeError) as refused:
        FederationSpec().client_streams([1, 2], _datamodule(), seed=0)
    assert str(refused.value) == "FedHetStrategy needs the train dataloader to be a torch DataLoader, got list"
    loader = DataLoader(toy_dataset(36), batch_size=2)
    with pytest.raises(ValueError) as refused:
        FederationSpec(num_clients=4).client_streams(loader, _datamodule(6), seed=0)
    assert str(refused.value) == "num_clients=4 but the FederatedDataModule holds 6 clients"
    assert len(FederationSpec(num_clients=6).client_streams(loader, _datamodule(6), seed=0).client_indices) == 6
    with pytest.raises(ValueError) as refused:
        FederationSpec().client_streams(loader, object(), seed=0)  # a plain datamodule and no partitioner
    assert str(refused.value) == (
        "FedHetStrategy does not know how to split the training data: use a FederatedDataModule, or pass "
        "FedHetStrategy(num_clients=..., partitioner=IID() | Dirichlet(alpha) | index lists)")


def _collate(rows):
    return rows


def test_client_streams_keep_the_dataloaders_settings_and_the_seed():
    dataset = toy_dataset(36)
    loader = DataLoader(dataset, batch_size=4, collate_fn=_collate, num_workers=2, pin_memory=True)
    streams = FederationSpec().client_streams(loader, _datamodule(), seed=7)
    assert (streams.batch_size, streams.seed, streams.num_workers, streams.pin_memory) == (4, 7, 2, True)
    assert streams.collate_fn is _collate and streams.dataset is dataset


def test_client_streams_take_the_batch_size_of_a_batch_sampler_else_one():
    dataset = toy_dataset(36)
    # DataLoader(batch_sampler=...) sets batch_size to None: the sampler's own batch size is the one
    sampled = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 3, drop_last=False))
    assert sampled.batch_size is None
    assert FederationSpec().client_streams(sampled, _datamodule(), seed=0).batch_size == 3
    # a batch sampler without a batch_size (here, a list of index lists): one sample per batch
    listed = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    assert FederationSpec().client_streams(listed, _datamodule(), seed=0).batch_size == 1


# ------------------------------------------------------------------ the server it builds
def test_the_server_gets_every_setting_of_the_spec():
    selection, channel, latency = UniformSample(2), LossyChannel(uplink=0.2), ShiftedExponential()
    spec = FederationSpec(participation=Bernoulli(0.8), selection=selection, channel=channel, latency=latency,
                          deadline=3.0, optimizer_state="persist", max_update_norm=2, update_norm_action="clip")
    init_ints = torch.tensor([4, 5])
    server = spec.build_server(torch.zeros(3), 2, seed=1, client_sizes=[2, 2, 2, 2], init_ints=init_ints)
    planner = server.planner
    assert planner.selection is selection and planner.channel is channel and planner.latency is latency
    assert planner.clock.deadline == 3.0 and planner.participation is spec.participation
    assert (server.optimizer_state, server.max_update_norm, server.update_norm_action) == ("persist", 2.0, "clip")
    assert server.global_ints.tolist() == [4, 5]
    # the run's wrapped participation (the Flower bridge's) stands in for the spec's
    wrapped = Full()
    assert spec.build_server(torch.zeros(3), 2, seed=1, client_sizes=[2, 2, 2, 2],
                             participation=wrapped).planner.participation is wrapped


def test_the_server_weighs_clients_by_their_samples_when_the_spec_says_so():
    # two clients holding 1 and 3 samples send models [4, 0] and [0, 4]: by samples the mean is
    # (1 [4, 0] + 3 [0, 4]) / 4 = [1, 3]; uniform weights would give [2, 2]
    for weights, expected in (("samples", [1.0, 3.0]), ("uniform", [2.0, 2.0])):
        server = FederationSpec(client_weights=weights).build_server(torch.zeros(2), 2, seed=0, client_sizes=[1, 3])
        server.begin_round(0)
        server.submit(0, torch.tensor([4.0, 0.0]), 0.5)
        server.submit(1, torch.tensor([0.0, 4.0]), 0.5)
        assert server.close_round().tolist() == expected, weights


# ------------------------------------------------------------------ spec= against flat arguments
def test_a_flat_argument_conflicts_with_a_spec_unless_it_equals_its_default_in_type_and_value():
    # LightningCLI passes every argument: one equal to its default (an equal string made at run time, not the same
    # object) is no conflict; one of another type (True for the int 1) is a setting, and conflicts
    FedHetStrategy(engine="".join(["au", "to"]), spec=FederationSpec())
    with pytest.raises(TypeError) as refused:
        FedHetStrategy(local_steps=True, spec=FederationSpec())
    assert str(refused.value) == (
        "FedHetStrategy takes the federation's settings as spec= or as keyword arguments, not both: got spec= and "
        "local_steps (set them in the FederationSpec)")


def test_a_strategys_settings_are_the_specs_and_the_class_shows_the_descriptor():
    # on the class (documentation tools, LightningCLI's introspection) the attribute is the descriptor itself
    assert isinstance(FedHetStrategy.local_steps, SpecSetting)
    assert FedHetStrategy.local_steps.setting == "local_steps"
    assert FedHetStrategy.optimizer_state_mode.setting == "optimizer_state"  # a strategy name of its own
    strategy = FedHetStrategy(spec=FederationSpec(optimizer_state="persist", seed=3))
    assert (strategy.optimizer_state_mode, strategy.seed_argument, strategy.local_steps) == ("persist", 3, 1)
