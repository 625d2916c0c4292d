"""CA-Fed, F3AST, their shared availability plumbing and the Markov availability estimator by hand: ComputeWeights'
order, ties and strictness threshold, the two exclusion passes, the oracle ``f_star``, the loss filter's float64
arithmetic, the estimator's priors and counters, checkpoints taken mid-round, ``hparams()`` and the full texts of
the errors.

Written against the survivors of the ``cafed`` mutation chunk (docs/testing.md): each test names the slip it
catches. Expected numbers come from the formulas of the module docstrings, worked out in the comments.

With ``q = alpha / pi`` for every kept client, ``pi_i q_i = alpha_i``, so over a kept set ``S`` the proxy of eq. 2.25
has the closed form used below::

    eps(S) = sum_{i in S} alpha_i gap_i / alpha(S) + c * (1 - alpha(S))^2,    c = bias_factor * kappa_bar_sq * Gamma

(``p_i = alpha_i / alpha(S)`` on ``S``, so ``d_TV(alpha, p) = 1 - alpha(S)``).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import (
    F3AST,
    CAFed,
    ClientInfo,
    MarkovAvailabilityEstimator,
    compute_weights,
    proxy_error,
)
from lightning_fedhet.algorithms._availability import AvailabilityRule
from tests.algorithms.selection_rounds import F64, ctx_for, mask, vec

NAN = float("nan")
INFO = ClientInfo(num_samples=1, local_steps=1)
LENGTH = "; give a scalar or exactly one value per client"
# 24 clients: a group H of 12 (ids below) and a group L of 12. On this machine numpy's default (unstable) argsort
# orders the tied keys of this pattern 12, 10, 9, 13, 8, ... instead of the stable 8, 9, 10, 12, 13, ...
TIED_H = [8, 9, 10, 12, 13, 16, 17, 18, 20, 21, 22, 23]


def round_trip(state: dict) -> dict:
    """A ``torch.save`` / ``torch.load(weights_only=True)`` round trip, as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------- compute_weights
def test_compute_weights_tests_the_largest_key_first():
    # Slips: the order reversed (argsort(+key)); a q exactly 1.0 taken for an excluded client (q == 1.0 skip).
    # strict=False and gap = 0: eps = 0 for every non-empty set, so every removal is accepted (drop 0 >= tau 0)
    # except the last client's (eps = inf). The client tested LAST survives: keys [0.9, 0.1] -> order 0, 1 ->
    # client 0 dropped, client 1 kept: q = [0, 1].
    out = compute_weights([1.0, 1.0], [0.5, 0.5], [0.0, 0.0], 0.0, [1.0, 1.0], [0.9, 0.1], 1.0, strict=False)
    assert out.tolist() == [0.0, 1.0]


def test_compute_weights_skips_excluded_clients_and_goes_on():
    # Slip: `continue` -> `break` at a client already at q = 0 (the rest would never be tested).
    # strict=False, gap = 0 (every removal but the last accepted). Keys [0.9, 0.5, 0.1]: client 0 (q = 0) skipped,
    # client 1 dropped, client 2 is the last one and stays: [0, 0, 1].
    out = compute_weights([0.0, 1.0, 1.0], [0.0, 0.5, 0.5], [0.0] * 3, 0.0, [1.0] * 3, [0.9, 0.5, 0.1], 1.0,
                          strict=False)
    assert out.tolist() == [0.0, 0.0, 1.0]


def test_compute_weights_breaks_ties_by_the_lower_id():
    # Slip: argsort without kind="stable" (documented: ties, lower id first). 24 clients, alpha = 1/24, pi = 1,
    # q = alpha; gap = 1 on group H (key 1), 0 on group L (key 0); Gamma = 1, kappa^2 = 2.1, bias_factor 4: c = 8.4.
    # eps(all) = 12/24 = 0.5. Without one H: 11/23 + 8.4/24^2 = 0.47826 + 0.01458 = 0.49284 < 0.5: accepted.
    # Without a second H: 10/22 + 8.4 * (2/24)^2 = 0.45455 + 0.05833 = 0.51288 > 0.49284: rejected; without an L
    # instead: 11/22 + 0.05833 = 0.55833: rejected. So exactly the first H in the order goes: the lowest id, 8.
    key = np.zeros(24)
    key[TIED_H] = 1.0
    gap = key.copy()
    alpha = np.full(24, 1 / 24)
    out = compute_weights(alpha, alpha, gap, 1.0, np.ones(24), key, kappa_bar_sq=2.1)
    assert torch.nonzero(out == 0).flatten().tolist() == [8]
    assert proxy_error(out, alpha, gap, 1.0, np.ones(24), 2.1) == pytest.approx(11 / 23 + 8.4 / 576)


def test_compute_weights_uses_the_given_bias_factor_on_both_sides_of_the_comparison():
    # Slips: bias_factor dropped (default 4) from the proxy of the current q, or from the trial's.
    # Two clients, alpha = [1/2, 1/2], pi = [1, 1], q = [1, 3] -> p = [1/4, 3/4], TV = (1/4 + 1/4)/2 = 1/4;
    # gap = [0, 1], Gamma = 1, kappa^2 = 1, bias_factor 1: eps = 3/4 + 1 * 1/16 = 0.8125.
    # Key [0, 1]: client 1 first; without it p = [1, 0], TV = 1/2: eps = 0 + 1/4 = 0.25, a drop of 0.5625.
    # (With factor 4 the trial would be 1.0 > 0.8125, rejected; and the current eps 0.75 + 0.25 = 1.0, a drop 0.75.)
    args = ([1.0, 3.0], [0.5, 0.5], [0.0, 1.0], 1.0, [1.0, 1.0], [0.0, 1.0], 1.0)
    assert compute_weights(*args, bias_factor=1.0).tolist() == [1.0, 0.0]
    # tau = 0.6 > 0.5625: rejected (a drop of 0.75 would pass it)
    assert compute_weights(*args, tau=0.6, bias_factor=1.0).tolist() == [1.0, 3.0]


def test_compute_weights_strictness_threshold_is_1e_12_relative_and_exclusive():
    # Slips: `drop > 1e-12 * max(1, |eps|)` with `>=`, with `/ max(...)`, or with `max(2.0, ...)`.
    # Two clients, alpha = [1/2, 1/2], pi = [1, 1], q = [1, 1] (p = alpha), Gamma = 0 (no bias term); key [0, 1]
    # tests client 1 first; without it eps = gap_0, so the drop is (gap_1 - gap_0) / 2.
    def weights(gap):
        return compute_weights([1.0, 1.0], [0.5, 0.5], gap, 0.0, [1.0, 1.0], [0.0, 1.0], 1.0).tolist()

    # gap = [0, 2e-12]: eps = 1e-12 exactly (halving is exact), drop = 1e-12 = the threshold 1e-12 * max(1, 1e-12):
    # not MORE than it -> kept.
    assert weights([0.0, 2e-12]) == [1.0, 1.0]
    # gap = [1, 1 + 3e-12]: eps ~ 1 + 1.5e-12, drop ~ 1.5e-12 > 1e-12 * eps ~ 1.0e-12 -> dropped
    assert weights([1.0, 1.0 + 3e-12]) == [1.0, 0.0]
    # gap = [1e6, 1e6 + 1e-6]: drop ~ 5e-7 < 1e-12 * 1e6 = 1e-6 (relative to eps) -> kept
    assert weights([1e6, 1e6 + 1e-6]) == [1.0, 1.0]


def test_proxy_error_is_infinite_when_everybody_is_excluded():
    # Slip: `not total > 0` -> `not total >= 0` (0/0 = nan instead of the documented inf).
    assert proxy_error([0.0, 0.0], [0.5, 0.5], [1.0, 1.0], 1.0, [0.5, 0.5], 1.0) == float("inf")


def test_compute_weights_returns_float64_for_float32_and_integer_inputs():
    # Slips: `_float64_array` without its float64 conversion (a float32 tensor or an int list kept as is, so the
    # returned weights were float32 / int64; documented "float64 [N]").
    # gap = 0 everywhere: nobody dropped, the weights come back unchanged.
    q32 = torch.tensor([1.0, 2.0], dtype=torch.float32)
    out = compute_weights(q32, q32, torch.zeros(2), 0.0, torch.ones(2), torch.zeros(2), 1.0)
    assert out.dtype == F64 and out.tolist() == [1.0, 2.0]
    out = compute_weights([1, 2], [1, 1], [0, 0], 0, [1, 1], [0, 0], 1)
    assert out.dtype == F64 and out.tolist() == [1.0, 2.0]


def test_compute_weights_refuses_a_negative_tau_naming_it():
    # Slip: the parameter's name in the message.
    with pytest.raises(ValueError, match=r"^tau must lie in \[0, inf\], got -1\.0$"):
        compute_weights([1.0], [1.0], [0.0], 0.0, [1.0], [0.0], 1.0, tau=-1.0)


# ---------------------------------------------------------------------------------------------- CA-Fed rounds
def test_cafed_first_pass_orders_by_correlation_and_the_second_by_availability():
    # Slips in the first pass (|lam| order): alpha or pi replaced by None (no removal accepted), the key by None
    # (only client 0 tested); strict not forwarded (default True). strict=False with no loss seen yet: gap = 0 and
    # Gamma = 0, eps = 0 on every non-empty set, so each pass removes every client it tests but its last one.
    # Pass 1, |lam| = [0.9, 0.5, 0.1] descending: 0, 1 dropped, 2 kept. Pass 2 has one client left.
    # (Without pass 1, pass 2 by ascending pi = [0.5, 0.9, 0.3] (2, 0, 1) would keep client 1.)
    algo = CAFed(strict=False, pi=[0.5, 0.9, 0.3], lam=[0.9, -0.5, 0.1])
    algo.setup(3, torch.zeros(1, dtype=F64))
    assert algo.select(0, ones(3), None).tolist() == [False, False, True]
    assert torch.allclose(algo.last_q, vec(0.0, 0.0, (1 / 3) / 0.3))
    assert algo.last_error == 0.0 and algo.last_gamma == 0.0


def test_cafed_second_pass_drops_least_available_first_after_the_first():
    # Slips in the second pass (-pi order) and in the rule's arguments: alpha / pi / key replaced by None, +pi
    # instead of -pi, bias_factor not forwarded, last_error computed with the default bias_factor; f_star ignored.
    # N = 4, alpha = 1/4, pi = [0.6, 0.8, 0.2, 0.4], lam = [0.6, -0.8, 0.4, 0.2]; probe losses [1, 3, 2, 5] and
    # f_star = 1: gap = [0, 2, 1, 4], Gamma = 4; c = bias_factor * kappa^2 * Gamma = 2 * 0.1875 * 4 = 1.5.
    # eps(S) = mean_S gap + 1.5 (1 - |S|/4)^2.  eps(all) = 7/4 = 1.75.
    # Pass 1, |lam| descending = 1, 0, 2, 3:
    #   -1: mean(0,1,4) = 5/3 + 1.5/16 = 1.760 > 1.75 no; -0: 7/3 + 0.094 no; -2: 2 + 0.094 no;
    #   -3: mean(0,2,1) = 1 + 0.09375 = 1.09375 yes -> S = {0, 1, 2}.
    # Pass 2, pi ascending = 2, 3, 0, 1:
    #   -2: mean(0,2) = 1 + 1.5/4 = 1.375 no; 3 skipped; -0: mean(2,1) = 1.5 + 0.375 no;
    #   -1: mean(0,1) = 0.5 + 0.375 = 0.875 yes -> S = {0, 2}, eps = 0.875.
    # (Pi descending instead (1, 0, 3, 2) would then also drop 2: mean(0) + 1.5 * 9/16 = 0.84375 < 0.875.)
    algo = CAFed(kappa_bar_sq=0.1875, bias_factor=2.0, pi=[0.6, 0.8, 0.2, 0.4], lam=[0.6, -0.8, 0.4, 0.2],
                 f_star=[1.0, 1.0, 1.0, 1.0], loss_source="probe")
    algo.setup(4, torch.zeros(1, dtype=F64))
    algo.observe_losses(0, vec(1.0, 3.0, 2.0, 5.0))
    gap, gamma = algo.loss_gaps()
    assert torch.equal(gap, vec(0.0, 2.0, 1.0, 4.0)) and gamma == 4.0
    assert algo.select(0, ones(4), None).tolist() == [True, False, True, False]
    assert torch.allclose(algo.last_q, vec(0.25 / 0.6, 0.0, 0.25 / 0.2, 0.0))
    assert algo.last_error == pytest.approx(0.875)
    assert algo.last_gamma == 4.0


def test_cafed_uses_the_client_weights_and_keeps_the_client_sizes():
    # Slips: setup forwarding client_weights or client_sizes as None (or in each other's place).
    # alpha = [1, 3]/4, pi = [0.5, 0.5], no loss yet (nobody dropped): q = alpha/pi = [0.5, 1.5].
    algo = CAFed(pi=[0.5, 0.5])
    algo.setup(2, torch.zeros(1, dtype=F64), client_weights=[1.0, 3.0], client_sizes=[10, 30])
    algo.select(0, ones(2), None)
    assert torch.allclose(algo.last_q, vec(0.5, 1.5))
    assert algo.client_sizes.tolist() == [10, 30] and algo.client_sizes.dtype == torch.int64


def test_cafed_forwards_the_transition_prior_to_its_estimator():
    # Slip: transition_prior not passed on (default 1). Availability 1, 1, 0, 1 with a = 2: transitions 1->1,
    # 1->0, 0->1: P11 = (1 + 2)/(2 + 4) = 0.5, P00 = (0 + 2)/(1 + 4) = 0.4 -> lam = -0.1 (a = 1 gives -1/6);
    # pi_hat = (3 + 1)/(4 + 2) = 2/3.
    algo = CAFed(transition_prior=2.0)
    algo.setup(1, torch.zeros(1, dtype=F64))
    for t, on in enumerate([True, True, False, True]):
        algo.select(t, torch.tensor([on]), None)
    assert torch.allclose(algo.lam_hat, vec(-0.1))
    assert torch.allclose(algo.pi_hat, vec(2 / 3))


def test_cafed_loss_filter_is_float64_and_keeps_clients_not_seen_this_round():
    # Slips: the losses not converted to float64 (beta * float32 loss rounded to float32); `again = seen & ~first`
    # replaced by None or by `seen | ~first` (an unseen client's F_hat overwritten with nan).
    # beta = 0.1. Round 0: [2, 5] -> F_hat = [2, 5]. Round 1 (float32 input): [1, nan] -> F_hat_0 = 0.9 * 2 + 0.1 * 1
    # in float64 = 1.9, F_hat_1 stays 5 (not probed).
    algo = CAFed(beta=0.1, loss_source="probe")
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.observe_losses(0, vec(2.0, 5.0))
    algo.observe_losses(1, torch.tensor([1.0, NAN], dtype=torch.float32))
    assert algo.loss_hat.dtype == F64
    assert abs(float(algo.loss_hat[0]) - ((1.0 - 0.1) * 2.0 + 0.1 * 1.0)) < 1e-15
    assert float(algo.loss_hat[1]) == 5.0
    assert torch.allclose(algo.loss_min, vec(1.9, 5.0))  # running minimum: min(2, 1.9), 5


def test_cafed_gaps_before_any_loss_are_float64_zeros_and_gamma_zero():
    # Slips: Gamma 0.0 -> 1.0 before any loss; the zero gaps in float32 (the other branch gives float64).
    algo = CAFed()
    algo.setup(3, torch.zeros(1, dtype=F64))
    gap, gamma = algo.loss_gaps()
    assert gap.dtype == F64 and gap.tolist() == [0.0, 0.0, 0.0]
    assert gamma == 0.0


# ---------------------------------------------------------------------------------------------- F3AST rounds
def test_f3ast_breaks_ties_by_the_lower_id():
    # Slip: argsort without kind="stable" (documented: ties, lower id first). 24 clients, rate="exact" with
    # pi = 1, alpha = 2/36 on group H, 1/36 on group L: the scores alpha^2/r^2 tie within each group; k = 3 takes
    # the three lowest ids of H: 8, 9, 10.
    weights = torch.ones(24, dtype=F64)
    weights[TIED_H] = 2.0
    algo = F3AST(k=3, rate="exact", pi=[1.0] * 24)
    algo.setup(24, torch.zeros(1, dtype=F64), weights)
    chosen = algo.select(0, ones(24), None)
    assert torch.nonzero(chosen).flatten().tolist() == [8, 9, 10]


def test_f3ast_selection_is_a_bool_mask():
    # Slip: the chosen mask built without dtype=torch.bool (a float 0/1 tensor; select returns a bool tensor [N]).
    algo = F3AST(k=1, beta=0.5)
    algo.setup(2, torch.zeros(1, dtype=F64))
    chosen = algo.select(0, ones(2), None)
    assert chosen.dtype == torch.bool and chosen.tolist() == [True, False]
    assert algo.last_selected.dtype == torch.bool


def test_f3ast_rates_are_float64_arithmetic():
    # Slips: the availability indicator or the EMA / normaliser state not in float64 (b * 1[available] or b itself
    # rounded to float32), and the rates before any round in float32.
    b = 0.1
    ema = F3AST(k=1, beta=b)
    ema.setup(2, torch.zeros(1, dtype=F64))
    assert ema.rates.dtype == F64 and ema.rates.tolist() == [0.0, 0.0]
    ema.select(0, mask(2, [0]), None)
    # bias-corrected: v = b * 1, u = b -> r_0 = b / b = 1 exactly; client 1 never available: 0
    assert ema.rates.tolist() == [1.0, 0.0]
    code = F3AST(k=1, beta=b, rate="code", pi=[0.5, 0.25])
    code.setup(2, torch.zeros(1, dtype=F64))
    code.select(0, mask(2, [0]), None)
    # r = (1 - b) pi + b 1[available] in float64
    assert code.rates.tolist() == [(1.0 - b) * 0.5 + b * 1.0, (1.0 - b) * 0.25 + b * 0.0]


def test_f3ast_a_client_never_seen_available_weighs_zero_not_infinity():
    # Slips: the guard `r > 0` of the weights alpha/r dropped or made `>= 0` (alpha/0 = inf).
    # beta = 0.5, client 0 available in round 0: r = [1, 0] (bias-corrected). The strategy hands in an update of
    # client 1 too (selected by other means): its weight is 0, so w = 0 + (1/2)/1 * 2 = 1.
    algo = F3AST(k=2, beta=0.5)
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.open_round(0, ctx_for(0, 2, [0], [0, 1], [0, 1]))
    algo.add(0, vec(2.0), INFO)
    algo.add(1, vec(4.0), INFO)
    assert algo.close_round().tolist() == [1.0]
    assert algo.last_weights == {0: 0.5, 1: 0.0}


def test_f3ast_per_client_init_rate_and_client_sizes():
    # Slips: the init_rate length check given None for num_clients (every per-client init_rate refused) or with
    # its arguments shuffled; client_sizes not forwarded to the base setup.
    algo = F3AST(k=1, beta=0.5, init_rate=[0.5, 0.25])
    algo.setup(2, torch.zeros(1, dtype=F64), client_sizes=[4, 6])
    assert algo.rates.tolist() == [0.5, 0.25]
    assert algo.client_sizes.tolist() == [4, 6]
    with pytest.raises(ValueError, match=rf"^init_rate has 3 entries but num_clients is 2{LENGTH}$"):
        F3AST(k=1, init_rate=[0.5, 0.5, 0.5]).setup(2, torch.zeros(1, dtype=F64))


# ---------------------------------------------------------------------------------------------- checkpoints
def test_cafed_checkpoint_between_select_and_open_round_resumes_the_round():
    # Slips: observed_round, last_available or last_q dropped from the checkpoint or from its loading (the resumed
    # rule would refuse open_round without availability, or weigh with None).
    # pi = [0.5, 0.25], alpha = 1/2, no loss: q = [1, 2]; client 0 alone available.
    algo = CAFed(pi=[0.5, 0.25])
    algo.setup(2, torch.zeros(1, dtype=F64))
    assert algo.select(0, mask(2, [0]), None).tolist() == [True, False]
    resumed = CAFed(pi=[0.5, 0.25])
    resumed.load_state_dict(round_trip(algo.state_dict()))
    assert resumed.last_available.tolist() == [True, False]
    assert resumed.last_q.tolist() == [1.0, 2.0]
    resumed.open_round(0, None)  # round 0's availability was observed before the checkpoint
    resumed.add(0, vec(3.0), INFO)
    assert resumed.close_round().tolist() == [3.0]  # w = 0 + q_0 * 3


def test_cafed_checkpoint_keeps_the_round_of_the_last_probe():
    # Slip: losses_round not restored (the resumed rule would ask for round 0's probe again, and accept it twice).
    algo = CAFed(loss_source="probe", pi=[0.5, 0.5])
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.observe_losses(0, vec(1.0, 1.0))
    resumed = CAFed(loss_source="probe", pi=[0.5, 0.5])
    resumed.load_state_dict(round_trip(algo.state_dict()))
    assert resumed.select(0, ones(2), None).tolist() == [True, True]
    with pytest.raises(ValueError, match=r"^observe_losses\(round=0\) after round 0: losses are fed once per round, "
                                         r"in increasing round order$"):
        resumed.observe_losses(0, vec(1.0, 1.0))


def test_f3ast_checkpoint_between_select_and_open_round_resumes_the_round():
    # Slips: last_selected or observed_round dropped from the checkpoint or its loading (the re-asked selection
    # would fail, or the EMA would absorb round 0 twice).
    # beta = 0.5, init_rate 0.5, both available: r = 0.25 + 0.5 = 0.75 each; equal scores -> client 0 (lower id).
    algo = F3AST(k=1, beta=0.5, init_rate=0.5)
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.select(0, ones(2), None)
    resumed = F3AST(k=1, beta=0.5, init_rate=0.5)
    resumed.load_state_dict(round_trip(algo.state_dict()))
    assert resumed.last_selected.tolist() == [True, False]
    assert resumed.select(0, ones(2), None).tolist() == [True, False]
    assert resumed.rates.tolist() == [0.75, 0.75]  # not 0.875: round 0 observed once
    resumed.open_round(0, None)
    resumed.add(0, vec(3.0), INFO)
    assert resumed.close_round().tolist() == [pytest.approx(2.0)]  # q_0 = (1/2)/0.75 = 2/3


def test_checkpoints_right_after_setup_hold_nothing_observed_yet():
    # Slips: _clone(None) cloning anyway (crash), or returning None for a tensor; setup resetting observed_round /
    # last_available to "" instead of None; F3AST's last_selected starting as "".
    cafed = CAFed()
    cafed.setup(2, torch.zeros(1, dtype=F64))
    state = round_trip(cafed.state_dict())
    assert state["observed_round"] is None and state["last_available"] is None
    assert state["rule"]["last_q"] is None and state["rule"]["losses_round"] is None
    assert state["rule"]["estimator"]["prev"] is None
    assert state["rule"]["loss_hat"].dtype == F64 and state["rule"]["loss_hat"].isnan().all()
    f3ast = F3AST(k=1)
    f3ast.setup(2, torch.zeros(1, dtype=F64))
    state = round_trip(f3ast.state_dict())
    assert state["rule"]["last_selected"] is None and state["rule"]["ema"].tolist() == [0.0, 0.0]
    assert f3ast.last_selected is None and f3ast.last_available is None


def test_a_rule_never_set_up_has_empty_attributes_and_checkpoint():
    # Slips: documented attributes starting as "" instead of None (last_available, last_q, last_error, last_gamma,
    # loss_hat, loss_min, the probe round; F3AST's EMA state).
    cafed = CAFed()
    for name in ("last_available", "last_q", "last_error", "last_gamma", "loss_hat", "loss_min"):
        assert getattr(cafed, name) is None, name
    state = cafed.state_dict()
    assert state["observed_round"] is None and state["last_available"] is None
    assert state["rule"]["losses_round"] is None and state["rule"]["last_q"] is None
    assert F3AST(k=1).state_dict()["rule"] == {"ema": None, "norm": None, "last_selected": None}


def test_the_base_rule_default_server_lr_is_one():
    # Slip: the default server_lr of AvailabilityRule changed (every subclass passes its own, 1 by default).
    assert AvailabilityRule().server_lr == 1.0


# ---------------------------------------------------------------------------------------------- the estimator
def test_estimator_defaults_are_the_docstring_example():
    # Slip: transition_prior default 1 changed. Sequence 1, 1, 0, 1: pi_hat = (3 + 1)/(4 + 2) = 2/3;
    # P11 = (1 + 1)/(2 + 2) = 0.5, P00 = (0 + 1)/(1 + 2) = 1/3 -> lam = -1/6.
    est = MarkovAvailabilityEstimator()
    est.setup(1)
    for s in [1, 1, 0, 1]:
        est.update(torch.tensor([bool(s)]))
    assert torch.allclose(est.pi_hat(), vec(2 / 3))
    assert torch.allclose(est.lam_hat(), vec(-1 / 6))


def test_estimator_transition_prior_counts_twice_in_the_denominator():
    # Slip: `2 * a` -> `2 / a` (equal at a = 1). a = 2, sequence 1, 1, 0, 1: N11 = 1, N10 = 1, N01 = 1, N00 = 0:
    # P00 = (0 + 2)/(0 + 1 + 4) = 0.4, P11 = (1 + 2)/(1 + 1 + 4) = 0.5.
    est = MarkovAvailabilityEstimator(transition_prior=2.0)
    est.setup(1)
    for s in [1, 1, 0, 1]:
        est.update(torch.tensor([bool(s)]))
    p00, p11 = est.transition_probs()
    assert torch.allclose(p00, vec(0.4)) and torch.allclose(p11, vec(0.5))


def test_estimator_counters_have_the_documented_dtypes_and_shapes():
    # Slips: active / trans without dtype=int64, trans of shape [N, 3, 2] or [N, 2, 3]; the initial counters.
    est = MarkovAvailabilityEstimator()
    assert est.state_dict() == {"num_clients": 0, "rounds": 0, "active": None, "trans": None, "prev": None}
    est.setup(3)
    assert est.active.dtype == torch.int64 and est.active.tolist() == [0, 0, 0]
    assert est.trans.dtype == torch.int64 and tuple(est.trans.shape) == (3, 2, 2)
    assert est.prev is None and est.rounds == 0 and est.num_clients == 3


def test_estimator_checkpoint_keeps_the_last_state_for_the_next_transition():
    # Slip: prev dropped from the checkpoint or its loading (the first transition after a resume lost; and the
    # clone of None). Rounds [1, 0] then, after the resume, [1, 1]: client 0 made 1->1, client 1 made 0->1.
    est = MarkovAvailabilityEstimator()
    est.setup(2)
    assert round_trip(est.state_dict())["prev"] is None
    est.update(torch.tensor([True, False]))
    resumed = MarkovAvailabilityEstimator()
    resumed.load_state_dict(round_trip(est.state_dict()))
    resumed.update(torch.tensor([True, True]))
    assert resumed.trans.tolist() == [[[0, 0], [0, 1]], [[0, 1], [0, 0]]]
    assert resumed.rounds == 2 and resumed.active.tolist() == [2, 1]


def test_estimator_per_client_priors_are_checked_against_num_clients():
    # Slips: the per-client prior's length check with arguments dropped / None / shuffled, or the prior's name
    # ("n" / "m") in the message. pi_prior = ([1, 3], [1, 1]) with no observation: pi_hat = n / (n + m) = [1/2, 3/4].
    est = MarkovAvailabilityEstimator(pi_prior=([1.0, 3.0], [1.0, 1.0]))
    est.setup(2)
    assert torch.allclose(est.pi_hat(), vec(0.5, 0.75))
    with pytest.raises(ValueError, match=rf"^pi_prior n has 3 entries but num_clients is 2{LENGTH}$"):
        MarkovAvailabilityEstimator(pi_prior=([1.0, 1.0, 1.0], 1.0)).setup(2)
    with pytest.raises(ValueError, match=rf"^pi_prior m has 3 entries but num_clients is 2{LENGTH}$"):
        MarkovAvailabilityEstimator(pi_prior=(1.0, [1.0, 1.0, 1.0])).setup(2)


def test_estimator_refuses_updates_before_setup_and_of_the_wrong_length():
    # Slips: the RuntimeError's text; the mask's name; active starting as "" (not None) skips the setup check.
    with pytest.raises(RuntimeError, match=r"^MarkovAvailabilityEstimator\.setup\(num_clients\) must be called "
                                           r"first$"):
        MarkovAvailabilityEstimator().update(torch.tensor([True]))
    est = MarkovAvailabilityEstimator()
    est.setup(2)
    with pytest.raises(ValueError, match=rf"^active has 3 entries but num_clients is 2{LENGTH}$"):
        est.update(torch.tensor([True, True, True]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pi_prior=0.5), r"^pi_prior must be a pair \(n, m\) of positive pseudo-counts, got 0\.5$"),
        (dict(pi_prior=(0.0, 1.0)), r"^pi_prior must lie in \(0, inf\], got 0\.0$"),
        (dict(pi_prior=(1.0, 0.0)), r"^pi_prior must lie in \(0, inf\], got 0\.0$"),
        (dict(transition_prior=0.0), r"^transition_prior must lie in \(0, inf\], got 0\.0$"),
    ],
)
def test_estimator_bad_priors_are_refused_with_the_parameter_and_its_range(kwargs, message):
    # Slips: the names in the messages, the message replaced by None, m's lower bound made closed or dropped.
    with pytest.raises(ValueError, match=message):
        MarkovAvailabilityEstimator(**kwargs)


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kappa_bar_sq=-1.0), r"^kappa_bar_sq must lie in \[0, inf\], got -1\.0$"),
        (dict(tau=-0.1), r"^tau must lie in \[0, inf\], got -0\.1$"),
        (dict(beta=0.0), r"^beta must lie in \(0, 1\], got 0\.0$"),
        (dict(beta=1.5), r"^beta must lie in \(0, 1\], got 1\.5$"),
        (dict(bias_factor=-1.0), r"^bias_factor must lie in \[0, inf\], got -1\.0$"),
        (dict(strict=1), r"^strict must be True or False, got 1$"),
        (dict(loss_source="val"), r"^loss_source must be one of \('train', 'probe'\), got 'val'$"),
        (dict(pi=[0.5, 0.0]), r"^pi must lie in \(0, 1\], got 0\.0$"),
        (dict(pi=[0.5, 1.5]), r"^pi must lie in \(0, 1\], got 1\.5$"),
        (dict(lam=[0.5, 1.5]), r"^lam must lie in \[-1, 1\], got 1\.5$"),
        (dict(lam=[0.5, -1.5]), r"^lam must lie in \[-1, 1\], got -1\.5$"),
        (dict(f_star=[0.0, NAN]), r"^f_star must be finite, got \[0\.0, nan\]$"),
        (dict(server_lr=0.0), r"^server_lr must lie in \(0, inf\], got 0\.0$"),
    ],
)
def test_cafed_bad_arguments_are_refused_with_the_parameter_and_its_range(kwargs, message):
    # Slips: each parameter's name in its message, and the bounds (beta's and pi's upper 1, lam's lower -1).
    with pytest.raises(ValueError, match=message):
        CAFed(**kwargs)


def test_cafed_accepts_the_closed_bounds_and_any_finite_f_star():
    # Slips: bias_factor's lower bound 0 moved to 1; f_star's bounds (-inf, inf) broken or its checks' arguments
    # shuffled (a finite f_star refused).
    algo = CAFed(bias_factor=0.0, f_star=[-5.0, 7.0], lam=[-1.0, 1.0], pi=[1.0, 1.0], beta=1.0)
    assert algo.bias_factor == 0.0
    assert algo.hparams()["f_star"] == [-5.0, 7.0]


@pytest.mark.parametrize("name", ["pi", "lam", "f_star"])
def test_cafed_oracle_lengths_are_checked_at_setup_naming_the_oracle(name):
    # Slip: the oracle's name in the length message.
    algo = CAFed(**{name: [0.5, 0.5, 0.5]})
    with pytest.raises(ValueError, match=rf"^{name} has 3 entries but num_clients is 2{LENGTH}$"):
        algo.setup(2, torch.zeros(1, dtype=F64))


def test_cafed_round_errors_are_spelt_out():
    # Slips: the texts of the probe error and of the availability error (class name, hint); the name of the mask
    # in both checks of select (the second one when the round's availability was already observed).
    probe = CAFed(loss_source="probe")
    probe.setup(2, torch.zeros(1, dtype=F64))
    with pytest.raises(RuntimeError, match=r"^CAFed\(loss_source='probe'\) needs observe_losses\(0, losses\) before "
                                           r"select\(0\): the one-batch losses of the available clients at the current "
                                           r"global model \(thesis Alg\. 3 line 3\); the last probe was for round "
                                           r"None\. Use loss_source='train' when nothing probes\.$"):
        probe.select(0, ones(2), None)
    for algo in (CAFed(), F3AST(k=1)):
        algo.setup(2, torch.zeros(1, dtype=F64))
        name = type(algo).__name__
        with pytest.raises(ValueError, match=rf"^{name} must observe every client's availability: call "
                                             r"select\(0, \.\.\.\) or pass a RoundContext with `available`$"):
            algo.open_round(0, None)
        with pytest.raises(ValueError, match=rf"^available has 3 entries but num_clients is 2{LENGTH}$"):
            algo.select(0, ones(3), None)
        algo.select(0, ones(2), None)
        with pytest.raises(ValueError, match=rf"^available has 3 entries but num_clients is 2{LENGTH}$"):
            algo.select(0, ones(3), None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), r"^k \(clients per round\) must be an integer >= 1, got 0$"),
        (dict(k=1, beta=0.0), r"^beta must lie in \(0, 1\], got 0\.0$"),
        (dict(k=1, rate="oracle"), r"^rate must be one of \('ema', 'code', 'exact'\), got 'oracle'$"),
        (dict(k=1, pi=[0.5]), r"^pi is only used by rate='code' or rate='exact'; rate='ema' estimates it$"),
        (dict(k=1, rate="code", pi=[0.5], init_rate=0.5), r"^init_rate is only used by rate='ema'$"),
        (dict(k=1, init_rate=[0.5, 0.0]), r"^init_rate must lie in \(0, 1\], got 0\.0$"),
        (dict(k=1, init_rate=[0.5, 1.5]), r"^init_rate must lie in \(0, 1\], got 1\.5$"),
    ],
)
def test_f3ast_bad_arguments_are_refused_with_the_parameter_and_its_range(kwargs, message):
    # Slips: the names in the messages, beta's open lower bound, init_rate's upper bound 1.
    with pytest.raises(ValueError, match=message):
        F3AST(**kwargs)


# ---------------------------------------------------------------------------------------------- hparams
def test_cafed_hparams_report_every_option_and_the_oracles():
    # Slips: any key of hparams() misspelt, the dict replaced by None, an oracle reported as None; the default
    # kappa_bar_sq (1, the thesis).
    assert CAFed().hparams() == {
        "kappa_bar_sq": 1.0, "tau": 0.0, "beta": 1.0, "bias_factor": 4.0, "strict": True, "loss_source": "train",
        "server_lr": 1.0,
    }
    algo = CAFed(pi=[0.5, 1.0], lam=[0.0, -0.5], f_star=[0.25, 2.0])
    assert algo.hparams() == {
        "kappa_bar_sq": 1.0, "tau": 0.0, "beta": 1.0, "bias_factor": 4.0, "strict": True, "loss_source": "train",
        "server_lr": 1.0, "pi": [0.5, 1.0], "lam": [0.0, -0.5], "f_star": [0.25, 2.0],
    }


def test_f3ast_hparams_report_the_rate_its_oracle_and_the_initial_rate():
    # Slips: any key misspelt, rate or pi reported as None or left out, init_rate reported as None.
    assert F3AST(k=2).hparams() == {"k": 2, "beta": 0.005, "server_lr": 1.0}
    assert F3AST(k=2, beta=0.5, rate="code", pi=[0.5, 0.25]).hparams() == {
        "k": 2, "beta": 0.5, "server_lr": 1.0, "rate": "code", "pi": [0.5, 0.25],
    }
    assert F3AST(k=2, init_rate=[0.5, 0.25]).hparams() == {
        "k": 2, "beta": 0.005, "server_lr": 1.0, "init_rate": [0.5, 0.25],
    }
