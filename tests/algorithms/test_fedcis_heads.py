"""FedCIS(aggregate_heads=False): the released code's aggregation, which leaves every exit head out (hand-computed)."""

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms.base import ClientInfo
from lightning_fedhet.algorithms.fedcis import FedCIS
from lightning_fedhet.cis import CISTopology

INFO = ClientInfo(num_samples=1, local_steps=1)

# d = 4 coordinates: [block of both exits, head of exit 1, block of exit 2 only, head of exit 2]
MASKS = torch.tensor([[True, True, False, False], [True, False, True, True]])
HEADS = torch.tensor([False, True, False, True])
D_ROOT = torch.tensor([2.0, 0.0, 4.0, -2.0])  # the root trains exit 2: head 1 untouched
D_LEAF = torch.tensor([1.0, 2.0, 0.0, 0.0])  # the leaf holds exit 1 only


def two_node_topology() -> CISTopology:
    # root 0 (E = 2) above leaf 1 (E = 1); requests arrive at the leaf (1), which forwards 0.25: Lambda = (0.75,
    # 0.25), already summing to 1, so Serving Rate's Lt = (0.75, 0.25).
    return CISTopology([[1], []], [2, 1], arrival=[0.0, 1.0], transfer_cap=[0.0, 0.25])


def one_round(algo: FedCIS, deltas: dict[int, torch.Tensor]) -> torch.Tensor:
    algo.setup(2, torch.ones(4), client_sizes=torch.tensor([6, 2]))  # |D_0| = 6, |D_1| = 2
    algo.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(0))  # p = 0: root exit 2, leaf exit 1
    algo.open_round(0, None)
    for c, d in deltas.items():
        algo.add(c, d, INFO)
    return algo.close_round()


def test_two_nodes_heads_left_out_blocks_aggregated_as_before():
    """Serving Rate, p = 0, w_t = [1, 1, 1, 1]. |D_{1,p}| = |D_leaf| = 2 (only the leaf may train exit 1),
    |D_{2,p}| = |D_root| = 6, so the pair weights are a_leaf = 0.75 * 2/2 / 1 = 0.75, a_root = 0.25 * 6/6 / 1 = 0.25.

    literal, heads aggregated:  w = w_t + 0.25 [2, 0, 4, -2] + 0.75 [1, 2, 0, 0] = [2.25, 2.5, 2, 0.5]
    literal, heads not:         the head coordinates (1 and 3) stay w_t's:            [2.25, 1, 2, 1]
    root_local, heads aggregated: w_r = w_t + delta_root = [3, 1, 5, -1]; the leaf's model [2, 3, 1, 1] minus w_r =
        [-1, 2, -4, 2], on exit 1's sub-model [1, 1, 0, 0]: [-1, 2, 0, 0] x 0.75 -> w = [2.25, 2.5, 5, -1]
    root_local, heads not: exit 1's sub-model without its head, [1, 0, 0, 0]: w = [2.25, 1, 5, -1], i.e. both heads
        are the root's own (head 1 its untrained initial value 1, head 2 its trained -1), the blocks as before.
    """
    expected = {
        ("literal", True): [2.25, 2.5, 2.0, 0.5],
        ("literal", False): [2.25, 1.0, 2.0, 1.0],
        ("root_local", True): [2.25, 2.5, 5.0, -1.0],
        ("root_local", False): [2.25, 1.0, 5.0, -1.0],
    }
    for (base, heads), want in expected.items():
        for order in ((0, 1), (1, 0)):  # the root may arrive first or last
            kwargs = {"exit_masks": MASKS} if base == "root_local" else {}
            if not heads:
                kwargs["head_mask"] = HEADS
            algo = FedCIS(two_node_topology(), "serving_rate", p=0.0, aggregation_base=base, aggregate_heads=heads,
                          **kwargs)
            w = one_round(algo, {c: {0: D_ROOT, 1: D_LEAF}[c] for c in order})
            torch.testing.assert_close(w, torch.tensor(want), atol=1e-12, rtol=0, msg=f"{base}, heads={heads}")
            assert algo.hparams()["aggregate_heads"] is heads


def test_root_lost_heads_stay_the_broadcast_ones():
    # root_local without the root's update: the base is w_t; the leaf moves the block only,
    # w = [1, 1, 1, 1] + 0.75 [1, 0, 0, 0] = [1.75, 1, 1, 1]
    algo = FedCIS(two_node_topology(), p=0.0, aggregation_base="root_local", exit_masks=MASKS,
                  aggregate_heads=False, head_mask=HEADS)
    torch.testing.assert_close(one_round(algo, {1: D_LEAF}), torch.tensor([1.75, 1.0, 1.0, 1.0]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("value", [0, 1, "False", None, np.array(False)])
def test_aggregate_heads_must_be_a_bool(value):
    with pytest.raises(ValueError) as err:
        FedCIS(two_node_topology(), aggregate_heads=value, head_mask=HEADS)
    assert str(err.value) == f"aggregate_heads must be True or False, got {value!r}"


def test_head_mask_validation():
    topo = two_node_topology()
    with pytest.raises(ValueError, match=r"aggregate_heads=False needs head_mask \(bool \[d\]"):
        FedCIS(topo, aggregate_heads=False)
    with pytest.raises(ValueError, match="head_mask only applies to aggregate_heads=False"):
        FedCIS(topo, head_mask=HEADS)
    for bad in (HEADS.float(), HEADS[None, :], torch.zeros(4, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"head_mask must be a bool tensor of shape \[d\]"):
            FedCIS(topo, aggregate_heads=False, head_mask=bad)
    algo = FedCIS(topo, aggregate_heads=False, head_mask=torch.tensor([False, True, True]))
    with pytest.raises(ValueError, match="head_mask has 3 entries but the parameter vector has d = 4 entries"):
        algo.setup(2, torch.ones(4))
