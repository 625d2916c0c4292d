"""The server's lifecycle by hand: what it gives the rule at setup and with every update, the history it writes,
the state it checkpoints, the shares it hands the many-process strategy, and its errors.

Written against the survivors of the ``server`` mutation chunk (docs/testing.md): each test names the slips it
catches. Four clients hold 1, 2, 3 and 4 samples; all are available and selected.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.algorithms.base import ClientInfo
from lightning_fedhet.server import LARGE_MEMORY_BYTES, Server
from lightning_fedhet.system import ShiftedExponential
from tests.helpers import four_client_server


class Spy(FedAvg):
    """FedAvg that records what the server hands it (setup arguments and each update's ClientInfo)."""

    def __init__(self, *args, memory: int = 0, per_submodel: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.memory = memory
        self.per_submodel = per_submodel
        self.setup_args: tuple = ()
        self.infos: dict[int, ClientInfo] = {}

    @property
    def buffers_per_submodel(self) -> bool:  # an instance switch over the class flag
        return self.per_submodel

    @property
    def memory_bytes(self) -> int:
        return self.memory

    def setup(self, num_clients, init_params, client_weights=None, client_sizes=None):
        self.setup_args = (num_clients, init_params.clone(), client_weights, client_sizes)
        super().setup(num_clients, init_params, client_weights, client_sizes)

    def add(self, client, delta, info):
        self.infos[client] = info
        super().add(client, delta, info)


def _server(algorithm=None, **kwargs) -> Server:
    """:func:`tests.helpers.four_client_server` with local steps 1, 2, 3, 4 and the recording FedAvg by default."""
    return four_client_server(Spy(weighting="samples") if algorithm is None else algorithm, local_steps=[1, 2, 3, 4],
                              **kwargs)


# ------------------------------------------------------------------------------------------ setup
def test_setup_hands_the_rule_n_the_initial_parameters_and_the_sample_counts():
    # Slips caught: alpha dropped or always given, the condition on "samples" inverted or misspelt, the sizes
    # dropped or cast to float, the buffers handed to the rule with the parameters.
    spy = Spy()
    _server(spy, num_parameters=2, extra=1)
    num_clients, init, alpha, sizes = spy.setup_args
    assert num_clients == 4
    torch.testing.assert_close(init, torch.zeros(2))
    assert alpha is None  # uniform: the base class makes alpha_i = 1/N
    assert sizes.dtype == torch.int64 and sizes.tolist() == [1, 2, 3, 4]

    spy = Spy()
    _server(spy, client_weights="samples")
    alpha, sizes = spy.setup_args[2], spy.setup_args[3]
    assert alpha.dtype == torch.float64 and alpha.tolist() == [1.0, 2.0, 3.0, 4.0]
    torch.testing.assert_close(spy.client_weights, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))


def test_client_weights_samples_weigh_average_all_by_data_size():
    # FedAvg "average all": w_{t+1} = w_t + sum_{arrived} alpha_i delta_i. Clients 0, 1, 2 arrive with deltas
    # e_0, e_1, e_0 + e_1. Uniform alpha = 1/4: [2/4, 2/4]. Sample alpha = |D_i| / 10: [(1 + 3)/10, (2 + 3)/10].
    deltas = {0: [1.0, 0.0, 0.0], 1: [0.0, 1.0, 0.0], 2: [1.0, 1.0, 0.0]}
    for client_weights, expected in (("uniform", [0.5, 0.5]), ("samples", [0.4, 0.5])):
        server = _server(FedAvg(weighting="all"), client_weights=client_weights)
        server.begin_round(0)
        for client, delta in deltas.items():
            assert server.submit(client, torch.tensor(delta), 0.0)
        torch.testing.assert_close(server.close_round()[:2], torch.tensor(expected))


def test_a_fresh_server_has_no_integer_buffers_and_no_client():
    # Slips caught: the empty int64 counter vector made float or of length 1; current_client not None.
    server = _server()
    assert server.global_ints.dtype == torch.int64 and server.global_ints.numel() == 0
    assert server.current_client is None and server.next_round == 0 and server.rejected_total == 0


def test_a_rule_with_large_per_client_state_is_warned_about_at_the_callers_line():
    # The warning names the rule and its MiB (2**20 bytes), N x d, and the fix; it points at the line that built the
    # server, not inside server.py (stacklevel 2), and state of exactly LARGE_MEMORY_BYTES is not warned about. Slips
    # caught: `>=`, `2**21` / `3**20` / `* 2**20`, the message or the fix text lost, stacklevel 1. (The exact caller
    # line is not asserted: mutmut's trampoline adds a frame, so the caller is a different file under mutation.)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _server(Spy(memory=LARGE_MEMORY_BYTES))
    with pytest.warns(UserWarning) as caught:
        _server(Spy(memory=300 * 2**20))
    (warning,) = caught
    assert str(warning.message) == (
        "Spy keeps 300 MiB of per-client state (N x d = 4 x 2), and every checkpoint carries it: pass "
        "memory_dtype=torch.bfloat16 to halve it"
    )
    assert Path(warning.filename).name != "server.py"


# ------------------------------------------------------------------------------------------ clients
def test_start_client_hands_the_client_its_id_the_global_model_and_the_integer_buffers():
    # Slips caught: ClientStart without the id or the integer buffers; current_client not recorded or not reset.
    ints = torch.tensor([7, -2], dtype=torch.int64)
    server = _server(init_ints=ints)
    server.begin_round(0)
    assert server.current_client is None
    start = server.start_client(2)
    assert start.client == 2 and server.current_client == 2
    assert start.global_vector is server.global_vector
    assert start.int_buffers.tolist() == [7, -2] and start.int_buffers.dtype == torch.int64
    assert start.config == {} and start.optimizer_state is None
    server.close_round()
    assert server.current_client is None


def test_each_update_reaches_the_rule_with_the_clients_samples_steps_and_loss():
    # Local steps per client are 1, 2, 3, 4 (FedNova reads them). Slip caught: a wrong field of ClientInfo.
    spy = Spy()
    server = _server(spy)
    server.begin_round(0)
    for client in range(3):
        server.submit(client, torch.zeros(3), 0.5 + client)
    assert {c: (i.num_samples, i.local_steps, i.loss) for c, i in spy.infos.items()} == {
        0: (1, 1, 0.5), 1: (2, 2, 1.5), 2: (3, 3, 2.5)}


def test_reset_keeps_no_optimizer_state_and_persist_keeps_each_clients_own():
    # Slip caught: storing states under "reset" (they would then be checkpointed and could leak into a later
    # "persist" resume), or returning them.
    state = [{"state": {0: {"momentum_buffer": torch.ones(1)}}}]
    for mode, kept in (("reset", {}), ("persist", {1: state})):
        server = _server(optimizer_state=mode)
        server.begin_round(0)
        server.submit(1, torch.zeros(3), 0.0, optimizer_state=state)
        server.close_round()
        assert server.state_dict()["client_optim_states"] == kept
        server.begin_round(1)
        assert server.start_client(1).optimizer_state == (state if mode == "persist" else None)
        assert server.start_client(0).optimizer_state is None


def test_submit_cohort_moves_the_integer_buffers_like_submit():
    # Slip caught: the cohort's int_deltas ignored. Arrived 0 (|D|=1, +6) and 2 (|D|=3, +2): (6 + 6) / 4 = 3.
    server = _server(num_parameters=1, extra=0, init_ints=torch.tensor([5], dtype=torch.int64))
    server.begin_round(0)
    kept = server.submit_cohort([0, 2, 3], torch.zeros(3, 1), [0.0] * 3,
                                int_deltas=torch.tensor([[6], [2], [100]], dtype=torch.int64))
    assert kept == [True, True, False]
    server.close_round()
    assert server.global_ints.tolist() == [8] and server.global_ints.dtype == torch.int64


# ------------------------------------------------------------------------------------------ buffers per sub-model
def test_per_submodel_buffers_average_each_entry_over_the_clients_that_changed_it():
    # Fed-CIS-style sub-models: buffer entry 0 is changed by clients 0 (|D|=1, +10) and 2 (|D|=3, +2); entry 1 only by
    # client 0 (+4); entry 2 by nobody. Per entry: [(10 + 6) / 4, 4 / 1, 0]. Integer buffers the same way:
    # entry 0 changed by 0 (+1) and 2 (+5): round(16 / 4) = 4; entry 1 only by 0 (+1): 1.
    # Slips caught: `change == 0` (weights of the clients that did *not* hold the entry), `int_delta != 1`,
    # `per_entry > 1` and `clamp_min(2.0)` (an entry held only by the one-sample client).
    server = _server(Spy(weighting="samples", per_submodel=True), num_parameters=1, extra=3,
                     init_ints=torch.tensor([0, 0], dtype=torch.int64))
    server.begin_round(0)
    ints = {0: [1, 1], 2: [5, 0]}
    for client, buffers in ((0, [10.0, 4.0, 0.0]), (2, [2.0, 0.0, 0.0])):
        server.submit(client, torch.tensor([0.0, *buffers]), 0.0,
                      int_delta=torch.tensor(ints[client], dtype=torch.int64))
    new = server.close_round()
    torch.testing.assert_close(new[1:], torch.tensor([4.0, 4.0, 0.0]))
    assert server.global_ints.tolist() == [4, 1]


def test_one_arrival_of_one_sample_moves_the_buffers_by_its_change():
    # The arrived clients hold one sample in all (weight 1). Slip caught: `weight > 1` for either buffer kind.
    server = _server(num_parameters=1, extra=1, lost=(1, 2, 3), init_ints=torch.tensor([0], dtype=torch.int64))
    server.begin_round(0)
    assert server.submit(0, torch.tensor([0.0, 3.0]), 0.0, int_delta=torch.tensor([2], dtype=torch.int64))
    torch.testing.assert_close(server.close_round(), torch.tensor([0.0, 3.0]))
    assert server.global_ints.tolist() == [2]


# ------------------------------------------------------------------------------------------ many processes
@pytest.mark.parametrize("per_submodel", [False, True])
def test_round_shares_are_the_buffer_sums_then_the_ids_then_the_rules_shares(per_submodel):
    # What the many-process strategy sums over processes: float64 sums of the sample-weighted buffer changes
    # (zeros of the right sizes when this process received nobody), then per-entry weights for per-sub-model rules,
    # then the received and rejected ids, then the rule's own shares. Slips caught: sums of the wrong size, dtype or
    # order, the per-entry weights missing or replacing the sums, tables missing, the rule's shares dropped.
    spy = Spy(weighting="samples", per_submodel=per_submodel)
    server = _server(spy, num_parameters=1, extra=2, init_ints=torch.tensor([0, 0, 0], dtype=torch.int64))
    server.begin_round(0)
    empty = server.round_shares()
    sizes = [2, 3, 2, 3] if per_submodel else [2, 3]
    assert [s.numel() for s in empty.sums[: len(sizes)]] == sizes
    assert all(s.dtype == torch.float64 and not s.any() for s in empty.sums[: len(sizes)])
    assert empty.tables[:2] == [[], []]
    rule = spy.round_shares()
    assert len(empty.sums) == len(sizes) + len(rule.sums) and len(empty.tables) == 2 + len(rule.tables)

    server = _server(Spy(weighting="samples", per_submodel=per_submodel), num_parameters=1, extra=2,
                     init_ints=torch.tensor([0, 0, 0], dtype=torch.int64))
    server.begin_round(0)
    server.submit(1, torch.tensor([0.0, 1.0, 0.0]), 0.0, int_delta=torch.tensor([0, 3, 0], dtype=torch.int64))
    server.submit(2, torch.tensor([float("nan"), 1.0, 1.0]), 0.0)
    shares = server.round_shares()
    torch.testing.assert_close(shares.sums[0], torch.tensor([2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(shares.sums[1], torch.tensor([0.0, 6.0, 0.0], dtype=torch.float64))
    if per_submodel:
        torch.testing.assert_close(shares.sums[2], torch.tensor([2.0, 0.0], dtype=torch.float64))
        torch.testing.assert_close(shares.sums[3], torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64))
    assert shares.tables[:2] == [[1], [2]]


def test_a_round_whose_shares_were_taken_with_nobody_arrived_leaves_the_buffers_alone():
    # round_shares() creates zero sums even when nobody arrived; closing must then not divide by a zero weight.
    # Slip caught: `weight >= 0` (0 / 0 = nan in the buffers and the counters).
    server = _server(num_parameters=1, extra=1, lost=(0, 1, 2, 3), init_ints=torch.tensor([4], dtype=torch.int64))
    server.begin_round(0)
    server.round_shares()
    torch.testing.assert_close(server.close_round(), torch.zeros(2))
    assert server.global_ints.tolist() == [4]


# ------------------------------------------------------------------------------------------ history
def test_history_records_a_complete_round_with_its_bytes_time_and_memory():
    # Round records by hand: 4 clients selected and trained, the model is 3 float32 = 12 bytes each way; no update
    # is submitted, so every trained client's steps are wasted. sim_time adds up each round's duration.
    # Slips caught: `complete` False by default or dropped, round_record's arguments shifted, the previous sim_time
    # ignored or starting at 1.
    latency = ShiftedExponential(shift=1.0, mean=1.0, speed_factors=(1.0,), group_fractions=(1.0,))
    server = _server(Spy(memory=64), latency=latency)
    durations = []
    for round in range(2):
        durations.append(server.begin_round(round).duration)
        server.close_round()
    assert all(d > 1.0 for d in durations)  # shift 1 s per step at least
    first, second = server.history
    assert first["complete"] is True and first["round"] == 0
    assert first["download_bytes"] == 4 * 12 and first["upload_bytes"] == 4 * 12
    assert first["memory_bytes"] == 64 and first["local_steps"] == {0: 1, 1: 2, 2: 3, 3: 4}
    assert first["wasted_steps"] == 1 + 2 + 3 + 4  # nobody submitted: every trained client's steps were wasted
    assert first["sim_time"] == pytest.approx(durations[0])
    assert second["sim_time"] == pytest.approx(durations[0] + durations[1])
    server.begin_round(2)
    server.close_round(complete=False)
    assert server.history[-1]["complete"] is False


def test_a_rule_that_returns_non_finite_parameters_stops_the_run_naming_the_round():
    class Broken(FedAvg):
        def close_round(self):
            return torch.full_like(super().close_round(), float("nan"))

    server = _server(Broken())
    server.begin_round(0)
    with pytest.raises(FloatingPointError, match=r"^round 0: the algorithm produced non-finite global parameters$"):
        server.close_round()


# ------------------------------------------------------------------------------------------ checkpoints
def test_state_dict_round_trip_resumes_the_run_exactly():
    # A server that ran two rounds (a rejection, moved counters, persisted optimizer states) is saved and loaded into
    # a fresh one; both then run round 2 with the same updates and must agree in everything. Slips caught: a key
    # renamed on one side, a field not saved or not restored, the history or the optimizer states lost.
    def run_round(server, round):
        server.begin_round(round)
        server.submit(0, torch.tensor([1.0, 0.0, 2.0]), 0.0, int_delta=torch.tensor([3], dtype=torch.int64),
                      optimizer_state=[{"round": round}])
        server.submit(1, torch.tensor([float("inf"), 0.0, 0.0]), 0.0)
        server.submit(2, torch.tensor([0.0, 1.0, 4.0]), 0.0, int_delta=torch.tensor([1], dtype=torch.int64))
        return server.close_round()

    options = dict(optimizer_state="persist", init_ints=torch.tensor([0], dtype=torch.int64))
    first = _server(**options)
    for round in range(2):
        run_round(first, round)
    state = first.state_dict()
    assert set(state) == {"global_vector", "global_ints", "algorithm", "history", "rejected_total", "next_round",
                          "client_optim_states"}
    resumed = _server(**options)
    resumed.load_state_dict(state)
    assert resumed.next_round == 2 and resumed.rejected_total == 2 and len(resumed.history) == 2
    assert not resumed.round_open
    assert resumed.global_ints.tolist() == [4]  # round((1 * 3 + 3 * 1) / 4) = 2 per round
    for server in (first, resumed):
        run_round(server, 2)
    torch.testing.assert_close(resumed.global_vector, first.global_vector)
    assert resumed.global_ints.tolist() == first.global_ints.tolist() == [6]
    assert resumed.rejected_total == first.rejected_total == 3
    assert [h["round"] for h in resumed.history] == [0, 1, 2]
    resumed.begin_round(3)
    assert resumed.start_client(0).optimizer_state == [{"round": 2}]


# ------------------------------------------------------------------------------------------ errors
def test_an_update_too_large_for_float32_norms_is_clipped_to_the_bound_not_zeroed():
    # ||(1e30, 1e30)|| = 1.41e30 is finite, but its float32 square overflows: the norm is taken in float64, so the
    # update is scaled to the bound (1/sqrt(2) each). Slip caught: a float32 norm (inf) that scales it to zero.
    server = _server(max_update_norm=1.0, update_norm_action="clip", lost=(1, 2, 3))
    server.begin_round(0)
    assert server.submit(0, torch.tensor([1e30, 1e30, 0.0]), 0.0)
    torch.testing.assert_close(server.close_round()[:2], torch.full((2,), 0.5**0.5))


def test_misuse_of_the_round_protocol_is_refused_with_what_to_do():
    # Slips caught: the messages emptied or changed (they tell the engine author what to call).
    server = _server()
    with pytest.raises(RuntimeError, match=r"^no round is open: call begin_round\(\) first$"):
        server.start_client(0)
    server.begin_round(0)
    with pytest.raises(RuntimeError, match=r"^round 0 is still open$"):
        server.begin_round(1)
    with pytest.raises(RuntimeError, match=r"in the middle of round 0: .*ModelCheckpoint\(every_n_epochs=1\), not "
                                           r"every_n_train_steps or train_time_interval\)$"):
        server.state_dict()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"optimizer_state": "keep"}, ValueError,
         r"^optimizer_state must be one of \('reset', 'persist'\), got 'keep'$"),
        ({"client_weights": "sample"}, ValueError,
         r"^client_weights must be one of \('uniform', 'samples'\), got 'sample'$"),
        ({"update_norm_action": "drop"}, ValueError,
         r"^update_norm_action must be one of \('reject', 'clip'\), got 'drop'$"),
        ({"max_update_norm": "1"}, TypeError, r"^max_update_norm must be a number > 0 or None, got '1'$"),
        ({"max_update_norm": True}, TypeError, r"^max_update_norm must be a number > 0 or None, got True$"),
        ({"max_update_norm": 0.0}, ValueError, r"^max_update_norm must be a finite number > 0, got 0.0$"),
        ({"max_update_norm": -1}, ValueError, r"^max_update_norm must be a finite number > 0, got -1$"),
        ({"max_update_norm": float("inf")}, ValueError, r"^max_update_norm must be a finite number > 0, got inf$"),
    ],
)
def test_bad_options_are_refused_at_construction_naming_the_parameter(options, error, message):
    with pytest.raises(error, match=message):
        _server(**options)
