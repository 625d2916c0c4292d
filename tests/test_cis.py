"""Fed-CIS topologies (serving-rate recurrence, presets) and cooperative-inference accuracy."""

from __future__ import annotations

import math

import pytest
import torch
from lightning_fedhet.callbacks import CISAccuracy, cis_accuracy, cis_evaluate, exit_confidence
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedhet.cis import PARTITIONS, SERVING_SETTINGS, CISTopology
from lightning_fedhet.early_exit_module import EarlyExitClassifier
from tests.helpers import quiet_trainer

torch.set_num_threads(1)

# spec §2.7 table (released-code specs, 7-node tree): served per leaf / mid / root and totals per exit
SEVEN_NODE_TABLE = {
    "80-15-5": ((2.0, 0.75, 0.5), (8, 1.5, 0.5)),
    "60-30-10": ((1.5, 1.5, 1.0), (6, 3, 1)),
    "45-35-20": ((1.125, 1.75, 2), (4.5, 3.5, 2)),
    "33-33-33": ((1, 2, 4), (4, 4, 4)),
    "20-35-45": ((0.5, 1.75, 4.5), (2, 3.5, 4.5)),
    "10-30-60": ((0.25, 1.5, 6), (1, 3, 6)),
    "5-15-80": ((0.125, 0.75, 8), (0.5, 1.5, 8)),
}
# leaf transfer cap, mid transfer cap (same table)
SEVEN_NODE_CAPS = {
    "80-15-5": (0.5, 0.25), "60-30-10": (1, 0.5), "45-35-20": (1.375, 1), "33-33-33": (2, 2),
    "20-35-45": (2, 2.25), "10-30-60": (2.25, 3), "5-15-80": (2.375, 4),
}  # fmt: skip


@pytest.mark.parametrize("serving", SERVING_SETTINGS)
def test_seven_node_serving_rates_match_spec_table(serving):
    topo = CISTopology.preset("7-node", serving)
    per_node, totals = SEVEN_NODE_TABLE[serving]
    assert topo.serving_rates().tolist() == pytest.approx(totals, abs=1e-12)
    served = topo.node_serving_rates()
    assert served[3:].tolist() == pytest.approx([per_node[0]] * 4)  # leaves 3..6
    assert served[1:3].tolist() == pytest.approx([per_node[1]] * 2)  # mid 1, 2
    assert float(served[0]) == pytest.approx(per_node[2])  # root
    pct = [float(p) for p in serving.split("-")]
    assert topo.serving_rates(normalize=True).tolist() == pytest.approx([p / sum(pct) for p in pct])
    # the caps that from_serving derives (proportional serving per level) are the released spec values
    derived = CISTopology.from_serving(topo.children, topo.max_exit, topo.arrival, serving)
    assert derived.transfer_rates()[[3, 1]].tolist() == pytest.approx(SEVEN_NODE_CAPS[serving])
    assert derived.serving_rates().tolist() == pytest.approx(totals)


@pytest.mark.parametrize("serving", SERVING_SETTINGS)
def test_seventeen_node_presets(serving):
    topo = CISTopology.preset("17-node", serving)
    assert topo.num_nodes == 17 and len(topo.leaves) == 12 and topo.roots == (0,)
    assert topo.children[0] == (1, 2, 3, 4) and all(len(topo.children[m]) == 3 for m in range(1, 5))
    assert float(topo.arrival.sum()) == 12.0
    pct = [float(p) for p in serving.split("-")]
    assert topo.serving_rates(normalize=True).tolist() == pytest.approx([p / sum(pct) for p in pct], abs=1e-12)
    if serving == "60-30-10":  # released spec: leaf cap 0.4 -> 12*0.6 = 7.2; mid in 1.2, cap 0.3 -> 4*0.9 = 3.6
        assert topo.serving_rates().tolist() == pytest.approx([7.2, 3.6, 1.2])


def test_partitions_and_structure():
    eq = CISTopology.preset("7-node", "80-15-5", partition="equal")
    assert eq.data_fraction.tolist() == pytest.approx([1 / 3, 1 / 6, 1 / 6] + [1 / 12] * 4)
    hb = CISTopology.preset("7-node", "80-15-5", partition="highly-biased")
    assert hb.data_fraction.tolist() == pytest.approx([34504 / 45000] + [4480 / 45000] * 2 + [384 / 45000] * 4)
    bi = CISTopology.preset("17-node", "60-30-10", partition="biased")
    assert float(bi.data_fraction[0]) == pytest.approx(4 / 7) and float(bi.data_fraction[5]) == pytest.approx(1 / 84)
    assert set(PARTITIONS) == {"equal", "biased", "highly-biased"}
    assert eq.nodes_with_exit(2) == (1, 2) and eq.parent == (-1, 0, 0, 1, 1, 2, 2)
    assert eq.order.index(3) < eq.order.index(1) < eq.order.index(0)  # children before parents


def test_recurrence_with_interior_arrivals():
    # chain 2 -> 1 -> 0 (exits 1, 2, 3), arrivals 4, 2, 1, caps 3, 5 (root's cap is ignored)
    # node 2: in 4, lambda^t = min(3, 4) = 3, served 1
    # node 1: in 2 + 3 = 5, lambda^t = min(5, 5) = 5, served 0
    # node 0: in 1 + 5 = 6, served 6
    topo = CISTopology([[1], [2], []], [3, 2, 1], [1, 2, 4], [123.0, 5, 3])
    assert topo.transfer_rates().tolist() == [0, 5, 3]
    assert topo.node_serving_rates().tolist() == [6, 0, 1]
    assert topo.serving_rates().tolist() == [1, 0, 6]
    # uncapped leaves forward everything
    assert CISTopology([[1], []], [2, 1], [0, 1], math.inf).serving_rates().tolist() == [0, 1]


@pytest.mark.parametrize(
    "args, match",
    [
        (([[1], []], [1, 1], [0, 1], 0.5), "max_exit"),
        (([[1], []], [2, 0], [0, 1], 0.5), "max_exit"),
        (([[1], []], [2], [0, 1], 0.5), "max_exit"),
        (([[2], [2], []], [2, 2, 1], [0, 0, 1], 0.5), "children"),
        (([[1], [0]], [2, 1], [0, 1], 0.5), "children"),
        (([[5], []], [2, 1], [0, 1], 0.5), "children"),
        (([[1], []], [2, 1], [0, -1], 0.5), "arrival"),
        (([[1], []], [2, 1], [0, 0], 0.5), "arrival"),
        (([[1], []], [2, 1], [0, 1, 2], 0.5), "arrival"),
        (([[1], []], [2, 1], [0, 1], [0, float("nan")]), "transfer_cap"),
        (([[1], []], [2, 1], [0, 1], -1.0), "transfer_cap"),
    ],
)
def test_topology_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        CISTopology(*args)


def test_preset_and_serving_bad_input():
    with pytest.raises(ValueError, match="tree"):
        CISTopology.preset("5-node", "80-15-5")
    with pytest.raises(ValueError, match="serving"):
        CISTopology.preset("7-node", "70-20-10")
    with pytest.raises(ValueError, match="partition"):
        CISTopology.preset("7-node", "80-15-5", partition="iid")
    tree = CISTopology.preset("7-node", "80-15-5")
    args = (tree.children, tree.max_exit, tree.arrival)
    # absolute serving rates must add up to the arrivals (10 here)
    with pytest.raises(ValueError, match="serving rates must sum to the total arrival rate 10"):
        CISTopology.from_serving(*args, [0.8, 0.15, 0.05])
    assert CISTopology.from_serving(*args, [8, 1.5, 0.5]).serving_rates().tolist() == pytest.approx([8, 1.5, 0.5])
    with pytest.raises(ValueError, match="serving"):
        CISTopology.from_serving(*args, "80-20")
    with pytest.raises(ValueError, match="serving"):
        CISTopology.from_serving(*args, "a-b-c")
    # leaf 1 sits directly under the root: exit 2 (node 2, no arrivals, no children) cannot serve anything
    with pytest.raises(ValueError, match="serving is infeasible"):
        CISTopology.from_serving([[1, 2], [], []], [3, 1, 2], [0, 1, 0], "50-30-20")


# ---------------------------------------------------------------- CIS accuracy
def _hand_example():
    """Root 0 (exit 2) with leaves 1 and 2 (exit 1); 4 test points, 2 classes.

    Exit 1 logits/labels: p0 [4,0]/0 correct, p1 [0,1]/1 correct, p2 [0,2]/0 wrong, p3 [0,0]/1 wrong (argmax 0).
    Normalised entropy decreases with |logit gap|, so the easy-to-hard order is p0 (gap 4), p2 (2), p1 (1), p3 (0).
    Exit 2 logits: p1 [1,0] wrong, p3 [0,1] correct (p0, p2 wrong but never reach the root).
    """
    topo = CISTopology([[1, 2], [], []], [2, 1, 1], arrival=[0, 1, 2], transfer_cap=[0, 0.375, 0.5])
    exit1 = torch.tensor([[4.0, 0.0], [0.0, 1.0], [0.0, 2.0], [0.0, 0.0]])
    exit2 = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 0, 1])
    return topo, [exit1, exit2], labels


@pytest.mark.parametrize("confidence", ["norm_entropy", "max_softmax"])
def test_cis_accuracy_hand_computed(confidence):
    topo, logits, labels = _hand_example()
    # Leaf 1: mass 1/4 per point, serves 1 - 0.375 = 0.625: p0 (0.25, ok), p2 (0.25, wrong), half of p1 (0.125, ok)
    #   -> correct 0.375 of 0.625 = 0.6; forwards p1: 0.125, p3: 0.25.
    # Leaf 2: mass 2/4 = 0.5 per point, serves 2 - 0.5 = 1.5: p0 (ok), p2 (wrong), p1 (ok) -> 1.0 of 1.5 = 2/3;
    #   forwards p3: 0.5.
    # Root: p1 0.125 (wrong at exit 2) + p3 0.75 (right) -> 0.75 of 0.875 = 6/7.
    # Overall: (0.375 + 1.0 + 0.75) / 3 = 2.125 / 3 = 0.708333...
    res = cis_evaluate(topo, logits, labels, confidence=confidence)
    assert res.accuracy == pytest.approx(2.125 / 3, abs=1e-12)
    assert res.node_accuracy.tolist() == pytest.approx([6 / 7, 0.6, 2 / 3], abs=1e-12)
    assert res.node_mass.tolist() == pytest.approx([0.875, 0.625, 1.5], abs=1e-12)
    assert res.exit_accuracy.tolist() == pytest.approx([0.5, 0.25])
    assert cis_accuracy(topo, torch.stack(logits), labels, confidence) == pytest.approx(2.125 / 3, abs=1e-12)
    # extra (deeper) exits are ignored
    assert cis_accuracy(topo, logits + [torch.zeros(4, 2)], labels, confidence) == pytest.approx(2.125 / 3)


def test_cis_served_mass_equals_serving_rates_and_extremes():
    topo = CISTopology.preset("7-node", "45-35-20")
    gen = torch.Generator().manual_seed(0)
    n, c = 50, 10
    labels = torch.randint(0, c, (n,), generator=gen)
    logits = [torch.randn(n, c, generator=gen) for _ in range(3)]
    res = cis_evaluate(topo, logits, labels)
    torch.testing.assert_close(res.node_mass, topo.node_serving_rates())
    assert 0.0 <= res.accuracy <= 1.0
    perfect = [torch.nn.functional.one_hot(labels, c).double() * s for s in (1.0, 2.0, 3.0)]
    assert cis_accuracy(topo, perfect, labels) == pytest.approx(1.0)
    wrong = [torch.nn.functional.one_hot((labels + 1) % c, c).double() for _ in range(3)]
    assert cis_accuracy(topo, wrong, labels) == 0.0
    # if every exit agrees, CIS accuracy = that exit's accuracy whatever the serving split
    same = [logits[0]] * 3
    expected = float((logits[0].argmax(1) == labels).double().mean())
    assert cis_accuracy(CISTopology.preset("7-node", "5-15-80"), same, labels) == pytest.approx(expected)


def test_confidence_scores_and_bad_input():
    s = exit_confidence(torch.tensor([[0.0, 0.0, 0.0], [100.0, 0.0, 0.0]]))
    assert s.tolist() == pytest.approx([1.0, 0.0], abs=1e-12)
    assert exit_confidence(torch.tensor([[0.0, 0.0]]), "max_softmax").tolist() == [-0.5]
    topo, logits, labels = _hand_example()
    with pytest.raises(ValueError, match="confidence"):
        cis_accuracy(topo, logits, labels, confidence="margin")
    with pytest.raises(ValueError, match="exit_logits"):
        cis_accuracy(topo, logits[:1], labels)
    with pytest.raises(ValueError, match=r"exit_logits\[0\]"):
        cis_accuracy(topo, logits, labels[:3])
    with pytest.raises(ValueError, match="topology"):
        cis_accuracy(None, logits, labels)


@pytest.mark.filterwarnings("ignore")
def test_cis_callback_logs_overall_and_per_node(tmp_path):
    torch.manual_seed(0)
    topo, _, _ = _hand_example()
    net = early_exit_resnet18(num_classes=3, exits=(3,), base_width=4)  # 2 exits
    module = EarlyExitClassifier(net, num_classes=3, train_exit=1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
    loader = DataLoader(data, batch_size=4)
    cb = CISAccuracy(topo)
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=2, callbacks=[cb], default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    metrics = trainer.callback_metrics
    module.eval()
    with torch.no_grad():
        expected = cis_evaluate(topo, module(data.tensors[0]), data.tensors[1])
    assert float(metrics["cis_acc"]) == pytest.approx(expected.accuracy, abs=1e-6)
    for i in range(3):
        assert float(metrics[f"cis_acc_node{i}"]) == pytest.approx(float(expected.node_accuracy[i]), abs=1e-6)
    assert {"val_acc_exit1", "val_acc_exit2", "val_acc", "val_loss"} <= set(metrics)
    assert float(metrics["val_acc"]) == pytest.approx(float(metrics["val_acc_exit2"]))
    trainer.test(module, dataloaders=loader, verbose=False)
    assert float(trainer.callback_metrics["test_cis_acc"]) == pytest.approx(expected.accuracy, abs=1e-6)
    assert "test_acc_exit1" in trainer.callback_metrics


@pytest.mark.filterwarnings("ignore")
def test_cis_callbacks_with_distinct_names_score_one_model_under_two_topologies(tmp_path):
    """One fit, two CISAccuracy instances: the hand example's tree and the same tree with no transfer (every leaf
    serves all it receives, so the root serves nothing). Each logs under its own name the value cis_evaluate gives
    for its topology; the two differ, so neither overwrote the other. An empty name is refused."""
    torch.manual_seed(0)
    topo, _, _ = _hand_example()
    local = CISTopology([[1, 2], [], []], [2, 1, 1], arrival=[0, 1, 2], transfer_cap=[0, 0, 0])
    net = early_exit_resnet18(num_classes=3, exits=(3,), base_width=4)
    module = EarlyExitClassifier(net, num_classes=3, train_exit=1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
    loader = DataLoader(data, batch_size=4)
    callbacks = [CISAccuracy(topo), CISAccuracy(local, name="cis_acc_local")]
    assert len({cb.state_key for cb in callbacks}) == 2
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=2, callbacks=callbacks, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    module.eval()
    with torch.no_grad():
        logits = module(data.tensors[0])
    tree, alone = cis_evaluate(topo, logits, data.tensors[1]), cis_evaluate(local, logits, data.tensors[1])
    metrics = trainer.callback_metrics
    assert float(metrics["cis_acc"]) == pytest.approx(tree.accuracy, abs=1e-6)
    assert float(metrics["cis_acc_local"]) == pytest.approx(alone.accuracy, abs=1e-6)
    assert tree.accuracy != pytest.approx(alone.accuracy, abs=1e-3)
    assert float(metrics["cis_acc_local_node1"]) == pytest.approx(float(alone.node_accuracy[1]), abs=1e-6)
    assert "cis_acc_local_node0" not in metrics  # the root serves nothing without transfer
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        CISAccuracy(topo, name="")
