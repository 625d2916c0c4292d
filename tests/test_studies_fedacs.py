"""The FedACS study module (scripts/studies/fedacs.py): the paper's FedVarp (eq. 114) by hand, and a 2-round run."""


import numpy as np
import pytest
import torch
from studies import fedacs

from lightning_fedhet.algorithms import ClientInfo
from lightning_fedhet.experiments import Cell


def test_paper_fedvarp_fills_a_lost_upload_with_the_last_received_update():
    # Eq. (114) transcribed: X += s (1/K) [sum_received c_m D_m^r + sum_lost c_m D_m^{r'_m}], s = sum w s a / sum w a.
    # Slips it catches: the SAGA form (memory of every client added), dividing by the arrivals, no calibration.
    K, s, a = 20, [1.0, 0.5], [1, 3]
    scale = (0.5 * 1.0 * 1 + 0.5 * 0.5 * 3) / (0.5 * 1 + 0.5 * 3)  # 0.625
    algo = fedacs.PaperFedVarp(K)
    algo.setup(num_clients=2, init_params=torch.zeros(1), client_weights=torch.tensor([0.5, 0.5]))
    rng = np.random.default_rng(0)
    expected = 0.0
    for t, arrivals in enumerate(({0: 1.0, 1: 10.0}, {0: 2.0})):
        algo.observe_system(t, success_probs=s, local_steps=a)
        counts = algo.select(t, torch.tensor([True, True]), rng).tolist()
        assert all(c > 0 for c in counts)
        algo.open_round(t, None)
        for m, d in arrivals.items():
            algo.add(m, torch.tensor([d]), ClientInfo(num_samples=1, local_steps=a[m]))
        w = algo.close_round()
        fresh = sum(counts[m] / K * d for m, d in arrivals.items())
        stale = counts[1] / K * 10.0 if 1 not in arrivals else 0.0  # client 1's round-0 update stands in
        expected += scale * (fresh + stale)
        assert float(w) == pytest.approx(expected)


def test_epoch_steps_are_epochs_times_batches_per_epoch():
    # client sizes 120 and 30 at B = 50: 3 and 1 mini-batches per epoch; static epochs 1 and 3
    steps = fedacs.EpochSteps(np.array([3, 1]), epochs=np.array([1, 3]))
    assert steps.sample(0, 2, 0).tolist() == [3, 3]
    drawn = fedacs.EpochSteps(np.array([3, 1]), low=[1, 20], high=[10, 30]).sample(5, 2, 0)
    assert drawn[0] % 3 == 0 and 1 <= drawn[0] // 3 <= 10 and 20 <= drawn[1] <= 30


@pytest.mark.parametrize("method", ["FedACS", "FedVarp"])
def test_run_cell_two_rounds_on_a_tiny_stand_in(method):
    config = {**fedacs.BASE, "heterogeneity": fedacs.heterogeneity("dynamic"), "rounds": 2, "per_client": 10,
              "test_size": 50, "synthetic_data": True}
    out = fedacs.run_cell(Cell("dynamic", method, config), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and len(m["val_acc"]) == 2 and len(m["local_steps"]) == 2
    assert all(0.0 <= v <= 1.0 for v in m["val_acc"]) and all(r <= t for r, t in zip(m["received"], m["trained"]))
