"""The stale-update memory shared by FedStale, FedVARP and MIFA, and those rules' options, by hand.

Written against the survivors of the ``fedstale`` mutation chunk (docs/testing.md): sharding over processes, the
checkpointed rows, copies that must not alias the memory, MIFA with non-uniform weights, FedVARP forwarding its
arguments, and the errors. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import MIFA, FedStale, FedVARP, IntervalEstimator
from lightning_fedhet.algorithms.base import ShardedRows
from lightning_fedhet.algorithms.fedstale import StaleMemory
from tests.algorithms.rule_rounds import F64, close, run_round, setup

W5 = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=F64)


def _memory(rank: int = 0, world_size: int = 1, dtype=torch.float32) -> StaleMemory:
    memory = StaleMemory(dtype)
    memory.shard(rank, world_size)
    memory.allocate(5, 2, W5, torch.device("cpu"))
    return memory


# ------------------------------------------------------------------------------------------ StaleMemory
def test_a_shard_keeps_every_world_size_th_row_and_checkpoints_them_with_their_ids():
    # 5 clients on 2 processes: rank 1 keeps clients 1 and 3 (rows 0 and 1 of its buffer). Slips caught: the step of
    # the rows dropped (rank 1 would keep 1, 2, 3, 4), the ShardedRows fields swapped or lost.
    memory = _memory(rank=1, world_size=2)
    assert memory.data.shape == (2, 2) and memory.nbytes == 5 * 2 * 4
    memory.write(3, torch.tensor([7.0, 8.0]))
    shard = memory.state_dict()["data"]
    assert isinstance(shard, ShardedRows)
    assert shard.rows.tolist() == [1, 3] and shard.num_rows == 5
    torch.testing.assert_close(shard.values, torch.tensor([[0.0, 0.0], [7.0, 8.0]]))
    with pytest.raises(ValueError, match=r"^client 2's memory row is kept by process 0, not by this one \(1\): a "
                                         r"client with per-client server state must train on process "
                                         r"client % world_size$"):
        memory.read(2, torch.zeros(2))


def test_a_sharded_write_moves_pending_not_the_total_until_the_round_settles():
    # H = sum_j alpha_j h_j; a write of h_3 = [7, 8] on a shard adds alpha_3 [7, 8] = [1.75, 2] to `pending` only.
    memory = _memory(rank=1, world_size=2)
    memory.write(3, torch.tensor([7.0, 8.0]))
    torch.testing.assert_close(memory.total, torch.zeros(2, dtype=F64))
    torch.testing.assert_close(memory.shares().sums[0], torch.tensor([1.75, 2.0], dtype=F64))
    memory.settle()
    torch.testing.assert_close(memory.total, torch.tensor([1.75, 2.0], dtype=F64))
    assert not memory.pending.any()
    unsharded = _memory()
    assert unsharded.shares().sums == [] and unsharded.pending is None


def test_gathered_shards_load_into_any_process_count():
    # The strategy gathers both shards' rows into the full [5, 2] tensor (here by hand, from each row's id); a
    # one-process memory and a rank-0-of-2 memory load it and keep their own rows.
    shards = [_memory(rank, 2) for rank in range(2)]
    for client in range(5):
        shards[client % 2].write(client, torch.tensor([client, -client], dtype=torch.float32))
    full = torch.zeros(5, 2)
    for shard in shards:
        rows = shard.state_dict()["data"]
        full[rows.rows] = rows.values
    total = sum(W5[c] * torch.tensor([c, -c], dtype=F64) for c in range(5))
    state = {"data": ShardedRows(torch.tensor([4, 0, 1, 2, 3]), full[[4, 0, 1, 2, 3]], 5), "total": total}
    one = StaleMemory()
    one.load_state_dict(state, W5, torch.device("cpu"))
    torch.testing.assert_close(one.data, full)
    assert one.num_clients == 5 and one.nbytes == 5 * 2 * 4
    rank0 = StaleMemory()
    rank0.shard(0, 2)
    rank0.load_state_dict(state, W5, torch.device("cpu"))
    torch.testing.assert_close(rank0.data, full[[0, 2, 4]])
    assert not rank0.pending.any()
    torch.testing.assert_close(rank0.total, total)
    lone = StaleMemory()
    with pytest.raises(ValueError, match=r"^the memory state holds 2 of 5 clients' rows \(one process's shard\): save "
                                         r"checkpoints through the strategy, which gathers every process's rows$"):
        lone.load_state_dict({"data": ShardedRows(torch.tensor([1, 3]), full[[1, 3]], 5), "total": total}, W5,
                             torch.device("cpu"))
    empty = StaleMemory()
    empty.load_state_dict(StaleMemory().state_dict(), W5, torch.device("cpu"))
    assert empty.data is None and empty.total is None and empty.nbytes == 0


def test_reads_and_checkpoints_are_copies():
    # Slip caught: copy=False on a read whose dtype already matches (the caller's tensor would alias the memory).
    memory = _memory(dtype=F64)
    memory.write(0, torch.tensor([1.0, 2.0], dtype=F64))
    row = memory.read(0, torch.zeros(2, dtype=F64))
    row.add_(100.0)
    torch.testing.assert_close(memory.read(0, torch.zeros(2, dtype=F64)), torch.tensor([1.0, 2.0], dtype=F64))
    state = memory.state_dict()
    state["data"].add_(100.0)
    state["total"].add_(100.0)
    torch.testing.assert_close(memory.data[0], torch.tensor([1.0, 2.0], dtype=F64))
    torch.testing.assert_close(memory.total, torch.tensor([0.1, 0.2], dtype=F64))


@pytest.mark.parametrize(("rank", "world_size"), [(0, 0), (2, 2), (-1, 2)])
def test_a_rank_outside_the_world_is_refused(rank, world_size):
    with pytest.raises(ValueError, match=rf"^rank must be in \[0, world_size\) and world_size >= 1, got rank={rank}, "
                                         rf"world_size={world_size}$"):
        StaleMemory().shard(rank, world_size)


def test_a_world_of_one_is_not_sharded():
    memory = _memory(0, 1)
    assert not memory.sharded and memory.data.shape == (5, 2)


# ------------------------------------------------------------------------------------------ the rules' options
def test_rules_shard_their_memory_only_when_they_keep_one():
    assert FedStale(beta=0.0).shard_client_state(0, 2) is False  # unbiased FedAvg: no memory
    for algo in (FedStale(beta=0.5), FedVARP(), MIFA()):
        assert algo.shard_client_state(1, 2) is True and algo.memory.sharded


def test_mifa_with_non_uniform_weights_by_hand():
    # w += sum_j alpha_j y_j after the refresh, alpha = [1/4, 3/4]. Round 0: y = [4, 0] -> w = 1. Round 1:
    # y = [4, 2] -> w = 1 + 1 + 1.5 = 3.5. Slip caught: the client weights dropped (1/2 each: 2, then 5).
    algo = setup(MIFA(), 2, [0.0], torch.tensor([1.0, 3.0], dtype=F64))
    close(run_round(algo, 0, 2, {0: [4.0]}), [1.0])
    close(run_round(algo, 1, 2, {1: [2.0]}), [3.5])
    assert algo.last_weights == pytest.approx({1: 0.75})


def test_hparams_report_every_option_and_fedvarp_forwards_them():
    expected = {"weighting": "known_p", "p_source": "fedau", "fedau_K": 7,
                "memory_dtype": "torch.bfloat16", "memory_device": "cpu", "server_lr": 0.5, "empty_round": "stale"}
    varp = FedVARP(weighting="known_p", p_source="fedau", fedau_K=7, memory_dtype=torch.bfloat16,
                   memory_device="cpu", server_lr=0.5, empty_round="stale")
    assert varp.hparams() == expected and varp.beta == 1.0  # FedVARP is FedStale at beta = 1, not reported
    assert FedVARP().hparams()["fedau_K"] is None
    assert FedVARP(weighting="known_p", p_source="fedau").hparams()["fedau_K"] == 50
    assert FedStale(beta=0.5, p_source="fedau").fedau_K == 50
    assert FedStale(beta=0.5).hparams() == {**expected, "beta": 0.5, "p_source": "known", "fedau_K": None,
                                            "memory_dtype": "torch.float32", "server_lr": 1.0, "empty_round": "skip"}
    owned = IntervalEstimator(K=9)
    custom = FedStale(beta=0.2, p_source=owned)
    assert custom.estimator is owned and custom.hparams()["p_source"] == "fedau" and custom.fedau_K == 9
    assert FedStale(beta=0.5, weighting="participating").hparams()["p_source"] == "known"
    assert MIFA(memory_dtype=torch.float64, server_lr=2.0).hparams() == {
        "memory_dtype": "torch.float64", "memory_device": "cpu", "server_lr": 2.0, "empty_round": "stale"}
    assert FedStale(beta=0.5).participation_estimates() is None


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FedStale(beta=1.5), r"^beta must lie in \[0, 1\], got 1.5$"),
        (lambda: FedStale(beta=0.5, weighting="all"), r"^weighting must be one of"),
        (lambda: FedStale(beta=0.5, empty_round="none"), r"^empty_round must be one of"),
        (lambda: FedStale(beta=0.5, weighting="participating", p_source="fedau"),
         r"^p_source='fedau' only applies to weighting='known_p' \('participating' uses no p_i\)$"),
        (lambda: FedStale(beta=0.5, server_lr=0.0), r"^server_lr must lie in \(0, inf\), got 0.0$"),
        (lambda: FedStale(beta=0.5, memory_device="gpu0"), r"^memory_device"),
        (lambda: MIFA(server_lr=0.0), r"^server_lr must lie in \(0, inf\), got 0.0$"),
        (lambda: MIFA(server_lr=float("inf")), r"^server_lr must be finite, got inf$"),
        (lambda: MIFA(empty_round="none"), r"^empty_round must be one of"),
    ],
)
def test_bad_arguments_name_the_parameter(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_round_protocol_errors():
    known = setup(FedStale(beta=0.5), 2, [0.0])
    with pytest.raises(ValueError, match=r"^weighting='known_p' with p_source='known' needs "
                                         r"RoundContext\.participation_probs$"):
        known.open_round(0, None)
    with pytest.raises(ValueError, match=r"^state has no participation estimator but p_source='fedau'$"):
        setup(FedStale(beta=0.5, p_source="fedau"), 2, [0.0]).load_state_dict(known.state_dict())


def test_a_loaded_memory_takes_its_own_dtype_and_does_not_alias_the_state():
    # A float32 checkpoint loaded into a bfloat16 memory is stored as bfloat16 (memory_dtype is the rule's option);
    # later changes to the state's tensors do not reach the memory; an unsharded memory has no pending sum.
    source = _memory()
    source.write(1, torch.tensor([1.5, -2.0]))
    state = source.state_dict()
    target = StaleMemory(torch.bfloat16)
    target.load_state_dict(state, W5, torch.device("cpu"))
    assert target.data.dtype == torch.bfloat16 and target.total.dtype == F64 and target.pending is None
    state["data"].add_(100.0)
    state["total"].add_(100.0)
    torch.testing.assert_close(target.data[1].float(), torch.tensor([1.5, -2.0]))
    torch.testing.assert_close(target.total, torch.tensor([0.3, -0.4], dtype=F64))


def test_the_rules_keep_the_client_sizes():
    for algo in (FedStale(beta=0.5), MIFA()):
        algo.setup(2, torch.zeros(1, dtype=F64), None, torch.tensor([4, 9]))
        assert algo.client_sizes.tolist() == [4, 9]
