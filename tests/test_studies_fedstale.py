"""The FedStale study module (scripts/studies/fedstale.py): the label swap of the low group, and a 2-round run."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness  # noqa: E402
from studies import fedstale  # noqa: E402

from lightning_fedhet.data import IID  # noqa: E402

TINY = {**fedstale.BASE, "beta": 0.5, "rounds": 2, "eval_every": 1, "metric_window_rounds": 2, "test_per_client": 10,
        "synthetic_data": True}


def test_only_the_low_group_swaps_and_its_test_shards_carry_the_same_swap():
    # sigma = 1: every class-0 sample of a low-group client reads 1 and vice versa, in training and test shards;
    # high-group labels are untouched. Slips it catches: swapping the always-on group, swapping every client (the
    # code's reading), leaving the test shards unswapped (accuracy would then not measure the clients' objective).
    config = {**TINY, "sigma": 1.0}
    data = fedstale.datamodule(config, seed=3)
    low = fedstale.groups(config).low_group(config["num_clients"], 3)
    assert low.sum() == 12
    original = fedstale._stand_in(24 * 20, 24 * 10)[0].tensors[1].numpy()
    swapped = data.train_dataset.tensors[1].numpy()
    for client, idx in enumerate(data.client_indices):
        before, after = original[idx], swapped[idx]
        if low[client]:
            expect = np.where(before == 0, 1, np.where(before == 1, 0, before))
        else:
            expect = before
        assert np.array_equal(after, expect)
    # test shards: an IID split into 24 shards of 10 images; exactly the class-0/1 images of the low group's shards
    # changed label (the stand-in test set has 240 images, all picked, in order)
    val_y = data.val_dataset.tensors[1].numpy()
    true_y = fedstale._stand_in(24 * 20, 24 * 10)[1].tensors[1].numpy()
    shards = IID().split(true_y, 24, 3)
    assert sorted(len(s) for s in shards) == [10] * 24
    expect = np.zeros(240, dtype=bool)
    for client, idx in enumerate(shards):
        expect[idx] = low[client] & np.isin(true_y[idx], [0, 1])
    assert np.array_equal(val_y != true_y, expect)
    assert np.array_equal(val_y[expect], 1 - true_y[expect])


def test_run_cell_two_rounds_on_a_tiny_stand_in():
    out = fedstale.run_cell(harness.Cell(fedstale.SETTING, "beta=0.5", TINY), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and len(m["val_acc"]) == 2 and all(0.0 <= v <= 1.0 for v in m["val_acc"])
    # the 12 always-on clients arrive every round
    assert all(12 <= r <= 24 and r - lo == 12 for r, lo in zip(m["received"], m["received_low"]))
    assert len(out["config"]["low_group"]) == 12
    record = {"metrics": m, "config": {**TINY, **out["config"]}}
    assert fedstale.final_acc(record) == np.mean(m["val_acc"])
