"""FedCIS (thesis ch. 5, Algorithm 6): hand-computed aggregation, exit sampling, validation, state, end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms.base import ClientInfo
from lightning_fedhet.algorithms.fedcis import (
    FedCIS,
    code_sampling_matrix,
    exit_masks,
    lambda_tilde_weights,
    sampling_matrix,
)
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.early_exit_module import EarlyExitClassifier
from lightning_fedhet.flat import FlatModel
from tests.helpers import quiet_trainer

INFO = ClientInfo(num_samples=1, local_steps=1)


class FixedUniforms:
    """Stands in for the round's numpy Generator: ``random(n)`` returns preset uniforms (to force exit draws)."""

    def __init__(self, u):
        self.u = np.asarray(u, dtype=np.float64)

    def random(self, n):
        assert n == len(self.u)
        return self.u.copy()


def three_node_topology() -> CISTopology:
    # root 0 (E=2) with leaves 1, 2 (E=1). Requests arrive at the leaves (1 each), each leaf forwards 0.25:
    # leaves serve 0.75 each -> Lambda_1 = 1.5, root serves 0.5 -> Lambda_2 = 0.5; normalised (0.75, 0.25).
    return CISTopology([[1, 2], [], []], [2, 1, 1], arrival=[0.0, 1.0, 1.0], transfer_cap=[0.0, 0.25, 0.25])


# deltas over d = 3 coordinates: [shared prefix, head of exit 1, parameters of exit 2 only]
D_LEAF1 = torch.tensor([1.0, 2.0, 0.0])
D_LEAF2 = torch.tensor([3.0, -1.0, 0.0])
D_ROOT_EXIT2 = torch.tensor([2.0, 0.0, 4.0])
D_ROOT_EXIT1 = torch.tensor([2.0, 4.0, 0.0])  # a root training exit 1 leaves the exit-2-only coordinate alone


def run_round(algo: FedCIS, u, deltas: dict[int, torch.Tensor], sizes=(6, 2, 4)) -> torch.Tensor:
    if algo.params is None:
        algo.setup(3, torch.ones(3), client_sizes=torch.tensor(sizes))  # |D_0| = 6, |D_1| = 2, |D_2| = 4
    algo.select(0, torch.ones(3, dtype=torch.bool), FixedUniforms(u))
    algo.open_round(0, None)
    for c, d in deltas.items():
        algo.add(c, d, INFO)
    return algo.close_round()


def test_hand_computed_p0_serving_rate_and_equal():
    topo = three_node_topology()
    assert torch.allclose(topo.serving_rates(normalize=True), torch.tensor([0.75, 0.25], dtype=torch.float64))
    deltas = {0: D_ROOT_EXIT2, 1: D_LEAF1, 2: D_LEAF2}

    # Serving Rate, p = 0. |D_{1,p}| = |D_1| + |D_2| = 6, |D_{2,p}| = |D_0| = 6, all p_{i,E_i} = 1.
    # weights: leaf1 0.75 * 2/6 = 0.25, leaf2 0.75 * 4/6 = 0.5, root 0.25 * 6/6 = 0.25
    # update = 0.25*[1,2,0] + 0.5*[3,-1,0] + 0.25*[2,0,4] = [0.25+1.5+0.5, 0.5-0.5, 1] = [2.25, 0, 1]
    # w = [1,1,1] + update = [3.25, 1, 2]
    algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.0)
    w = run_round(algo, [0.9, 0.9, 0.9], deltas)
    assert algo.exits.tolist() == [2, 1, 1]
    assert algo.client_config(0) == {"train_exit": 2} and algo.client_config(1) == {"train_exit": 1}
    torch.testing.assert_close(w, torch.tensor([3.25, 1.0, 2.0]), atol=1e-6, rtol=0)
    assert algo.last_weights == pytest.approx({0: 0.25, 1: 0.25, 2: 0.5}, abs=1e-12)
    assert algo.last_exits == {0: 2, 1: 1, 2: 1}

    # Equal Weight: Lt = (0.5, 0.5). leaf1 0.5 * 2/6 = 1/6, leaf2 0.5 * 4/6 = 1/3, root 0.5 * 6/6 = 1/2
    # update = [1/6 + 1 + 1, 1/3 - 1/3, 2] = [13/6, 0, 2];  w = [19/6, 1, 3]
    algo = FedCIS(topo, lambda_tilde="equal", p=0.0)
    w = run_round(algo, [0.9, 0.9, 0.9], deltas)
    torch.testing.assert_close(w, torch.tensor([19 / 6, 1.0, 3.0]), atol=1e-6, rtol=0)

    # server_lr = 0.5 halves the Serving-Rate update: w = [1,1,1] + 0.5*[2.25, 0, 1] = [2.125, 1, 1.5]
    algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.0, server_lr=0.5)
    w = run_round(algo, [0.9, 0.9, 0.9], deltas)
    torch.testing.assert_close(w, torch.tensor([2.125, 1.0, 1.5]), atol=1e-6, rtol=0)


def test_hand_computed_p_positive():
    topo = three_node_topology()
    # p = 0.25: root row (p_{0,1}, p_{0,2}) = (0.25, 0.75); leaves (1, 0).
    # C_1 = {0, 1, 2} -> |D_{1,p}| = 6 + 2 + 4 = 12;  C_2 = {0} -> |D_{2,p}| = 6.
    algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.25)
    assert algo.p_matrix.tolist() == [[0.25, 0.75], [1.0, 0.0], [1.0, 0.0]]

    # (a) root draws exit 1 (u_0 = 0.1 < 0.25). Weights (inverse probability):
    #     leaf1 0.75 * 2/12 / 1 = 0.125, leaf2 0.75 * 4/12 = 0.25, root 0.75 * 6/12 / 0.25 = 1.5
    #     update = 0.125*[1,2,0] + 0.25*[3,-1,0] + 1.5*[2,4,0] = [0.125+0.75+3, 0.25-0.25+6, 0] = [3.875, 6, 0]
    #     w = [4.875, 7, 1]
    w = run_round(algo, [0.1, 0.5, 0.5], {0: D_ROOT_EXIT1, 1: D_LEAF1, 2: D_LEAF2})
    assert algo.exits.tolist() == [1, 1, 1]
    torch.testing.assert_close(w, torch.tensor([4.875, 7.0, 1.0]), atol=1e-6, rtol=0)
    assert algo.last_weights[0] == pytest.approx(1.5)

    # (b) root draws exit 2 (u_0 = 0.5 >= 0.25): root weight 0.25 * 6/6 / 0.75 = 1/3
    #     update = [0.125 + 0.75 + 2/3, 0.25 - 0.25 + 0, 4/3] = [1.5416667, 0, 1.3333333]
    #     w = [2.5416667, 1, 2.3333333]
    algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.25)
    w = run_round(algo, [0.5, 0.5, 0.5], {0: D_ROOT_EXIT2, 1: D_LEAF1, 2: D_LEAF2})
    assert algo.exits.tolist() == [2, 1, 1]
    torch.testing.assert_close(w, torch.tensor([1 + 0.875 + 2 / 3, 1.0, 1 + 4 / 3]), atol=1e-6, rtol=0)

    # (c) released-code weighting (x p instead of / p), root on exit 1: root 0.75 * 6/12 * 0.25 = 0.09375
    #     update = [0.125 + 0.75 + 0.1875, 0.25 - 0.25 + 0.375, 0] = [1.0625, 0.375, 0];  w = [2.0625, 1.375, 1]
    algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.25, prob_weighting="direct")
    w = run_round(algo, [0.1, 0.5, 0.5], {0: D_ROOT_EXIT1, 1: D_LEAF1, 2: D_LEAF2})
    torch.testing.assert_close(w, torch.tensor([2.0625, 1.375, 1.0]), atol=1e-6, rtol=0)


def test_missing_update_is_not_renormalised_and_explicit_lambda_tilde():
    topo = three_node_topology()
    # Lt given as (3, 1) -> normalised (0.75, 0.25), same as Serving Rate here. Leaf 2's update is lost:
    # update = 0.25*[1,2,0] + 0.25*[2,0,4] = [0.75, 0.5, 1];  w = [1.75, 1.5, 2]
    algo = FedCIS(topo, lambda_tilde=torch.tensor([3.0, 1.0]), p=0.0)
    w = run_round(algo, [0.0, 0.0, 0.0], {0: D_ROOT_EXIT2, 1: D_LEAF1})
    torch.testing.assert_close(w, torch.tensor([1.75, 1.5, 2.0]), atol=1e-6, rtol=0)
    assert set(algo.last_weights) == {0, 1}
    # normalize=False uses the weights as given: update = 3*(2/6)*[1,2,0] + 1*(6/6)*[2,0,4] = [3, 2, 4]
    algo = FedCIS(topo, lambda_tilde=[3.0, 1.0], p=0.0, normalize=False)
    w = run_round(algo, [0.0, 0.0, 0.0], {0: D_ROOT_EXIT2, 1: D_LEAF1})
    torch.testing.assert_close(w, torch.tensor([4.0, 3.0, 5.0]), atol=1e-6, rtol=0)


# Exit sub-models of the 3-coordinate toy net: exit 1 = [shared prefix, head 1], exit 2 = [shared prefix, exit-2 part]
TOY_MASKS = torch.tensor([[True, True, False], [True, False, True]])


def test_root_local_base_hand_computed():
    topo = three_node_topology()
    # Released code: w = w_r + sum_{c != root} a_c M_{e_c} (w_c - w_r), w_r = w_t + delta_root. Serving Rate, p = 0:
    # a_1 = 0.25, a_2 = 0.5 (as in the literal example), both leaves train exit 1 (mask [1, 1, 0]).
    # w_r = [1,1,1] + [2,0,4] = [3, 1, 5]
    # leaf 1: w_c - w_r = [2,3,1] - [3,1,5] = [-1, 2, -4] -> masked [-1, 2, 0] * 0.25 = [-0.25, 0.5, 0]
    # leaf 2: w_c - w_r = [4,0,1] - [3,1,5] = [1, -1, -4] -> masked [1, -1, 0] * 0.5  = [0.5, -0.5, 0]
    # w = [3, 1, 5] + [0.25, 0, 0] = [3.25, 1, 5]: the shared prefix and head 1 equal the literal rule's
    # [3.25, 1, 2]; the exit-2-only coordinate is the root's model (5) instead of w_t + 0.25 * 4 = 2.
    for order in ([0, 1, 2], [1, 2, 0]):  # the root may arrive first or last
        algo = FedCIS(topo, lambda_tilde="serving_rate", p=0.0, aggregation_base="root_local", exit_masks=TOY_MASKS)
        deltas = {c: {0: D_ROOT_EXIT2, 1: D_LEAF1, 2: D_LEAF2}[c] for c in order}
        w = run_round(algo, [0.9, 0.9, 0.9], deltas)
        torch.testing.assert_close(w, torch.tensor([3.25, 1.0, 5.0]), atol=1e-6, rtol=0)
        assert algo.last_weights == pytest.approx({0: 1.0, 1: 0.25, 2: 0.5}, abs=1e-12)

    # server_lr = 0.5 scales only the differences: w = [3, 1, 5] + 0.5 * [0.25, 0, 0] = [3.125, 1, 5]
    algo = FedCIS(topo, p=0.0, server_lr=0.5, aggregation_base="root_local", exit_masks=TOY_MASKS)
    w = run_round(algo, [0.9, 0.9, 0.9], {0: D_ROOT_EXIT2, 1: D_LEAF1, 2: D_LEAF2})
    torch.testing.assert_close(w, torch.tensor([3.125, 1.0, 5.0]), atol=1e-6, rtol=0)

    # the root's update is lost: the base is w_t. w = [1,1,1] + 0.25 [1,2,0] + 0.5 [3,-1,0] = [2.75, 1, 1]
    algo = FedCIS(topo, p=0.0, aggregation_base="root_local", exit_masks=TOY_MASKS)
    w = run_round(algo, [0.9, 0.9, 0.9], {1: D_LEAF1, 2: D_LEAF2})
    torch.testing.assert_close(w, torch.tensor([2.75, 1.0, 1.0]), atol=1e-6, rtol=0)

    # p = 0.25 with the root on exit 1 (u_0 = 0.1): a_1 = 0.125, a_2 = 0.25 (see test_hand_computed_p_positive).
    # w_r = [1,1,1] + [2,4,0] = [3, 5, 1]; leaf 1: [2,3,1] - [3,5,1] = [-1,-2,0] * 0.125 = [-0.125, -0.25, 0]
    # leaf 2: [4,0,1] - [3,5,1] = [1,-5,0] * 0.25 = [0.25, -1.25, 0];  w = [3.125, 3.5, 1]
    algo = FedCIS(topo, p=0.25, aggregation_base="root_local", exit_masks=TOY_MASKS)
    w = run_round(algo, [0.1, 0.5, 0.5], {0: D_ROOT_EXIT1, 1: D_LEAF1, 2: D_LEAF2})
    torch.testing.assert_close(w, torch.tensor([3.125, 3.5, 1.0]), atol=1e-6, rtol=0)


def _pair_weights_7node_8015_code_p() -> torch.Tensor:
    """Algorithm 6 line 11's pair weights ``Lt_e |D_i| / |D_{e,p}| / p_{i,e}`` written out for the 7-node tree at
    80-15-5 (``Lt = (0.8, 0.15, 0.05)``), sizes ``(40, 20, 20, 10, 10, 10, 10)`` and the code's ``0.4-0.8``
    sampling: root ``p = (0.4, 0.4, 0.2)``, middle nodes ``(0.4, 0.6, 0)``, leaves ``(1, 0, 0)``. ``|D_{e,p}|`` over
    the nodes with ``p_{i,e} > 0``: exit 1 all (120), exit 2 the root and the middle nodes (80), exit 3 the root
    (40). Independent of the code under test (``[N, E]``, 0 where ``p_{i,e} = 0``)."""
    lt = [0.8, 0.15, 0.05]
    sizes = [40, 20, 20, 10, 10, 10, 10]
    p = [[0.4, 0.4, 0.2], [0.4, 0.6, 0.0], [0.4, 0.6, 0.0]] + [[1.0, 0.0, 0.0]] * 4
    d_e = [120.0, 80.0, 40.0]
    return torch.tensor(
        [[lt[e] * sizes[i] / d_e[e] / p[i][e] if p[i][e] > 0 else 0.0 for e in range(3)] for i in range(7)],
        dtype=torch.float64,
    )


def test_root_local_matches_a_transcription_of_the_released_aggregation_loop():
    # 7-node tree, p > 0 (code convention 0.4-0.8), random deltas confined to each drawn exit's sub-model, random
    # masks. The reference is the released code's loop over the nodes other than the root, written out per
    # coordinate on model copies: w_diff += a_c * (w_c - w_cloud) on exit e's coordinates; w_cloud += eta * w_diff.
    topo = CISTopology.preset("7-node", "80-15-5")
    d = 12
    gen = torch.Generator().manual_seed(4)
    masks = torch.rand(3, d, generator=gen) < 0.6
    masks[:, 0] = True
    p = code_sampling_matrix(topo, {2: 0.4, 3: 0.8})
    smaller = False
    for rnd in range(3):
        algo = FedCIS(topo, "serving_rate", p=p, server_lr=0.7, aggregation_base="root_local", exit_masks=masks)
        w_t = torch.randn(d, generator=gen, dtype=torch.float64)
        algo.setup(7, w_t.clone(), client_sizes=torch.tensor([40, 20, 20, 10, 10, 10, 10]))
        algo.select(rnd, torch.ones(7, dtype=torch.bool), np.random.default_rng([11, rnd]))
        coef = _pair_weights_7node_8015_code_p()  # not algo.pair_weights: expected values come from the paper
        local = {}
        for c in range(7):
            e = int(algo.exits[c])
            local[c] = w_t + torch.where(masks[e - 1], torch.randn(d, generator=gen, dtype=torch.float64), 0.0)
        algo.open_round(rnd, None)
        for c in (3, 0, 5, 1, 6, 2, 4):
            algo.add(c, local[c] - w_t, INFO)
        got = algo.close_round()
        cloud = local[0].clone()  # the global model object is the root's trained model
        w_diff = torch.zeros(d, dtype=torch.float64)
        for c in range(7):
            e = int(algo.exits[c])
            for j in range(d):
                if masks[e - 1, j]:
                    w_diff[j] += float(coef[c, e - 1]) * (local[c][j] - cloud[j])
        expected = cloud + 0.7 * w_diff
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        smaller |= any(int(algo.exits[c]) < topo.max_exit[c] for c in range(3))
    assert smaller  # over the 3 rounds, the root or a middle node trained a smaller exit (p > 0 is exercised)


def test_exit_masks_from_an_early_exit_net():
    net = early_exit_resnet18(num_classes=10, exits=(3, 9), in_channels=1, base_width=4)
    model = EarlyExitClassifier(model=net, num_classes=10)
    units = [list(net.blocks[: net.exit_blocks[e]]) + [net.heads[e]] for e in range(net.num_exits)]
    masks = exit_masks(model, units)
    flat = FlatModel(model)
    # the rule's vector is the parameter part (the server averages BatchNorm statistics itself)
    names = [n for n, _ in model.named_parameters()]
    assert masks.shape == (3, flat.num_parameters)
    for e in range(3):
        expected = []
        for name, k in zip(names, flat.numels):
            parts = name.split(".")
            inside = parts[0] == "model" and (
                (parts[1] == "blocks" and int(parts[2]) < net.exit_blocks[e])
                or (parts[1] == "heads" and int(parts[2]) == e)
            )
            expected.append(torch.full((k,), inside))
        assert torch.equal(masks[e], torch.cat(expected)), e
    assert masks[0].sum() < masks[1].sum() < masks[2].sum()
    with pytest.raises(ValueError, match="holds no tensor"):
        exit_masks(model, [[torch.nn.Linear(2, 2)]])


@pytest.mark.parametrize("value", [
    np.empty((1, 0)), np.array([1.0, 2.0]), np.array(["literal"]), np.array("literal"), torch.tensor([1.0, 2.0]),
    None, 0, 1.5, True, ["literal"], {"literal": 1}, "root", "Literal",
], ids=["empty-array", "array", "str-array-1", "str-array-0d", "tensor", "none", "int", "float", "bool", "list",
        "dict", "unknown-name", "wrong-case"])
def test_aggregation_base_other_than_a_name_is_refused_naming_it(value):
    # The property test drew np.empty((1, 0)): `value not in AGGREGATION_BASES` compared it elementwise and numpy
    # raised "The truth value of an empty array is ambiguous"; array(['literal']) compared equal and was let in.
    with pytest.raises(ValueError) as err:
        FedCIS(three_node_topology(), aggregation_base=value)
    assert str(err.value) == f"aggregation_base must be one of ('literal', 'root_local'), got {value!r}"
    with pytest.raises(ValueError) as err:
        FedCIS(three_node_topology(), lambda_tilde="flops", flops=[1, 2, 3], flops_schedule=value)
    assert str(err.value) == f"flops_schedule must be one of ('static', 'warmup'), got {value!r}"


def test_root_local_validation():
    topo = three_node_topology()
    with pytest.raises(ValueError, match="aggregation_base must be one of"):
        FedCIS(topo, aggregation_base="root")
    with pytest.raises(ValueError, match="needs exit_masks"):
        FedCIS(topo, aggregation_base="root_local")
    with pytest.raises(ValueError, match="exit_masks only applies"):
        FedCIS(topo, exit_masks=TOY_MASKS)
    with pytest.raises(ValueError, match=r"shape \[E, d\] with E = 2"):
        FedCIS(topo, aggregation_base="root_local", exit_masks=TOY_MASKS[:1])
    with pytest.raises(ValueError, match="bool tensor"):
        FedCIS(topo, aggregation_base="root_local", exit_masks=TOY_MASKS.float())
    with pytest.raises(ValueError, match=r"no coordinate for exit\(s\) \[2\]"):
        FedCIS(topo, aggregation_base="root_local", exit_masks=torch.tensor([[True, True, False], [False] * 3]))
    forest = CISTopology([[], []], [1, 1], arrival=[1.0, 1.0], transfer_cap=0.0)
    with pytest.raises(ValueError, match="one root"):
        FedCIS(forest, aggregation_base="root_local", exit_masks=torch.ones(1, 3, dtype=torch.bool))
    algo = FedCIS(topo, aggregation_base="root_local", exit_masks=TOY_MASKS)
    with pytest.raises(ValueError, match="exit_masks has 3 columns but the parameter vector has d = 4"):
        algo.setup(3, torch.zeros(4))
    assert algo.hparams()["aggregation_base"] == "root_local"


def test_sizes_fall_back_to_topology_data_fraction():
    # no client_sizes: |D_i| ∝ data_fraction = (0.5, 0.25, 0.25) -> leaf weights 0.75 * 1/2 each, root 0.25
    topo = CISTopology([[1, 2], [], []], [2, 1, 1], [0, 1, 1], [0, 0.25, 0.25], data_fraction=[2, 1, 1])
    algo = FedCIS(topo)
    algo.setup(3, torch.zeros(3))
    algo.select(0, torch.ones(3, dtype=torch.bool), FixedUniforms([0, 0, 0]))
    algo.open_round(0, None)
    for c in range(3):
        algo.add(c, torch.ones(3), INFO)
    torch.testing.assert_close(algo.close_round(), torch.full((3,), 0.375 + 0.375 + 0.25))


def test_exit_draws_follow_p():
    topo = CISTopology.preset("7-node", "80-15-5")
    algo = FedCIS(topo, p=0.2)
    # thesis parametrisation: mid nodes (E=2) (0.2, 0.8, 0), root (E=3) (0.2, 0.2, 0.6), leaves (1, 0, 0)
    expected = sampling_matrix(topo, 0.2)
    assert expected[0].tolist() == pytest.approx([0.2, 0.2, 0.6])
    assert expected[1].tolist() == pytest.approx([0.2, 0.8, 0])
    algo.setup(7, torch.zeros(2))
    rounds = 4000
    counts = torch.zeros(7, 3)
    for t in range(rounds):
        algo.select(t, torch.ones(7, dtype=torch.bool), np.random.default_rng([123, t]))
        counts[torch.arange(7), algo.exits - 1] += 1
    freq = counts / rounds
    # binomial std <= sqrt(0.25/4000) = 0.0079; tolerance 0.03 is > 3.7 std for every entry
    torch.testing.assert_close(freq.double(), expected, atol=0.03, rtol=0)
    assert (freq[3:, 0] == 1).all()  # leaves only ever train exit 1
    assert (counts[1:3, 2] == 0).all()  # mid nodes never draw an exit they do not hold


def test_code_sampling_matrix_and_lambda_tilde_strategies():
    topo = CISTopology.preset("7-node", "80-15-5")
    mat = code_sampling_matrix(topo, {2: 0.4, 3: 0.8})  # the released code's "0.4-0.8"
    assert mat[0].tolist() == pytest.approx([0.4, 0.4, 0.2]) and mat[1].tolist() == pytest.approx([0.4, 0.6, 0.0])
    assert mat[3].tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(FedCIS(topo, p=mat).p_matrix, mat)

    sr = FedCIS(topo).lambda_tilde_at(0)
    torch.testing.assert_close(sr, torch.tensor([0.8, 0.15, 0.05], dtype=torch.float64))
    torch.testing.assert_close(FedCIS(topo, "equal").lambda_tilde_at(0), torch.full((3,), 1 / 3, dtype=torch.float64))
    # Balanced Adj, 80-15-5 CIFAR10 example: o = (0.1718, 0.2394, 0.5888), Lt ≈ (0.486, 0.195, 0.319)
    bal = FedCIS(topo, "balanced").lambda_tilde_at(0)
    torch.testing.assert_close(bal, torch.tensor([0.486, 0.195, 0.319], dtype=torch.float64), atol=1e-3, rtol=0)
    # FLOPS Prop: static = F/sum F; warm-up (code) = min(0.01 (t+1), F/F_E) normalised
    flops = [1.0, 3.0, 6.0]
    static = FedCIS(topo, "flops", flops=flops).lambda_tilde_at(0)
    torch.testing.assert_close(static, torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64))
    warm = FedCIS(topo, "flops", flops=flops, flops_schedule="warmup")
    torch.testing.assert_close(warm.lambda_tilde_at(0), torch.full((3,), 1 / 3, dtype=torch.float64))
    # round 29: tau = 0.3 -> (min(.3, 1/6), min(.3, .5), min(.3, 1)) = (1/6, .3, .3) -> / (23/30)
    torch.testing.assert_close(
        warm.lambda_tilde_at(29), torch.tensor([5 / 23, 9 / 23, 9 / 23], dtype=torch.float64), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(warm.lambda_tilde_at(500), static)
    assert torch.allclose(lambda_tilde_weights("serving_rate", topo), sr)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(p=[[0.5, 0.4, 0.0]] + [[1.0, 0.0, 0.0]] * 6), "rows? of p must sum to 1|shape"),
        (dict(p=torch.tensor([[0.3, 0.3, 0.3]] + [[1.0, 0.0, 0.0]] * 6)), "sum to 1"),
        (dict(p=torch.tensor([[0.2, 0.2, 0.6], [0.2, 0.8, 0.0], [0.2, 0.8, 0.0]] + [[0.9, 0.1, 0.0]] * 4)), "beyond"),
        (dict(p=torch.tensor([[1.5, -0.5, 0.0]] + [[1.0, 0.0, 0.0]] * 6)), r"\[0, 1\]"),
        (dict(p=-0.1), "p must be a number in"),
        (dict(p=0.6), "p must be a number in"),
        (dict(p=True), "p must be"),
        (dict(lambda_tilde=[0.5, 0.5]), "one entry per exit"),
        (dict(lambda_tilde=[0.5, -0.1, 0.6]), r"lambda_tilde must lie in \[0, inf\), got -0.1"),
        (dict(lambda_tilde=[0.0, 0.0, 0.0]), "all zero"),
        (dict(lambda_tilde="fastest"), "lambda_tilde must be one of"),
        (dict(lambda_tilde="flops"), "needs flops"),
        (dict(lambda_tilde="flops", flops=[1, 2]), "one entry per exit"),
        (
            dict(lambda_tilde="balanced", grad_variance=[1.0, 0.0, 1.0]),
            r"grad_variance must lie in \(0, inf\), got 0.0",
        ),
        (dict(server_lr=0.0), "server_lr"),
        (dict(prob_weighting="half"), "prob_weighting"),
        (dict(flops_schedule="linear"), "flops_schedule"),
    ],
)
def test_bad_input(kwargs, match):
    topo = CISTopology.preset("7-node", "80-15-5")
    with pytest.raises(ValueError, match=match):
        FedCIS(topo, **kwargs)


def test_bad_usage():
    topo = three_node_topology()
    with pytest.raises(ValueError, match="topology must be a CISTopology"):
        FedCIS("7-node")
    algo = FedCIS(topo)
    with pytest.raises(ValueError, match="num_clients=4"):
        algo.setup(4, torch.zeros(3))
    algo.setup(3, torch.zeros(3))
    with pytest.raises(RuntimeError, match="select"):
        algo.open_round(0, None)  # no exits drawn for this round (e.g. a strategy-level selection=)
    with pytest.raises(RuntimeError, match="select"):
        algo.client_config(0)
    algo.select(0, torch.ones(3, dtype=torch.bool), FixedUniforms([0, 0, 0]))
    with pytest.raises(RuntimeError, match="select"):
        algo.open_round(1, None)
    algo.open_round(0, None)
    algo.add(1, torch.ones(3), INFO)
    with pytest.raises(ValueError, match="already added"):
        algo.add(1, torch.ones(3), INFO)
    with pytest.raises(ValueError, match="shape"):
        algo.add(2, torch.ones(4), INFO)


def test_state_dict_round_trip():
    topo = CISTopology.preset("7-node", "80-15-5")
    gen = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(5, generator=gen) for _ in range(7)] for _ in range(3)]

    def play(algo, rounds):
        for t in rounds:
            algo.select(t, torch.ones(7, dtype=torch.bool), np.random.default_rng([7, t]))
            algo.open_round(t, None)
            for c in range(7):
                algo.add(c, deltas[t][c], INFO)
            algo.close_round()

    a = FedCIS(topo, "balanced", p=0.2)
    a.setup(7, torch.zeros(5), client_sizes=torch.tensor([40, 20, 20, 10, 10, 10, 10]))
    play(a, [0, 1])
    b = FedCIS(topo, "balanced", p=0.2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.params, a.params) and torch.equal(b.exits, a.exits) and b.last_exits == a.last_exits
    assert torch.equal(b.client_sizes, a.client_sizes)
    play(a, [2])
    play(b, [2])
    assert torch.equal(a.params, b.params)


class RecordingFedCIS(FedCIS):
    """FedCIS that keeps every absorbed delta and every client_config it handed out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deltas: list[dict[int, torch.Tensor]] = []
        self.configs: list[tuple[int, int]] = []

    def client_config(self, client):
        cfg = super().client_config(client)
        self.configs.append((client, cfg["train_exit"]))
        return cfg

    def open_round(self, round, ctx):
        super().open_round(round, ctx)
        self.deltas.append({})

    def add(self, client, delta, info):
        self.deltas[-1][client] = delta.clone()
        super().add(client, delta, info)


class RecordingEEC(EarlyExitClassifier):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_exits: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained_exits.append(self.train_exit)
        return super().training_step(batch, batch_idx)


def test_end_to_end_with_strategy_and_early_exit_classifier():
    torch.manual_seed(0)
    topo = CISTopology.preset("7-node", "80-15-5")
    n_per_node, steps, rounds = 8, 2, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7 * n_per_node, 3, 16, 16, generator=gen)
    y = torch.randint(0, 10, (7 * n_per_node,), generator=gen)
    data = FederatedDataModule(
        TensorDataset(x, y), [list(range(i * n_per_node, (i + 1) * n_per_node)) for i in range(7)], batch_size=4
    )
    net = early_exit_resnet18(num_classes=10, exits=(3, 9), in_channels=3, base_width=4)
    model = RecordingEEC(model=net, num_classes=10, lr=0.05)
    algo = RecordingFedCIS(topo, "serving_rate", p=0.3)
    # the sequential engine: the module records each step's exit, client after client
    strategy = FedHetStrategy(algorithm=algo, local_steps=steps, seed=3, engine="sequential")
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0)
    trainer.fit(model, datamodule=data)

    assert len(strategy.history) == rounds and len(algo.deltas) == rounds
    assert algo.client_sizes.tolist() == [n_per_node] * 7
    # each node trained exactly the exit client_config sent it, for all its local steps (clients run in id order)
    assert [c for c, _ in algo.configs] == list(range(7)) * rounds
    assert model.trained_exits == [e for _, e in algo.configs for _ in range(steps)]
    drawn = [e for _, e in algo.configs]
    assert any(e < topo.max_exit[c] for c, e in algo.configs)  # seed 3 makes some node train a smaller exit
    assert all(e == 1 for r in range(rounds) for e in drawn[r * 7 + 3 : r * 7 + 7])  # leaves: exit 1
    assert all(e in (1, 2) for r in range(rounds) for e in drawn[r * 7 + 1 : r * 7 + 3])  # mid nodes: exits 1, 2

    # flat-vector layout (parameters, then floating buffers) -> which exit needs each coordinate
    flat = FlatModel(model)
    names = [n for n, _ in model.named_parameters()] + [n for n, b in model.named_buffers() if b.is_floating_point()]
    exit_blocks = net.exit_blocks

    def needed_by(name: str) -> int:
        """Smallest exit whose forward pass uses this tensor (0: not part of the network, e.g. loss weights)."""
        parts = name.split(".")
        if parts[0] != "model":
            return 0
        idx = int(parts[2])
        if parts[1] == "heads":
            return idx + 1
        return next(e for e, b in enumerate(exit_blocks, start=1) if idx + 1 <= b)

    # the rule sees the parameters only (the server averages the BatchNorm statistics itself)
    level = torch.cat([torch.full((k,), needed_by(n)) for n, k in zip(names, flat.numels)])[: flat.num_parameters]
    # Algorithm 6 line 11 by hand (not algo.pair_weights): Lt = (0.8, 0.15, 0.05); scalar p = 0.3 gives the root
    # (0.3, 0.3, 0.4), middle nodes (0.3, 0.7), leaves (1); |D_i| = 8, |D_{e,p}| = 56, 24, 8 for exits 1, 2, 3
    lt, d_e = (0.8, 0.15, 0.05), (56.0, 24.0, 8.0)
    p_ie = [(0.3, 0.3, 0.4), (0.3, 0.7), (0.3, 0.7)] + [(1.0,)] * 4
    for r in range(rounds):
        exits = dict(algo.configs[r * 7 : (r + 1) * 7])
        for client, delta in algo.deltas[r].items():
            e = exits[client]
            expected = lt[e - 1] * 8.0 / d_e[e - 1] / p_ie[client][e - 1]
            assert strategy.history[r]["weights"][client] == pytest.approx(expected)
            # parameters deeper than the trained exit got exactly zero delta
            assert torch.count_nonzero(delta[level > e]) == 0, (r, client, e)
            # the trained exit's own head moved
            head = torch.tensor([n.startswith(f"model.heads.{e - 1}.") for n in names])
            head_mask = torch.cat([torch.full((k,), bool(h)) for h, k in zip(head, flat.numels)])[: flat.num_parameters]
            assert torch.count_nonzero(delta[head_mask]) > 0, (r, client, e)
    leaf_deltas = [algo.deltas[r][c] for r in range(rounds) for c in range(3, 7)]
    assert all(torch.count_nonzero(d[level > 1]) == 0 for d in leaf_deltas)


# ------------------------------------------------------------------------ against the fedcis chunk's survivors
def test_correct_participation_divides_each_weight_by_its_probability_of_being_aggregated():
    # The Serving-Rate weights of test_hand_computed_p0_serving_rate_and_equal (root 0.25, leaf1 0.25, leaf2 0.5)
    # divided by P(aggregated) = (0.5, 1, 0.25): root 0.5, leaf1 0.25, leaf2 2 (Horvitz-Thompson: each weight's
    # expectation over the arrivals is the full-participation weight).
    # update = 0.5 [2, 0, 4] + 0.25 [1, 2, 0] + 2 [3, -1, 0] = [7.25, -1.5, 2];  w = [8.25, -0.5, 3].
    # Slips caught: multiplying by the probability, skipping the correction, not reading the context.
    from lightning_fedhet.algorithms import RoundContext

    algo = FedCIS(three_node_topology(), lambda_tilde="serving_rate", p=0.0, correct_participation=True)
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    ones = torch.ones(3, dtype=torch.bool)
    algo.select(0, ones, FixedUniforms([0.9, 0.9, 0.9]))
    algo.open_round(0, RoundContext(0, 3, ones, ones, ones,
                                    participation_probs=torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)))
    for client, delta in {0: D_ROOT_EXIT2, 1: D_LEAF1, 2: D_LEAF2}.items():
        algo.add(client, delta, INFO)
    torch.testing.assert_close(algo.close_round(), torch.tensor([8.25, -0.5, 3.0]), atol=1e-6, rtol=0)
    assert algo.last_weights == pytest.approx({0: 0.5, 1: 0.25, 2: 2.0})
    algo.select(1, ones, FixedUniforms([0.9, 0.9, 0.9]))
    with pytest.raises(ValueError, match=r"^correct_participation=True needs RoundContext\.participation_probs$"):
        algo.open_round(1, None)


def test_exit_data_sizes_and_options_are_reported():
    # |D_{e,p}| at p = 0.25: exit 1 is held by every node (6 + 2 + 4), exit 2 by the root only (6).
    algo = FedCIS(three_node_topology(), lambda_tilde="equal", p=0.25, server_lr=0.5, prob_weighting="direct",
                  correct_participation=True)
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    torch.testing.assert_close(algo.exit_data_sizes(), torch.tensor([12.0, 6.0], dtype=torch.float64))
    assert algo.hparams() == {"lambda_tilde": "equal", "p": 0.25, "server_lr": 0.5, "prob_weighting": "direct",
                              "flops_schedule": "static", "correct_participation": True, "aggregation_base": "literal",
                              "aggregate_heads": True}
    matrix = FedCIS(three_node_topology(), lambda_tilde=[3.0, 1.0], p=[[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]])
    assert matrix.hparams()["p"] == "matrix" and matrix.hparams()["lambda_tilde"] == [0.75, 0.25]
    assert algo.exits.dtype == torch.int64 and algo.selection_probs(0).dtype == torch.float64


def test_balanced_weights_use_the_sampling_matrix_and_the_sizes():
    # Balanced Adj on the 3-node tree with p = 0.25, |D| = (6, 2, 4), sigma^2 = (1, 1):
    # C_1 = {0, 1, 2}: |D_{1,p}| = 12, shares (1/2, 1/6, 1/3), concentration 1/4 + 1/36 + 1/9 = 7/18;
    # C_2 = {0}: share 1, concentration 1. o = (18/7, 1) -> normalised (18/25, 7/25).
    # Lt = 0.5 (serving rates (0.75, 0.25) + o) = (0.735, 0.265).
    # Slips caught: the sampling matrix or the client sizes not passed down (p = 0 gives (0.6964, 0.3036)).
    algo = FedCIS(three_node_topology(), "balanced", p=0.25, grad_variance=[1.0, 1.0])
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    expected = torch.tensor([0.735, 0.265], dtype=torch.float64)
    torch.testing.assert_close(algo.lambda_tilde_at(0), expected)
    algo.select(0, torch.ones(3, dtype=torch.bool), FixedUniforms([0.9, 0.9, 0.9]))
    algo.open_round(0, None)
    torch.testing.assert_close(algo.last_lambda_tilde, expected)


def test_the_flops_warmup_enters_the_rounds_weights_at_that_round():
    # warm-up at round 29 (see test_code_sampling_matrix_and_lambda_tilde_strategies): Lt = (5, 9, 9) / 23 on the
    # 7-node tree; the round's pair weights and last_lambda_tilde use that round's Lt, not round 0's (1/3 each).
    topo = CISTopology.preset("7-node", "80-15-5")
    algo = FedCIS(topo, "flops", flops=[1.0, 3.0, 6.0], flops_schedule="warmup")
    algo.setup(7, torch.ones(2))
    algo.select(29, torch.ones(7, dtype=torch.bool), FixedUniforms([0.9] * 7))
    algo.open_round(29, None)
    expected = torch.tensor([5 / 23, 9 / 23, 9 / 23], dtype=torch.float64)
    torch.testing.assert_close(algo.last_lambda_tilde, expected, atol=1e-12, rtol=0)
    # the pair weights scale with Lt exit by exit: round 29's are round 0's times Lt_29 / (1/3)
    torch.testing.assert_close(algo.pair_weights(29), algo.pair_weights(0) * expected * 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(topology=None), r"^topology must be a CISTopology, got NoneType$"),
        (dict(server_lr=float("inf")), r"^server_lr must be finite, got inf$"),
        (dict(prob_weighting="half"), r"^prob_weighting must be one of \('inverse', 'direct'\), got 'half'$"),
        (dict(normalize=1), r"^normalize must be True or False, got 1$"),
        (dict(correct_participation="yes"), r"^correct_participation must be True or False, got 'yes'$"),
        (dict(aggregation_base="root_local"), r"^aggregation_base='root_local' needs exit_masks \(bool \[E, d\]: the "
                                              r"coordinates of each exit's sub-model\), e\.g\. fedcis\.exit_masks"),
        (dict(exit_masks=torch.ones(3, 2, dtype=torch.bool)),
         r"^exit_masks only applies to aggregation_base='root_local'$"),
        (dict(lambda_tilde="flops", flops=[1, 0, 1]), r"^flops must lie in \(0, inf\), got 0.0$"),
        (dict(flops=[1.0, -1.0, 1.0]), r"^flops must lie in \(0, inf\), got -1.0$"),
        (dict(lambda_tilde="flops"), r"^lambda_tilde='flops' needs flops= \(cost of each exit, e\.g\. "
                                     r"EarlyExitNet\.exit_flops\(\.\.\.\)\)$"),
        (dict(lambda_tilde="flops", flops=[1, 2, 3], flops_schedule="linear"),
         r"^flops_schedule must be one of \('static', 'warmup'\), got 'linear'$"),
        (dict(lambda_tilde="balanced", grad_variance="mnist"),
         r"^grad_variance must be one of \['cifar10', 'cifar100'\] or numbers, got 'mnist'$"),
        (dict(lambda_tilde="fastest"), r"^lambda_tilde must be one of \('serving_rate', 'equal', 'flops', 'balanced'\) "
                                       r"or a tensor of 3 weights, got 'fastest'$"),
    ],
)
def test_bad_arguments_are_refused_with_the_parameter_and_its_range(kwargs, message):
    kwargs = dict(kwargs)
    topology = kwargs.pop("topology", CISTopology.preset("7-node", "80-15-5"))
    with pytest.raises(ValueError, match=message):
        FedCIS(topology, **kwargs)


def test_balanced_needs_variances_beyond_three_exits_and_named_ones_are_table_d1():
    with pytest.raises(ValueError, match=r"^lambda_tilde='balanced' has default gradient variances only for 3 exits "
                                         r"\(Table D\.1\); pass grad_variance= with 2 values$"):
        FedCIS(three_node_topology(), "balanced")
    topo = CISTopology.preset("7-node", "80-15-5")
    torch.testing.assert_close(FedCIS(topo, "balanced", grad_variance="cifar10").lambda_tilde_at(0),
                               FedCIS(topo, "balanced").lambda_tilde_at(0))
