"""The heterogeneity layer inside real Lightning runs: channel, local-step draws, latency, recipes."""

import numpy as np
import pytest
import torch

from lightning_fedhet import Dirichlet, FedAvg, FederatedDataModule, FedHetStrategy, UniformSample
from lightning_fedhet.algorithms import FedStale, FedVARP
from lightning_fedhet.participation import Bernoulli, LabelCorrelated, Markov
from lightning_fedhet.system import LossyChannel, ShiftedExponential, UniformSteps
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _dm(n=240, clients=12):
    return FederatedDataModule(toy_dataset(n), Dirichlet(1.0), num_clients=clients, batch_size=8)


class CountingClassifier(TinyClassifier):
    """Counts the local steps each client really runs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps_run: dict[tuple[int, int], int] = {}

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        server = strategy.server
        key = (server.plan.round, server.current_client)
        self.steps_run[key] = self.steps_run.get(key, 0) + 1
        return super().training_step(batch, batch_idx)


def _fit(strategy, rounds, model=None, dm=None):
    model = model or TinyClassifier()
    quiet_trainer(strategy=strategy, max_epochs=rounds).fit(model, datamodule=dm or _dm())
    return model


def _ids(t):
    return set(t.tolist())


def test_lossy_channel_in_the_loop_matches_independent_draws():
    channel = LossyChannel(uplink=0.3, downlink=0.2)
    # the sequential engine: CountingClassifier reads which client is training at each step
    strategy = FedHetStrategy(participation=Bernoulli(0.7), channel=channel, local_steps=2, seed=5,
                              engine="sequential")
    model = _fit(strategy, rounds=8, model=CountingClassifier())

    reference = LossyChannel(uplink=0.3, downlink=0.2)
    reference.setup(12, 5)
    for h in strategy.history:
        t = h["round"]
        selected = torch.zeros(12, dtype=torch.bool)
        selected[h["selected"]] = True
        got_model = reference.downlink(t, selected)
        arrived = reference.uplink(t, got_model)
        assert _ids(h["selected"]) == _ids(h["available"])
        assert set(h["local_steps"]) == _ids(torch.nonzero(got_model).flatten())
        assert _ids(h["received"]) == _ids(torch.nonzero(arrived).flatten())
        # a lost downlink trains nothing; a lost uplink's steps are wasted
        assert {c for (r, c) in model.steps_run if r == t} == set(h["local_steps"])
        lost_up = set(h["local_steps"]) - _ids(h["received"])
        assert h["wasted_steps"] == 2 * len(lost_up)
        assert h["upload_bytes"] == len(h["local_steps"]) * strategy.flat.dim * 4
    assert sum(len(h["selected"]) - len(h["local_steps"]) for h in strategy.history) > 0
    assert sum(h["wasted_steps"] for h in strategy.history) > 0


def test_dynamic_local_steps_run_exactly_as_drawn():
    steps = UniformSteps(1, 6)
    strategy = FedHetStrategy(participation=UniformSample(5), local_steps=steps, seed=2, engine="sequential")
    model = _fit(strategy, rounds=5, model=CountingClassifier())
    drawn_any_difference = False
    for h in strategy.history:
        expected = steps.sample(h["round"], 12, 2)
        for client, k in h["local_steps"].items():
            assert k == expected[client]
            assert model.steps_run[(h["round"], client)] == k
        drawn_any_difference |= len(set(h["local_steps"].values())) > 1
    assert drawn_any_difference


def test_per_client_local_steps_array():
    per_client = np.arange(1, 13)
    strategy = FedHetStrategy(local_steps=per_client, participation=UniformSample(4))
    _fit(strategy, rounds=2)
    for h in strategy.history:
        assert all(k == per_client[c] for c, k in h["local_steps"].items())


def test_latency_drives_sim_time_and_deadline_drops_late_clients():
    latency = ShiftedExponential(shift=0.5, mean=1.0)
    channel = LossyChannel(uplink=0.3)
    strategy = FedHetStrategy(
        participation=UniformSample(6), latency=latency, channel=channel, local_steps=2, deadline=5.0, seed=1
    )
    _fit(strategy, rounds=12)
    reference = ShiftedExponential(shift=0.5, mean=1.0)
    reference.setup(12, 1)
    uplink = LossyChannel(uplink=0.3)
    uplink.setup(12, 1)
    total = 0.0
    dropped = lost_only = 0
    for h in strategy.history:
        trained = torch.zeros(12, dtype=torch.bool)
        trained[list(h["local_steps"])] = True
        times = reference.sample(h["round"], trained, 2)
        uploaded = {c for c in torch.nonzero(uplink.uplink(h["round"], trained)).flatten().tolist()}
        on_time = {c for c in h["local_steps"] if times[c] <= 5.0}
        assert _ids(h["received"]) == on_time & uploaded
        if len(on_time) < len(h["local_steps"]):
            total += 5.0  # the server waited for late clients until the deadline
        else:
            total += max(times[c] for c in (on_time & uploaded or set(h["local_steps"])))
            lost_only += bool(set(h["local_steps"]) - uploaded)
        assert h["sim_time"] == pytest.approx(total)
        dropped += len(h["local_steps"]) - len(on_time)
    assert dropped > 0 and lost_only > 0


def test_deadline_without_latency_is_rejected():
    with pytest.raises(ValueError, match="deadline"):
        _fit(FedHetStrategy(deadline=1.0), rounds=1)


def test_label_correlated_recipe_gets_the_clients_label_histograms():
    participation = Bernoulli(LabelCorrelated(mean=0.5, floor=0.1))
    # seed=0 explicitly: seed=None takes Lightning's global seed, which an earlier test's seed_everything may have set
    strategy = FedHetStrategy(participation=participation, local_steps=1, seed=0)
    dm = _dm()
    _fit(strategy, rounds=2, dm=dm)
    labels = dm.train_dataset.tensors[1].numpy()
    hist = np.stack([np.bincount(labels[idx], minlength=3) for idx in dm.client_indices])
    expected = LabelCorrelated(mean=0.5, floor=0.1).probabilities(hist, 0)
    np.testing.assert_allclose(participation.p.numpy(), expected)


def _stale_run(algorithm, rounds=20):
    strategy = FedHetStrategy(algorithm=algorithm, participation=Markov(p=0.4, lam=0.5), local_steps=2, seed=4)
    return flat_params(_fit(strategy, rounds=rounds)), strategy


class RecordingFedVARP(FedVARP):
    """FedVARP that keeps w_0, each round's p_i and every absorbed delta, to replay them through the paper's rule."""

    def setup(self, num_clients, init_params, client_weights=None, client_sizes=None):
        super().setup(num_clients, init_params, client_weights, client_sizes)
        self.w0 = init_params.detach().clone()
        self.record = []

    def open_round(self, round, ctx):
        super().open_round(round, ctx)
        self.record.append((ctx.participation_probs.clone(), {}))

    def add(self, client, delta, info):
        self.record[-1][1][client] = delta.detach().clone()
        super().add(client, delta, info)


def _u_fedvarp(w0, record):
    """FedStale paper Eq. 7 written out (uniform 1/N; empty rounds skipped as in the reference codes), in fp64:
    w += (1/N) sum_i h_i + (1/N) sum_{i in S} (Delta_i - h_i) / p_i, then h_i <- Delta_i for i in S."""
    w = w0.to(torch.float64)
    n = len(record[0][0])
    h = [torch.zeros_like(w) for _ in range(n)]
    for p, deltas in record:
        if deltas:
            w = w + sum(h) / n + sum((d.to(torch.float64) - h[i]) / float(p[i]) for i, d in deltas.items()) / n
        for i, d in deltas.items():
            h[i] = d.to(torch.float64)
    return w


def test_fedstale_beta_0_is_unbiased_fedavg_and_fedvarp_known_p_is_the_paper_rule_over_20_real_rounds():
    w_stale0, s0 = _stale_run(FedStale(beta=0.0))
    w_known, _ = _stale_run(FedAvg(weighting="known_p"))
    torch.testing.assert_close(w_stale0, w_known, atol=1e-6, rtol=0)
    varp = RecordingFedVARP(weighting="known_p")
    w_stale1, s1 = _stale_run(varp)
    assert len(varp.record) == 20 and sum(1 for _, deltas in varp.record if deltas) >= 10
    torch.testing.assert_close(w_stale1.to(torch.float64), _u_fedvarp(varp.w0, varp.record), atol=1e-6, rtol=0)
    # and the two families really differ on this run
    assert (w_stale0 - w_stale1).abs().max() > 1e-3
    # the stale memory's size is reported every round: N x d fp32; none for beta = 0
    d = s1.flat.dim
    assert all(h["memory_bytes"] == 12 * d * 4 for h in s1.history)
    assert all(h["memory_bytes"] == 0 for h in s0.history)
    assert any(len(h["received"]) < 12 for h in s1.history)
