"""The with-replacement samplers' shared parts (FedACS, SampledFedAvg, c-a-FedAvg, OS), by hand: the EMA system
estimator, options, and the state a checkpoint restores.

Written against the survivors of the ``fedacs`` mutation chunk (docs/testing.md).
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import FedACS
from lightning_fedhet.algorithms._sampler import SystemEstimator
from tests.algorithms.selection_rounds import F64, drive


def test_system_estimator_priors_and_what_counts_as_an_observation():
    # Before any round: s = pi = 1 and ||a||_1 = 1 (priors). A norm of 0 or nan is not an observation; a round
    # without availability leaves pi alone. Rate 1/2 with bias correction: the first observation is taken as is.
    est = SystemEstimator(rate=0.5)
    est.setup(3)
    for estimate in (est.success(), est.availability(), est.norms()):
        torch.testing.assert_close(estimate, torch.ones(3, dtype=F64))
    drawn = torch.tensor([True, True, False])
    arrived = torch.tensor([True, False, False])
    est.update(drawn, arrived, None, torch.tensor([4.0, 0.0, float("nan")], dtype=F64))
    torch.testing.assert_close(est.success(), torch.tensor([1.0, 0.0, 1.0], dtype=F64))
    torch.testing.assert_close(est.availability(), torch.ones(3, dtype=F64))
    torch.testing.assert_close(est.norms(), torch.tensor([4.0, 4.0, 4.0], dtype=F64))  # unseen: the seen mean
    # second round, client 0 drawn and lost: v = 0.5 * 0.5 + 0.5 * 0 = 0.25, u = 0.5 * 0.5 + 0.5 = 0.75 -> s = 1/3
    est.update(torch.tensor([True, False, False]), torch.zeros(3, dtype=torch.bool), torch.tensor([True, False, True]),
               None)
    assert float(est.success()[0]) == pytest.approx(1 / 3)
    torch.testing.assert_close(est.availability(), torch.tensor([1.0, 0.0, 1.0], dtype=F64))
    assert SystemEstimator().rate == 0.1
    with pytest.raises(ValueError, match=r"^ema \(the estimator's rate\) must lie in \(0, 1\], got 0.0$"):
        SystemEstimator(rate=0.0)
    with pytest.raises(ValueError, match=r"^ema \(the estimator's rate\) must lie in \(0, 1\], got 1.5$"):
        SystemEstimator(rate=1.5)


def test_a_restored_sampler_shows_the_saved_round_state():
    # After load_state_dict the public per-round attributes are the saved ones (studies read them after a resume).
    algo = FedACS(K=3, estimator="ema")
    algo.setup(5, torch.tensor([0.1, -0.2, 0.3], dtype=F64), torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]))
    drive(algo, 0, 3)
    restored = FedACS(K=3, estimator="ema")
    restored.load_state_dict(algo.state_dict())
    for name in ("last_probabilities", "last_counts"):
        torch.testing.assert_close(getattr(restored, name), getattr(algo, name))
    assert restored.last_system.keys() == algo.last_system.keys()
    for key, value in algo.last_system.items():
        torch.testing.assert_close(restored.last_system[key], value)
    torch.testing.assert_close(restored.estimator.success(), algo.estimator.success())
    with pytest.raises(ValueError, match=r"^state was saved with estimator='ema' but this rule has estimator=None"):
        FedACS(K=3).load_state_dict(algo.state_dict())


def test_fedacs_keeps_its_local_solver_and_checks_the_optimizer_against_it():
    algo = FedACS(K=2, prox_mu=0.5, local_lr=0.2, min_success=0.01)
    assert algo.local_lr == 0.2 and algo.min_success == 0.01
    assert algo.hparams()["local_lr"] == 0.2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"local_lr=0\.2\) does not match the optimizer's lr=0\.1"):
        algo.check_client_solver(optimizer, "reset")


def test_hparams_report_the_constructor_arguments():
    from lightning_fedhet.algorithms import OS, CAFedAvg, SampledFedAvg

    assert FedACS(K=3, omega=[0.5, 0.5], momentum=0.5, calibrate=True, estimator="ema", ema=0.2, unavailable="drop",
                  server_lr=0.5).hparams() == {
        "K": 3, "unavailable": "drop", "server_lr": 0.5, "estimator": "ema", "ema": 0.2, "omega": [0.5, 0.5],
        "momentum": 0.5, "prox_mu": 0.0, "local_lr": None, "calibrate": "client"}
    assert FedACS(K=1).hparams() == {"K": 1, "unavailable": "renormalize", "server_lr": 1.0}
    assert SampledFedAvg(K=2, probabilities=[0.25, 0.75]).hparams() == {
        "K": 2, "unavailable": "renormalize", "server_lr": 1.0, "probabilities": [0.25, 0.75]}
    assert CAFedAvg(K=2, calibrate=True).hparams() == {"K": 2, "unavailable": "renormalize", "server_lr": 1.0,
                                                       "calibrate": "client"}
    assert OS(K=2, mix=0.3).hparams() == {"K": 2, "unavailable": "renormalize", "server_lr": 1.0, "mix": 0.3}
