"""Fed-CIS's helpers and edges by hand: the sampling matrices, Lambda-tilde called directly (as the thesis's
figures do), the exit draw's rounding guard, checkpoints, and the texts of its errors.

Written against the survivors of the ``fedcis`` mutation chunk (docs/testing.md): each test names the slip it
catches. The 3-node tree is the one of ``test_fedcis.py``: root 0 (E = 2) with leaves 1, 2 (E = 1), serving
rates normalised (0.75, 0.25).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms.fedcis import (
    FedCIS,
    code_sampling_matrix,
    exit_masks,
    lambda_tilde_weights,
    sampling_matrix,
)
from lightning_fedhet.cis import CISTopology
from tests.algorithms.test_fedcis import (
    D_LEAF1,
    D_LEAF2,
    D_ROOT_EXIT2,
    INFO,
    TOY_MASKS,
    FixedUniforms,
    three_node_topology,
)
from tests.helpers import error_text

F64 = dict(dtype=torch.float64)
ALL3 = torch.ones(3, dtype=torch.bool)


def seven_nodes() -> CISTopology:
    return CISTopology.preset("7-node", "80-15-5")


def single_exit() -> CISTopology:
    return CISTopology([[], []], [1, 1], arrival=[1.0, 1.0], transfer_cap=0.0)


# ---------------------------------------------------------------------------------------------- sampling matrices
def test_sampling_matrix_at_its_bounds():
    tree = three_node_topology()
    # one exit only (max E_i = 1): p_max = 1 and every row is [1] whatever p (slips: 1 / (E_max - 1) at E_max = 1
    # divides by zero; p_max = 2 would accept p = 1.5)
    torch.testing.assert_close(sampling_matrix(single_exit(), 0.0), torch.ones(2, 1, **F64))
    torch.testing.assert_close(sampling_matrix(single_exit(), 1.0), torch.ones(2, 1, **F64))
    assert error_text(lambda: sampling_matrix(single_exit(), 1.5)) == (
        "p must be a number in [0, 1] (= 1/(max E_i - 1), so that p_(i,E_i) = 1 - (E_i - 1) p >= 0), got 1.5"
    )
    # p = p_max exactly is allowed: 7-node tree, max E_i = 3, p_max = 1/2 -> rows [1/2, 1/2, 0] for E_i = 3 and 2
    expected = torch.tensor([[0.5, 0.5, 0.0]] * 3 + [[1.0, 0.0, 0.0]] * 4, **F64)
    torch.testing.assert_close(sampling_matrix(seven_nodes(), 0.5), expected, atol=0, rtol=0)
    # a bool is not a probability, even where p_max = 1 would hold True = 1
    assert error_text(lambda: sampling_matrix(tree, True)).endswith("got True")


def test_code_sampling_matrix_by_hand():
    tree = three_node_topology()
    # root (E = 2) trains exit 1 with probability a = smaller_exit_prob[2]; leaves (E = 1) always exit 1, even when
    # the mapping names E = 1 (slip: reading smaller_exit_prob[1] for them)
    rows = {
        "a = 0.4, and an entry for E = 1": ({1: 0.5, 2: 0.4}, [[0.4, 0.6], [1.0, 0.0], [1.0, 0.0]]),
        "E = 2 missing: a = 0": ({}, [[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]),
        "a = 0 allowed": ({2: 0.0}, [[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]),
        "a = 1 allowed": ({2: 1.0}, [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),
    }
    for case, (probs, expected) in rows.items():
        torch.testing.assert_close(code_sampling_matrix(tree, probs), torch.tensor(expected, **F64),
                                   msg=case)
    # E_i = 3 shares a = 0.6 uniformly among exits 1 and 2: [0.3, 0.3, 0.4]
    torch.testing.assert_close(code_sampling_matrix(seven_nodes(), {3: 0.6})[0], torch.tensor([0.3, 0.3, 0.4], **F64))


@pytest.mark.parametrize(
    "probs, message",
    [
        ([0.4], "smaller_exit_prob must map E_i -> probability, got [0.4]"),
        ({2: 1.5}, "smaller_exit_prob[2] must be a probability in [0, 1], got 1.5"),
        ({2: "0.4"}, "smaller_exit_prob[2] must be a probability in [0, 1], got '0.4'"),
        ({2: True}, "smaller_exit_prob[2] must be a probability in [0, 1], got True"),
    ],
)
def test_code_sampling_matrix_refuses_what_is_not_a_probability(probs, message):
    assert error_text(lambda: code_sampling_matrix(three_node_topology(), probs)) == message


def test_a_given_p_matrix_is_checked_and_renormalised_in_float64():
    others = [[1.0, 0.0, 0.0]] * 6
    bad = {
        "a negative entry (no entry above 1)": [[0.6, 0.5, -0.1]] + others,
        "a NaN": [[float("nan"), 0.0, 1.0]] + others,
        "an entry above 1 (before the row sum is checked)": [[1.5, 0.0, 0.0]] + others,
    }
    for case, p in bad.items():
        text = error_text(lambda p=p: FedCIS(seven_nodes(), p=p))
        assert text.startswith("p entries must be probabilities in [0, 1], got [["), case
    assert error_text(lambda: FedCIS(seven_nodes(), p=[[1.0, 0.0, 0.0]])) == (
        "p must be a number or an [N, E] = [7, 3] matrix, got shape (1, 3)"
    )
    assert error_text(lambda: FedCIS(seven_nodes(), p="abc")) == (
        "p must be a number or an [N, E] = [7, 3] matrix, got 'abc'"
    )
    # a row within the 1e-6 tolerance is divided by its sum (slip: multiplied), and a float32 matrix is kept in
    # float64 (the documented dtype of p_matrix)
    p = torch.tensor([[0.5, 0.5 + 4e-7, 0.0]] + others, dtype=torch.float32)
    algo = FedCIS(seven_nodes(), p=p)
    assert algo.p_matrix.dtype == torch.float64
    row = p[0].double()
    torch.testing.assert_close(algo.p_matrix[0], row / row.sum(), atol=1e-15, rtol=0)
    torch.testing.assert_close(algo.p_matrix.sum(1), torch.ones(7, **F64), atol=1e-15, rtol=0)


def test_exit_masks_are_bool():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))  # 6 + 3 parameters
    masks = exit_masks(net, [[net[0]], [net[0], net[1]]])
    assert masks.dtype == torch.bool
    assert masks.tolist() == [[True] * 6 + [False] * 3, [True] * 9]


# ---------------------------------------------------------------------------------------------- Lambda-tilde
def test_flops_weights_called_directly():
    tree = three_node_topology()
    # static (the default schedule): flops / sum = (1, 3) / 4
    torch.testing.assert_close(lambda_tilde_weights("flops", tree, flops=[1.0, 3.0]),
                               torch.tensor([0.25, 0.75], **F64))
    # warm-up at the default round 0: f / f_E = (0.001, 1) clipped at 0.01 (t + 1) = 0.01 -> (0.001, 0.01) / 0.011
    # (round 1 would clip at 0.02: (1, 20) / 21)
    warm = lambda_tilde_weights("flops", tree, flops=[0.001, 1.0], flops_schedule="warmup")
    torch.testing.assert_close(warm, torch.tensor([1 / 11, 10 / 11], **F64))
    assert error_text(lambda: lambda_tilde_weights("flops", tree, flops=[0.0, 1.0])) == (
        "flops must lie in (0, inf), got 0.0"
    )
    assert error_text(lambda: lambda_tilde_weights("flops", tree, flops=[1, 2], flops_schedule="linear")) == (
        "flops_schedule must be one of ('static', 'warmup'), got 'linear'"
    )
    assert error_text(lambda: lambda_tilde_weights("fastest", tree)) == (
        "lambda_tilde must be one of ('serving_rate', 'equal', 'flops', 'balanced') or a tensor of 2 weights, "
        "got 'fastest'"
    )


def test_the_rules_default_round_is_round_zero():
    # the same warm-up through FedCIS: lambda_tilde_at() and pair_weights() without a round are round 0's.
    # p = 0, |D_i| = data_fraction (1/3 each): the root's pair (exit 2) weighs Lt_2 = 10/11, each leaf's (exit 1)
    # Lt_1 * (1/3) / (2/3) = 1/22
    algo = FedCIS(three_node_topology(), "flops", flops=[0.001, 1.0], flops_schedule="warmup")
    algo.setup(3, torch.zeros(2))
    torch.testing.assert_close(algo.lambda_tilde_at(), torch.tensor([1 / 11, 10 / 11], **F64))
    torch.testing.assert_close(algo.pair_weights(), torch.tensor([[0.0, 10 / 11], [1 / 22, 0.0], [1 / 22, 0.0]], **F64))


def test_balanced_weights_called_directly():
    tree = three_node_topology()
    # default p_matrix (p = 0) and |D_i| = data_fraction = 1/3: exit 1 held by the leaves (shares 1/2, 1/2,
    # concentration 1/2), exit 2 by the root (concentration 1). sigma^2 = (1, 1): o = (2, 1) -> (2/3, 1/3);
    # Lt = ((0.75, 0.25) + (2/3, 1/3)) / 2 = (17/24, 7/24). Slips: no default matrix, the matrix at p = 1, the
    # exit data sizes clamped at 1 instead of a hair above 0 (fractions are below 1).
    expected = torch.tensor([17 / 24, 7 / 24], **F64)
    torch.testing.assert_close(lambda_tilde_weights("balanced", tree, grad_variance=[1.0, 1.0]), expected)
    # variances scale o, which is normalised: (100, 100) gives the same weights (slip: refusing o.sum() <= 1)
    torch.testing.assert_close(lambda_tilde_weights("balanced", tree, grad_variance=[100.0, 100.0]), expected)
    # p = 1 on this tree: the root trains exit 1 too, nobody trains exit 2: o_2 = 0 (not 1 / (sigma^2 * 1e-300)).
    # Exit 1: shares 1/3 each, concentration 1/3, o = (3, 0) -> (1, 0); Lt = ((0.75, 0.25) + (1, 0)) / 2
    torch.testing.assert_close(
        lambda_tilde_weights("balanced", tree, p_matrix=sampling_matrix(tree, 1.0),
                             grad_variance=[1.0, 1.0]),
        torch.tensor([0.875, 0.125], **F64),
    )
    # integer sizes are read as float64 (|D| = (6, 2, 4), p = 0.25: (0.735, 0.265), see test_fedcis.py)
    lt = lambda_tilde_weights("balanced", tree, p_matrix=sampling_matrix(tree, 0.25),
                              sizes=torch.tensor([6, 2, 4]), grad_variance=[1.0, 1.0])
    assert lt.dtype == torch.float64
    torch.testing.assert_close(lt, torch.tensor([0.735, 0.265], **F64))
    # nobody holds data: refused (slip: 0 / 0 weights)
    assert error_text(lambda: lambda_tilde_weights("balanced", tree, sizes=[0, 0, 0],
                                                   grad_variance=[1.0, 1.0])) == (
        "lambda_tilde='balanced': no exit has training data"
    )


def test_balanced_pair_weights_use_the_client_sizes():
    # Lt = (0.735, 0.265) at p = 0.25, |D| = (6, 2, 4) (test_fedcis.py); pair weights Lt_e |D_i| / |D_{e,p}| / p_ie:
    # root: 0.735 * 6/12 / 0.25 = 1.47 and 0.265 * 6/6 / 0.75; leaves: 0.735 * 2/12 and 0.735 * 4/12.
    # Slip: Lambda-tilde computed from data_fraction instead of the sizes.
    algo = FedCIS(three_node_topology(), "balanced", p=0.25, grad_variance=[1.0, 1.0])
    algo.setup(3, torch.zeros(2), client_sizes=torch.tensor([6, 2, 4]))
    expected = torch.tensor([[1.47, 0.265 / 0.75], [0.735 / 6, 0.0], [0.735 / 3, 0.0]], **F64)
    torch.testing.assert_close(algo.pair_weights(0), expected)


# ---------------------------------------------------------------------------------------------- the rule
def test_a_new_rule_before_its_first_round():
    assert error_text(lambda: FedCIS("7-node")) == "topology must be a CISTopology, got str"
    algo = FedCIS(three_node_topology(), lambda_tilde=[1.0, 2.0])
    assert algo.lambda_tilde == "custom"
    assert algo.hparams()["lambda_tilde"] == [0.333333, 0.666667]  # rounded to 6 digits
    assert algo.exits.dtype == torch.int64 and algo.exits.tolist() == [0, 0, 0]  # 0 before the first draw
    assert algo.last_lambda_tilde is None and algo.last_exits == {}
    with pytest.raises(RuntimeError) as err:
        algo.client_config(0)
    assert str(err.value) == "FedCIS.client_config() called before select() drew this round's exits"
    algo.setup(3, torch.zeros(3))
    with pytest.raises(RuntimeError) as err:
        algo.open_round(0, None)
    assert str(err.value) == (
        "FedCIS draws each node's exit in select(), but select() was not called for round 0: do not pass a "
        "strategy-level selection= with FedCIS (it keeps every available node)"
    )


def test_select_returns_a_bool_mask_and_draws_from_each_nodes_own_row():
    # 5 exits; node 0 (E = 5) always trains exit 1, node 1 (E = 3) draws from [0.56, 0.33, 0.11]: u = 0.7 falls in
    # its second interval (slip: one cumulative sum over the whole matrix, which puts u = 0.7 before node 1's row)
    topo = CISTopology([[1], []], [5, 3], arrival=[1.0, 1.0], transfer_cap=0.0)
    algo = FedCIS(topo, p=[[1.0, 0.0, 0.0, 0.0, 0.0], [0.56, 0.33, 0.11, 0.0, 0.0]])
    algo.setup(2, torch.zeros(1))
    kept = algo.select(0, torch.tensor([1, 0]), FixedUniforms([0.5, 0.7]))
    assert kept.dtype == torch.bool and kept.tolist() == [True, False]
    assert algo.exits.tolist() == [1, 2]
    # the rounding guard: node 1's cumulative sum ends at 1 - 2^-53 (0.56 + 0.33 + 0.11 in float64), so the largest
    # uniform below 1 passes every entry; the draw is clipped to its last positive exit, E_1 = 3 (slips in where
    # that exit is found send it to exit 4 or 5, which the node does not hold, or to exit 1)
    assert np.cumsum(algo.p_matrix[1].numpy())[-1] < 1.0  # the premise
    algo.select(1, torch.ones(2, dtype=torch.bool), FixedUniforms([0.5, np.nextafter(1.0, 0.0)]))
    assert algo.exits.tolist() == [1, 3]


def test_one_arrival_is_aggregated():
    # literal, p = 0, serving rates, |D| = (6, 2, 4): leaf 1's weight is 0.75 * 2/6 = 0.25; it arrives alone.
    # w = 1 + 0.25 [1, 2, 0] (slip: a round with a single arrival left unaggregated)
    algo = FedCIS(three_node_topology())
    algo.setup(3, torch.ones(3), client_weights=[1.0, 1.0, 2.0], client_sizes=torch.tensor([6, 2, 4]))
    # Fed-CIS weighs by the sizes; the client weights are kept (normalised) for the checkpoint all the same
    assert algo.client_weights.tolist() == [0.25, 0.25, 0.5]
    algo.select(0, ALL3, FixedUniforms([0.9] * 3))
    algo.open_round(0, None)
    algo.add(1, D_LEAF1, INFO)
    torch.testing.assert_close(algo.close_round(), torch.tensor([1.25, 1.5, 1.0]))


def test_root_local_with_an_exit_coefficient_of_exactly_one():
    # Lt = (1, 0), |D| = (6, 4, 0): leaf 1 holds all of exit 1's data, a_1 = 1 * 4/4 / 1 = 1 = A_1.
    # w_r = [1,1,1] + [2,0,4] = [3,1,5]; leaf 1: (w_1 - w_r) masked by exit 1 = ([2,3,1] - [3,1,5]) * [1,1,0]
    # = [-1, 2, 0]; w = [3,1,5] + [-1,2,0] = [2,3,5] (slip: skipping the base's correction when A_e = 1)
    algo = FedCIS(three_node_topology(), lambda_tilde=[1.0, 0.0], aggregation_base="root_local", exit_masks=TOY_MASKS)
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 4, 0]))
    algo.select(0, ALL3, FixedUniforms([0.9] * 3))
    algo.open_round(0, None)
    algo.add(0, D_ROOT_EXIT2, INFO)
    algo.add(1, D_LEAF1, INFO)
    torch.testing.assert_close(algo.close_round(), torch.tensor([2.0, 3.0, 5.0]))


def test_root_local_keeps_its_own_copy_of_the_roots_update():
    # the caller may reuse the delta's buffer after add(): the result is test_fedcis.py's [3.25, 1, 5]
    algo = FedCIS(three_node_topology(), aggregation_base="root_local", exit_masks=TOY_MASKS)
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    algo.select(0, ALL3, FixedUniforms([0.9] * 3))
    algo.open_round(0, None)
    buffer = D_ROOT_EXIT2.clone()
    algo.add(0, buffer, INFO)
    buffer.zero_()
    algo.add(1, D_LEAF1, INFO)
    algo.add(2, D_LEAF2, INFO)
    torch.testing.assert_close(algo.close_round(), torch.tensor([3.25, 1.0, 5.0]))


def test_a_checkpoint_taken_after_the_draw_resumes_the_round():
    algo = FedCIS(three_node_topology(), p=0.25)
    algo.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    algo.select(4, ALL3, FixedUniforms([0.1, 0.5, 0.5]))  # the root draws exit 1 (u < 0.25)
    state = algo.state_dict()
    resumed = FedCIS(three_node_topology(), p=0.25)
    resumed.setup(3, torch.ones(3), client_sizes=torch.tensor([6, 2, 4]))
    resumed.load_state_dict(state)
    assert resumed.client_config(0) == {"train_exit": 1}  # the drawn exits of round 4 stand
    resumed.open_round(4, None)  # and round 4 may open without a new draw
    # a checkpoint written before last_exits existed loads with none
    del state["last_exits"]
    older = FedCIS(three_node_topology(), p=0.25)
    older.load_state_dict(state)
    assert older.last_exits == {}
