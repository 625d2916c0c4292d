"""FedACS's logged hyper-parameters (what W&B and the loggers record of the rule) and the names its helpers' errors
give, written out by hand."""

from __future__ import annotations

import pytest

from lightning_fedhet.algorithms import FedACS
from lightning_fedhet.algorithms.fedacs import chi_square


def test_defaults_log_the_sampler_settings_only():
    assert FedACS(3).hparams() == {"K": 3, "unavailable": "renormalize", "server_lr": 1.0}


def test_target_weights_and_momentum_are_logged_with_the_local_lr():
    assert FedACS(3, omega=[0.25, 0.75], momentum=0.9, local_lr=0.1).hparams() == {
        "K": 3, "unavailable": "renormalize", "server_lr": 1.0, "omega": [0.25, 0.75],
        "momentum": 0.9, "prox_mu": 0.0, "local_lr": 0.1,
    }


def test_a_proximal_term_alone_logs_the_local_solver_too():
    assert FedACS(3, prox_mu=0.01, local_lr=0.1).hparams() == {
        "K": 3, "unavailable": "renormalize", "server_lr": 1.0, "momentum": 0.0, "prox_mu": 0.01, "local_lr": 0.1,
    }


def test_calibration_and_the_estimator_are_logged_when_set():
    hp = FedACS(3, estimator="ema", ema=0.2, calibrate=True, calibration_cap=2.0).hparams()
    assert hp == {"K": 3, "unavailable": "renormalize", "server_lr": 1.0, "estimator": "ema", "ema": 0.2,
                  "calibrate": "client", "calibration_cap": 2.0}


def test_chi_square_names_omega_in_its_error():
    with pytest.raises(ValueError, match=r"^omega must lie in \[0, inf\], got -1.0$"):
        chi_square([-1.0, 2.0], [0.5, 0.5])
