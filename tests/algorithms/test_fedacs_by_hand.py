"""FedACS and the with-replacement samplers (SampledFedAvg, c-a-FedAvg, OS), their system oracle and estimator and
the App. I.2 calibration, by hand: input checks with their full messages, the oracle's fallbacks, rounds where
nothing can be drawn, checkpoints taken at any point of a round, and the baselines' options.

Written against the survivors of the ``fedacs`` mutation chunk (docs/testing.md). Expected numbers come from the
arithmetic in the comments, never from the code under test.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import OS, CAFedAvg, ClientInfo, FedACS, SampledFedAvg, chi_square
from lightning_fedhet.algorithms._sampler import SystemEstimator, WithReplacementSampler
from lightning_fedhet.algorithms.calibration import effective_step, lr_scalings
from lightning_fedhet.algorithms.fedacs import fedacs_probabilities, surrogate_weights
from tests.algorithms.selection_rounds import F64, ctx_for, vec

EVERYONE2 = torch.ones(2, dtype=torch.bool)
EVERYONE3 = torch.ones(3, dtype=torch.bool)
ONE = ClientInfo(1, 1)
LENGTH = "{name} has 3 entries but num_clients is 2; give a scalar or exactly one value per client"
NO_ORACLE = ("FedACS.select(round=3) without observe_system(3): using the last known success probabilities and "
             "local steps (Algorithm 1 line 4 needs this round's values)")


def rng(seed=0):
    return np.random.default_rng(seed)


def ready(algo, n=2, **kwargs):
    algo.setup(n, torch.zeros(1, dtype=F64), **kwargs)
    return algo


def close(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def quietly_select(algo, t, available, seed=0):
    """``select`` without this round's oracle, its one-time warning ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return algo.select(t, available, rng(seed))


def no_warning_select(algo, t, available, seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return algo.select(t, available, rng(seed))


# ============================================================================================== the system oracle
@pytest.mark.parametrize("values, message", [
    (dict(success_probs=[1.5, 1.0]), "success_probs must lie in [0, 1], got 1.5"),
    (dict(local_steps=[1, 2], accumulation_norms=[1.0, 2.0]), "give local_steps or accumulation_norms, not both"),
    (dict(local_steps=[1.5, 2]), "local_steps must be integers >= 1, got 1.5"),
    (dict(local_steps=[1, 2, 3]), LENGTH.format(name="local_steps")),
    (dict(accumulation_norms=[0.0, 1.0]), "accumulation_norms must lie in (0, inf], got 0.0"),
    (dict(accumulation_norms=[1.0, 2.0, 3.0]), LENGTH.format(name="accumulation_norms")),
    (dict(participation_probs=[1.5, 1.0]), "participation_probs must lie in [0, 1], got 1.5"),
    (dict(participation_probs=[0.5, 0.5, 0.5]), LENGTH.format(name="participation_probs")),
])
def test_observe_system_refuses_bad_values_naming_the_argument_and_its_range(values, message):
    # Catches a check's name, bounds (0 let into (0, inf], 1.5 into [0, 1]) or per-client length dropped or changed,
    # and the "not both" guard inverted or its message replaced.
    algo = ready(FedACS(K=2))
    with pytest.raises(ValueError) as err:
        algo.observe_system(0, **values)
    assert str(err.value) == message


def test_the_rules_eq_15_uses_its_own_omega():
    # omega = [0.25, 0.75], s = [1, 0.5], ||a||_1 = [1, 3]: p ∝ [0.25 / 1, 0.75 / 1.5] = [0.25, 0.5] -> [1/3, 2/3].
    # Catches an argument of FedACS.probabilities dropped or replaced.
    algo = ready(FedACS(K=2, omega=[0.25, 0.75]))
    close(algo.probabilities([1.0, 0.5], [1.0, 3.0]), vec(1 / 3, 2 / 3))


def test_accumulation_norms_below_one_enter_eq_15_in_place_of_local_steps():
    # omega = [1/2, 1/2], s = 1, ||a||_1 = [0.5, 2] given directly: p ∝ [1/0.5, 1/2] = [2, 0.5] -> [0.8, 0.2].
    # Catches accumulation_norms refused when given alone, stored under another key, checked with a lower bound
    # of 1, or the norms' floor (1e-12) raised to about 1; and the oracle round counted as not observed (a warning).
    algo = ready(FedACS(K=4))
    algo.observe_system(0, accumulation_norms=[0.5, 2.0])
    no_warning_select(algo, 0, EVERYONE2)
    close(algo.last_probabilities, vec(0.8, 0.2))
    close(algo.last_system["norms"], vec(0.5, 2.0))


def test_observed_availability_is_folded_into_success_under_drop():
    # unavailable="drop": s -> pi * s. s = [1, 1], pi = [1, 0.25], ||a||_1 = [1, 1], omega uniform:
    # p ∝ [1/1, 1/0.25] = [1, 4] -> [0.2, 0.8]; last_system's success is pi * s = [1, 0.25].
    algo = ready(FedACS(K=4, unavailable="drop"))
    algo.observe_system(0, success_probs=1.0, local_steps=1, participation_probs=[1.0, 0.25])
    no_warning_select(algo, 0, EVERYONE2)
    close(algo.last_probabilities, vec(0.2, 0.8))
    close(algo.last_system["success"], vec(1.0, 0.25))


def test_local_steps_of_a_momentum_or_proximal_solver_give_its_accumulation_norm():
    # Heavy ball, rho = 0.5, 2 steps: x moves by g1, then by rho g1 + g2: ||a||_1 = 1 + (1 + rho) = 2.5.
    # Proximal SGD, c = local_lr * mu = 0.2 * 0.5 = 0.1, 2 steps: (1 - (1 - c)^2) / c = (1 - 0.81) / 0.1 = 1.9.
    # Catches the momentum or the proximal factor not passed on (or passed in each other's place).
    close(FedACS(K=1, momentum=0.5).norms_from_steps([2, 1]), vec(2.5, 1.0))
    close(FedACS(K=1, prox_mu=0.5, local_lr=0.2).norms_from_steps([2]), vec(1.9))
    close(CAFedAvg(K=1, prox_mu=0.5, local_lr=0.2).norms_from_steps([2]), vec(1.9))  # c-a-FedAvg keeps local_lr


def test_select_without_this_rounds_oracle_warns_once_with_the_documented_text():
    # Catches the warning's text changed, the class name replaced (NoneType), or the once-only flag not set.
    algo = ready(FedACS(K=2))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        algo.select(3, EVERYONE2, rng())
        algo.select(4, EVERYONE2, rng())
    assert [str(w.message) for w in record] == [NO_ORACLE]
    assert record[0].category is UserWarning


def test_rules_whose_probabilities_need_no_oracle_never_warn():
    # SampledFedAvg samples from omega: it reads no system values, so no round without observe_system warns.
    # Catches the warning's condition with an `and` turned into `or`.
    algo = ready(SampledFedAvg(K=2))
    no_warning_select(algo, 0, EVERYONE2)
    algo.observe_system(1, success_probs=0.5)
    no_warning_select(algo, 2, EVERYONE2)


def test_with_nothing_known_the_system_is_ones_in_float64():
    # s = ||a||_1 = 1 for every client before any value is seen (importance sampling), kept as float64 like all
    # per-client state (lightning_fedhet._checks). Catches the ones built in float32.
    algo = ready(FedACS(K=2))
    quietly_select(algo, 0, EVERYONE2)
    for key in ("success", "norms"):
        assert algo.last_system[key].dtype == F64
        close(algo.last_system[key], vec(1.0, 1.0))


def test_norms_learnt_from_round_contexts_fill_the_unknown_with_their_mean():
    # No oracle. Round 0's context: client 0 ran 1 step (||a||_1 = 1); round 1's: client 2 ran 5 (the earlier
    # norm is kept). Round 2 samples with ||a||_1 = [1, mean(1, 5) = 3, 5] and s = 1:
    # p ∝ [1/1, 1/3, 1/5] = [15, 5, 3] / 15 -> [15, 5, 3] / 23.
    # Catches: steps of 1 not counted as told (> 1), the known norms restarted each round, the new norms not
    # stored (or under another key), the unknown filled with 1 instead of the mean, or not filled at all (nan).
    algo = ready(FedACS(K=4), n=3)
    for t, steps in ((0, [1, 0, 0]), (1, [0, 0, 5])):
        quietly_select(algo, t, EVERYONE3)
        algo.open_round(t, ctx_for(t, 3, range(3), [], [], steps=steps))
        algo.close_round()
    quietly_select(algo, 2, EVERYONE3)
    close(algo.last_system["norms"], vec(1.0, 3.0, 5.0))
    close(algo.last_probabilities, vec(15 / 23, 5 / 23, 3 / 23))


# ============================================================================================== open_round, select
def test_open_round_before_select_names_the_rule_and_the_round():
    algo = ready(FedACS(K=2))
    with pytest.raises(RuntimeError) as err:
        algo.open_round(3, None)
    assert str(err.value) == ("FedACS: select() must be called for round 3 before open_round(3); updates are "
                              "weighted by their number of draws")


@pytest.mark.parametrize("field, values, message", [
    ("s", [1.5, 1.0], "success_probs must lie in [0, 1], got 1.5"),
    ("s", [1.0, 1.0, 1.0], LENGTH.format(name="success_probs")),
    ("pi", [1.5, 1.0], "availability_probs must lie in [0, 1], got 1.5"),
    ("pi", [1.0, 1.0, 1.0], LENGTH.format(name="availability_probs")),
])
def test_open_round_refuses_bad_context_probabilities(field, values, message):
    # Catches the context's check with its name, upper bound or per-client length dropped or changed.
    algo = ready(FedACS(K=2))
    quietly_select(algo, 0, EVERYONE2)
    with pytest.raises(ValueError) as err:
        algo.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], [], **{field: values}))
    assert str(err.value) == message


def test_select_refuses_an_availability_mask_of_the_wrong_length():
    algo = ready(FedACS(K=2))
    algo.observe_system(0, success_probs=1.0)
    with pytest.raises(ValueError) as err:
        algo.select(0, torch.ones(3, dtype=torch.bool), rng())
    assert str(err.value) == LENGTH.format(name="available")


def test_no_available_client_with_positive_probability_means_no_draw():
    # SampledFedAvg with p = [1, 0] and only client 1 available: p restricted to the available clients is 0 / 0,
    # so nothing is drawn and the recorded distribution is all zeros (not nan); the counts stay int64.
    # Catches the zero-total guard dropped or loosened (nan probabilities, or numpy's multinomial putting all K
    # draws on the last category), and the zero counts returned as None or float32.
    algo = ready(SampledFedAvg(K=3, probabilities=[1.0, 0.0]))
    counts = algo.select(0, torch.tensor([False, True]), rng())
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 0]
    assert algo.last_probabilities.tolist() == [0.0, 0.0]
    algo.open_round(0, None)
    assert torch.equal(algo.close_round(), torch.zeros(1, dtype=F64))  # an empty round leaves w unchanged


# ============================================================================================== the EMA estimator
def test_the_estimators_first_observation_is_taken_exactly_in_float64():
    # Rate 0.1, bias-corrected: v = 0.1 * x, u = 0.1, estimate v / u = x exactly (0.1 / 0.1 = 1 in float64).
    # Catches the arrival or availability indicator used as a bool (0.1 * True is float32: 0.10000000149...).
    est = SystemEstimator(rate=0.1)
    est.setup(2)
    est.update(EVERYONE2, torch.tensor([True, False]), torch.tensor([True, False]), None)
    close(est.success(), vec(1.0, 0.0))
    close(est.availability(), vec(1.0, 0.0))


def test_an_estimator_not_set_up_checkpoints_as_having_no_clients():
    # Catches the initial num_clients (0) or state ({}) changed.
    est = SystemEstimator(rate=0.3)
    assert est.state_dict() == {"rate": 0.3, "num_clients": 0}


def test_the_ema_estimator_learns_arrivals_without_a_round_context():
    # ctx = None: arrivals are still counted (nobody arrives, so every drawn client's first observation is a
    # failure: s = 0; never drawn: s = 1), and nothing is learnt about steps or availability.
    # Catches the context's steps or availability read when there is no context, or norms = "" passed on.
    algo = ready(FedACS(K=2, estimator="ema", ema=0.5), n=3)
    counts = algo.select(0, EVERYONE3, rng())
    algo.open_round(0, None)
    algo.close_round()
    close(algo.estimator.success(), torch.where(counts > 0, 0.0, 1.0).to(F64))
    close(algo.estimator.availability(), vec(1.0, 1.0, 1.0))
    close(algo.estimator.norms(), vec(1.0, 1.0, 1.0))


def test_the_ema_estimator_records_a_single_local_step():
    # Rate 1 (last observation only). Round 0: client 1 told 3 steps -> ||a||_1 = [mean 3, 3]. Round 1: client 0
    # told 1 step -> [1, 3]. Catches the "any client told to train" guard written as steps > 1.
    algo = ready(FedACS(K=2, estimator="ema", ema=1.0))
    for t, steps in ((0, [0, 3]), (1, [1, 0])):
        algo.select(t, EVERYONE2, rng(t))
        algo.open_round(t, ctx_for(t, 2, [0, 1], [], [], steps=steps))
        algo.close_round()
    close(algo.estimator.norms(), vec(1.0, 3.0))


def test_a_client_with_one_sample_counts_its_lost_draws():
    # client_sizes [1, 0]: client 0 holds data, so a draw that never arrives is a failure (rate 1: s = 0); client
    # 1 holds none and keeps s = 1. Catches the "holds data" test written as client_sizes > 1.
    algo = ready(FedACS(K=20, estimator="ema", ema=1.0), client_sizes=torch.tensor([1, 0]))
    counts = algo.select(0, EVERYONE2, rng())
    assert counts.tolist()[0] > 0 and counts.tolist()[1] > 0  # both drawn (20 draws from [1/2, 1/2])
    algo.open_round(0, None)
    algo.close_round()
    close(algo.estimator.success(), vec(0.0, 1.0))


# ============================================================================================== checkpoints
def restored(algo, factory):
    fresh = factory()
    fresh.load_state_dict(algo.state_dict())
    return fresh


def test_a_checkpoint_before_the_first_draw_round_trips():
    # Nothing drawn yet: every per-round attribute is None and comes back None. Catches a None attribute cloned.
    algo = ready(FedACS(K=2))
    back = restored(algo, lambda: FedACS(K=2))
    assert back.last_probabilities is None and back.last_counts is None and back.last_system is None
    os_ = restored(OS(K=2), lambda: OS(K=2))  # OS not even set up: no update norms yet
    assert os_.update_norms is None


def test_a_checkpoint_between_select_and_open_round_keeps_the_draws():
    # p = [1, 0], K = 2: client 0 drawn twice; after the round trip its update still counts 2/K: w = 3.
    # Catches the round of the draws not restored (open_round would refuse).
    algo = ready(SampledFedAvg(K=2, probabilities=[1.0, 0.0]))
    algo.select(0, EVERYONE2, rng())
    back = restored(algo, lambda: SampledFedAvg(K=2, probabilities=[1.0, 0.0]))
    back.open_round(0, None)
    back.add(0, vec(3.0), ONE)
    close(back.close_round(), vec(3.0))


def test_a_checkpoint_keeps_the_last_known_system_values():
    # Round 0's oracle: s = [1, 0.25], T = [1, 1]. After the round trip, round 1 has no oracle and falls back to
    # them: p ∝ [1/1, 1/0.25] = [1, 4] -> [0.2, 0.8]. Catches the known values not saved or not restored.
    algo = ready(FedACS(K=4))
    algo.observe_system(0, success_probs=[1.0, 0.25], local_steps=1)
    back = restored(algo, lambda: FedACS(K=4))
    quietly_select(back, 1, EVERYONE2)
    close(back.last_probabilities, vec(0.2, 0.8))


def test_a_checkpoint_keeps_the_observed_round_and_the_warning_flag():
    # Catches the round of the last oracle call, or the once-only warning flag, not restored (a spurious warning).
    observed = ready(FedACS(K=2))
    observed.observe_system(0, success_probs=1.0)
    no_warning_select(restored(observed, lambda: FedACS(K=2)), 0, EVERYONE2)
    warned = ready(FedACS(K=2))
    quietly_select(warned, 0, EVERYONE2)
    no_warning_select(restored(warned, lambda: FedACS(K=2)), 1, EVERYONE2)


def test_a_checkpoint_without_estimator_is_refused_by_a_rule_with_one():
    algo = ready(FedACS(K=3))
    with pytest.raises(ValueError) as err:
        FedACS(K=3, estimator="ema").load_state_dict(algo.state_dict())
    assert str(err.value) == "state was saved with estimator=None but this rule has estimator='ema'"


# ============================================================================================== constructor options
class UniformSampler(WithReplacementSampler):
    """The shared sampler with only what a subclass must give: uniform scores."""

    def _scores(self, system):
        return torch.ones(self.num_clients, dtype=F64)


def test_the_shared_samplers_defaults_and_the_bound_on_draws():
    # Defaults: unavailable="renormalize", server_lr=1. K is bounded by 10^9 (numpy's multinomial takes a C long).
    # Catches a default changed and the upper bound on K dropped or the name in its message changed.
    assert UniformSampler(K=2).hparams() == {"K": 2, "unavailable": "renormalize", "server_lr": 1.0}
    assert UniformSampler(K=10**9).K == 10**9
    with pytest.raises(ValueError) as err:
        FedACS(K=10**9 + 1)
    assert str(err.value) == "K (number of draws per round) must be an integer in [1, 1000000000], got 1000000001"


@pytest.mark.parametrize("build, message", [
    (lambda: FedACS(K=1, unavailable="skip"), "unavailable must be one of ('renormalize', 'drop'), got 'skip'"),
    (lambda: FedACS(K=1, server_lr=0.0), "server_lr must lie in (0, inf], got 0.0"),
    (lambda: FedACS(K=1, estimator="kalman"), "estimator must be one of (None, 'ema'), got 'kalman'"),
    (lambda: FedACS(K=1, momentum=1.0), "momentum must lie in [0, 1), got 1.0"),
    (lambda: FedACS(K=1, prox_mu=-1.0), "prox_mu must lie in [0, inf], got -1.0"),
    (lambda: FedACS(K=1, local_lr=0.0), "local_lr must lie in (0, inf], got 0.0"),
    (lambda: FedACS(K=1, min_success=0.0), "min_success must lie in (0, 1], got 0.0"),
    (lambda: FedACS(K=1, min_success=1.5), "min_success must lie in (0, 1], got 1.5"),
    (lambda: FedACS(K=1, ema=0.0), "ema (the estimator's rate) must lie in (0, 1], got 0.0"),
    (lambda: FedACS(K=1, ema=1.5), "ema (the estimator's rate) must lie in (0, 1], got 1.5"),
    (lambda: FedACS(K=1, calibrate=1),
     "calibrate must be one of ('client', 'server') or False, True (= 'client'), got 1"),
    (lambda: FedACS(K=1, calibrate=True, calibration_cap=0.0), "calibration_cap must lie in (0, inf], got 0.0"),
    (lambda: CAFedAvg(K=1, calibrate=1),
     "calibrate must be one of ('client', 'server') or False, True (= 'client'), got 1"),
    (lambda: CAFedAvg(K=1, calibrate=True, calibration_cap=0.0), "calibration_cap must lie in (0, inf], got 0.0"),
    (lambda: OS(K=1, mix=1.0), "mix must lie in [0, 1), got 1.0"),
])
def test_constructors_refuse_bad_options_naming_them(build, message):
    # Catches a name changed or None, an interval's open end closed (server_lr = 0, local_lr = 0, momentum = 1 let
    # through to the solver check, whose wording differs), its bound dropped (prox_mu < 0) or moved (1.5 let into
    # (0, 1]).
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value) == message


def test_fedacs_with_explicit_omega_checks_its_length_at_setup():
    # Catches the length check comparing None, or naming another parameter.
    algo = ready(FedACS(K=2, omega=[0.25, 0.75]))
    close(algo.omega, vec(0.25, 0.75))
    with pytest.raises(ValueError) as err:
        FedACS(K=2, omega=[0.25, 0.75]).setup(3, torch.zeros(1, dtype=F64))
    assert str(err.value) == "omega has 2 entries but num_clients is 3; give a scalar or exactly one value per client"


def test_sampled_fedavg_forwards_setup_and_server_lr():
    # client_weights [1, 3] -> p = omega = [0.25, 0.75]; client_sizes kept as given. p = [1, 0], K = 2,
    # server_lr = 0.5: client 0 drawn twice, w = 0.5 * (2 / 2) * 3 = 1.5.
    # Catches client_weights or client_sizes not forwarded to the base setup, server_lr not forwarded, and the
    # probabilities' length check naming another parameter.
    algo = ready(SampledFedAvg(K=4), client_weights=torch.tensor([1.0, 3.0]), client_sizes=torch.tensor([2, 5]))
    algo.select(0, EVERYONE2, rng())
    close(algo.last_probabilities, vec(0.25, 0.75))
    assert algo.client_sizes.tolist() == [2, 5]
    algo = ready(SampledFedAvg(K=2, probabilities=[1.0, 0.0], server_lr=0.5))
    algo.select(0, EVERYONE2, rng())
    algo.open_round(0, None)
    algo.add(0, vec(3.0), ONE)
    close(algo.close_round(), vec(1.5))
    with pytest.raises(ValueError) as err:
        ready(SampledFedAvg(K=2, probabilities=[0.5, 0.25, 0.25]))
    assert str(err.value) == LENGTH.format(name="probabilities")


def test_cafedavg_floors_success_at_min_success():
    # omega = [1, 0]: client 0 drawn K = 2 times. s_0 = 0.25 is floored to min_success = 0.5, so its update is
    # divided by 0.5: w = (2 / 2) * (1 / 0.5) * 1 = 2 (not 1 / 0.25 = 4). Catches min_success not forwarded.
    algo = ready(CAFedAvg(K=2, min_success=0.5), client_weights=torch.tensor([1.0, 0.0]))
    algo.observe_system(0, success_probs=[0.25, 1.0])
    algo.select(0, EVERYONE2, rng())
    algo.open_round(0, None)
    algo.add(0, vec(1.0), ONE)
    close(algo.close_round(), vec(2.0))


@pytest.mark.parametrize("estimator, ctx", [(None, False), ("ema", True)])
def test_cafedavg_without_a_context_value_divides_by_its_system_success(estimator, ctx):
    # Nothing observed (oracle) or a fresh estimator: s = 1, so client 0 (drawn K = 2 times, omega = [1, 0]) moves
    # w by (2 / 2) * 1 = 1. Under the estimator the context's success_probs (0.5) are ignored (module doc).
    # Catches the context branch entered without a context, or under the estimator (both read an unset value).
    algo = ready(CAFedAvg(K=2, estimator=estimator), client_weights=torch.tensor([1.0, 0.0]))
    algo.select(0, EVERYONE2, rng())
    algo.open_round(0, ctx_for(0, 2, [0, 1], [0], [0], s=[0.5, 0.5]) if ctx else None)
    algo.add(0, vec(1.0), ONE)
    close(algo.close_round(), vec(1.0))


def test_cafedavg_calibration_scales_the_server_step():
    # omega = [1/2, 1/2], s = [1, 0.5], ||a||_1 = T = [1, 3]. App. I.2: sum omega s a / sum omega a
    # = (0.5 + 0.75) / (0.5 + 1.5) = 0.625. Every drawn client sends delta = 1, divided by s:
    # w = 0.625 * (c_0 * 1 / 1 + c_1 * 1 / 0.5) / K. Catches the multiplier put on the client step (server 1).
    algo = ready(CAFedAvg(K=4, calibrate="server"))
    algo.observe_system(0, success_probs=[1.0, 0.5], local_steps=[1, 3])
    c = algo.select(0, EVERYONE2, rng(3)).tolist()
    algo.open_round(0, None)
    for m in range(2):
        if c[m]:
            algo.add(m, vec(1.0), ONE)
    close(algo.close_round(), vec(0.625 * (c[0] + 2 * c[1]) / 4))


# ============================================================================================== OS
def test_os_forwards_setup_and_keeps_float64_update_norms():
    # No norm known yet: p = omega = client_weights normalised = [0.25, 0.75]; client_sizes kept; update norms
    # float64 nan. Catches client_weights or client_sizes not forwarded, and the norms' table in float32.
    algo = ready(OS(K=4), client_weights=torch.tensor([1.0, 3.0]), client_sizes=torch.tensor([2, 5]))
    algo.select(0, EVERYONE2, rng())
    close(algo.last_probabilities, vec(0.25, 0.75))
    assert algo.client_sizes.tolist() == [2, 5]
    assert algo.update_norms.dtype == F64 and torch.isnan(algo.update_norms).all()


def test_os_measures_update_norms_in_float64():
    # A float32 delta [0.1f, 0.2f] has norm hypot(0.1f, 0.2f) = 0.22360680108... in float64; in float32 it would
    # be 0.2236067950... Catches the norm taken in the delta's dtype.
    algo = OS(K=4)
    algo.setup(2, torch.zeros(2))
    c = algo.select(0, EVERYONE2, rng()).tolist()
    assert c[0] > 0
    algo.open_round(0, None)
    delta = torch.tensor([0.1, 0.2], dtype=torch.float32)
    algo.add(0, delta, ONE)
    algo.close_round()
    assert float(algo.update_norms[0]) == pytest.approx(math.hypot(float(delta[0]), float(delta[1])), rel=1e-15)


def test_os_fills_unknown_norms_with_the_mean_of_the_known_ones():
    # Uniform omega over 3 clients; round 0 receives |delta_0| = 0.1 and |delta_1| = 0.2 (client 2 lost), so
    # round 1 uses n = [0.1, 0.2, mean 0.15]: p ∝ [0.1, 0.2, 0.15] / 0.45 = [2/9, 4/9, 1/3] (tolerance 1e-12).
    # Catches the unknown filled with 1 (p ∝ [0.1, 0.2, 1]), the fill rounded to float32 (~1e-8 off), and the
    # all-zero fallback taken whenever the scores sum to <= 1 (p = omega).
    algo = ready(OS(K=30), n=3)
    c = algo.select(0, EVERYONE3, rng()).tolist()
    assert min(c) > 0  # 30 draws from [1/3, 1/3, 1/3]
    algo.open_round(0, None)
    algo.add(0, vec(0.1), ONE)
    algo.add(1, vec(-0.2), ONE)
    algo.close_round()
    algo.select(1, EVERYONE3, rng(1))
    close(algo.last_probabilities, vec(2 / 9, 4 / 9, 1 / 3))


def test_os_falls_back_to_omega_when_every_known_update_was_zero():
    # Both clients sent exactly zero: omega * n sums to 0, so p = omega = [1/2, 1/2] (not 0/0).
    algo = ready(OS(K=20))
    c = algo.select(0, EVERYONE2, rng()).tolist()
    assert min(c) > 0
    algo.open_round(0, None)
    algo.add(0, vec(0.0), ONE)
    algo.add(1, vec(0.0), ONE)
    algo.close_round()
    algo.select(1, EVERYONE2, rng(1))
    close(algo.last_probabilities, vec(0.5, 0.5))


def test_os_forwards_server_lr():
    # client_weights [1, 0]: p = [1, 0], client 0 drawn K = 2 times with omega / p = 1; server_lr 0.5:
    # w = 0.5 * (2 / 2) * 3 = 1.5.
    algo = ready(OS(K=2, server_lr=0.5), client_weights=torch.tensor([1.0, 0.0]))
    algo.select(0, EVERYONE2, rng())
    algo.open_round(0, None)
    algo.add(0, vec(3.0), ONE)
    close(algo.close_round(), vec(1.5))


# ============================================================================================== analysis helpers
SYSTEM_ERRORS = [
    (dict(omega=[0.0, 0.0]), "omega must be finite, non-negative and not all zero, got all zeros"),
    (dict(success_probs=[0.0, 1.0]), "success_probs must lie in (0, 1], got 0.0"),
    (dict(success_probs=[1.5, 1.0]), "success_probs must lie in (0, 1], got 1.5"),
    (dict(success_probs=[1.0, 1.0, 1.0]), LENGTH.format(name="success_probs")),
    (dict(norms=[0.0, 1.0]), "norms must lie in (0, inf], got 0.0"),
    (dict(norms=[1.0, 1.0, 1.0]), LENGTH.format(name="norms")),
]


@pytest.mark.parametrize("bad, message", SYSTEM_ERRORS)
@pytest.mark.parametrize("function", [
    fedacs_probabilities,
    lambda omega, success_probs, norms: effective_step("fedacs", omega, success_probs, norms),
], ids=["fedacs_probabilities", "effective_step"])
def test_the_system_vectors_are_checked_with_their_names_and_ranges(function, bad, message):
    # Catches, in fedacs._system_vectors and calibration._vectors: a name changed or None, s = 0 let in (the
    # interval open at 0), s > 1 let in, the per-client length not checked (num_clients dropped or None).
    args = {"omega": [0.5, 0.5], "success_probs": [1.0, 0.5], "norms": [1.0, 2.0], **bad}
    with pytest.raises(ValueError) as err:
        function(**args)
    assert str(err.value) == message


@pytest.mark.parametrize("call, message", [
    (lambda: surrogate_weights([-1.0, 2.0], [1.0, 1.0], [1.0, 1.0]), "probabilities must lie in [0, inf], got -1.0"),
    (lambda: chi_square([0.5, 0.5], [1.0, 1.0, 1.0]), LENGTH.format(name="surrogate")),
    (lambda: effective_step("fedprox", [1.0], 1.0, 1.0),
     "method must be one of ('fedavg', 'fedacs', 'cafedavg', 'fedvarp', 'fednova', 'fednova_arrived', 'fedau', 'os'), "
     "got 'fedprox'"),
    (lambda: lr_scalings([1.0], 1.0, 1.0, target="both"), "target must be one of ('client', 'server'), got 'both'"),
])
def test_the_analysis_helpers_refuse_bad_arguments_naming_them(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message
