"""FedNova (FedACS paper's baseline, Eq. 116): hand-computed rounds, ||a||_1 closed forms, solver checks.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedAvg, FedNova, RoundContext
from lightning_fedhet.algorithms.fednova import accumulation_norm, check_optimizer_matches
from tests.algorithms.rule_rounds import F64, check_resume, close, make_ctx, random_run, run_round, setup


def test_fednova_hand_computed_sgd():
    algo = setup(FedNova(), 3, [0.0, 0.0])
    # round 0: steps [1,3]; q = 1/2; tau_eff = (1+3)/2 = 2; 2 * (0.5[2,0]/1 + 0.5[0,6]/3) = [2,2]
    close(run_round(algo, 0, 3, {0: [2, 0], 1: [0, 6]}, steps={0: 1, 1: 3}), [2.0, 2.0])
    assert algo.last_weights == pytest.approx({0: 1.0, 1: 1 / 3})
    # round 1: steps [2,1,6]; tau_eff = 3; 3 * (1/3)([4,4]/2 + [3,0]/1 + [0,12]/6) = [2,2]+[3,0]+[0,2] = [5,4]
    close(run_round(algo, 1, 3, {0: [4, 4], 1: [3, 0], 2: [0, 12]}, steps={0: 2, 1: 1, 2: 6}), [7.0, 6.0])
    # round 2: only client 2, 4 steps: tau_eff = 4 -> 4 * [1,1]/4 = [1,1]
    close(run_round(algo, 2, 3, {2: [1, 1]}, steps={2: 4}), [8.0, 7.0])


def test_fednova_hand_computed_momentum():
    # rho = 0.5: ||a||_1 = sum_{k=1..tau} (1 - rho^k)/(1 - rho): tau=1 -> 1; tau=2 -> 1 + 1.5 = 2.5;
    # tau=3 -> 1 + 1.5 + 1.75 = 4.25
    assert accumulation_norm(1, 0.5) == pytest.approx(1.0)
    assert accumulation_norm(2, 0.5) == pytest.approx(2.5)
    assert accumulation_norm(3, 0.5) == pytest.approx(4.25)
    algo = setup(FedNova(momentum=0.5), 3, [0.0, 0.0])
    # round 0: a = [1, 4.25]; tau_eff = 2.625; normalised: 0.5[2,0]/1 + 0.5[0,8.5]/4.25 = [1,1] -> [2.625, 2.625]
    close(run_round(algo, 0, 3, {0: [2, 0], 1: [0, 8.5]}, steps={0: 1, 1: 3}), [2.625, 2.625])
    # round 1: a = [2.5, 1]; tau_eff = 1.75; 0.5[5,5]/2.5 + 0.5[1,0]/1 = [1.5, 1] -> + [2.625, 1.75] = [5.25, 4.375]
    close(run_round(algo, 1, 3, {0: [5, 5], 2: [1, 0]}, steps={0: 2, 2: 1}), [5.25, 4.375])
    # round 2: client 1 alone, a = 2.5: 2.5 * [0, 2.5]/2.5 -> + [0, 2.5] = [5.25, 6.875]
    close(run_round(algo, 2, 3, {1: [0, 2.5]}, steps={1: 2}), [5.25, 6.875])


def test_fednova_proximal_norm_and_torch_sgd_unrolling():
    # prox, eta*mu = 0.5: a = [(1-0.5)^{tau-t}] -> tau=2: 0.5 + 1 = 1.5; tau=3: 0.25 + 0.5 + 1 = 1.75
    assert accumulation_norm(2, 0.0, 0.5) == pytest.approx(1.5)
    assert accumulation_norm(3, 0.0, 0.5) == pytest.approx(1.75)
    assert FedNova(prox_mu=5.0, local_lr=0.1).norm(3) == pytest.approx(1.75)
    # With a constant gradient g, delta = -eta ||a||_1 g exactly for any solver: check against torch.optim.SGD
    g = torch.tensor([1.0, -2.0], dtype=F64)
    for rho, mu, steps in ((0.0, 0.0, 5), (0.9, 0.0, 7), (0.0, 2.0, 6), (0.7, 1.5, 9)):
        eta = 0.1
        x0 = torch.tensor([0.3, 0.4], dtype=F64)
        x = x0.clone().requires_grad_(True)
        opt = torch.optim.SGD([x], lr=eta, momentum=rho)
        for _ in range(steps):
            opt.zero_grad()
            loss = (g * x).sum() + 0.5 * mu * ((x - x0) ** 2).sum()
            loss.backward()
            opt.step()
        delta = x.detach() - x0
        torch.testing.assert_close(delta, -eta * accumulation_norm(steps, rho, eta * mu) * g, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weighting", ["participating", "samples"])
def test_fednova_equal_steps_equals_fedavg(momentum, weighting):
    nova, avg = random_run(
        [FedNova(momentum=momentum, weighting=weighting), FedAvg(weighting=weighting)],
        weights=torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5]),
    )
    for a, b in zip(nova, avg):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: FedNova(momentum=0.5, prox_mu=1.0, local_lr=0.1), id="fednova"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedNova(momentum=1.0), "momentum"),
        (lambda: FedNova(momentum=-0.1), "momentum"),
        (lambda: FedNova(prox_mu=-1.0), "prox_mu"),
        (lambda: FedNova(prox_mu=0.1), "local_lr"),
        (lambda: FedNova(prox_mu=20.0, local_lr=0.1), "local_lr \\* prox_mu"),
        (lambda: FedNova(weighting="all"), "weighting"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    # FedNova needs at least one local step
    nova = setup(FedNova(), 2, [0.0])
    nova.open_round(0, None)
    with pytest.raises(ValueError, match="local_steps"):
        nova.add(0, torch.zeros(1, dtype=F64), ClientInfo(num_samples=1, local_steps=0))


def test_fednova_divisor_selected_is_the_fedacs_paper_form():
    # Eq. 116a: w += server_lr * tau_eff * (1/K) sum_{received draws} delta_i / ||a_i||_1, tau_eff = mean ||a|| over
    # the received draws. N = K = 3 selected, uniform alpha; clients 0 (1 step) and 1 (3 steps) arrive, 2 is lost.
    # (1/3)([2,0]/1 + [0,6]/3) = [2/3, 2/3]; tau_eff = (1 + 3)/2 = 2 -> [4/3, 4/3] (divisor="arrived" gives [2, 2])
    algo = setup(FedNova(divisor="selected"), 3, [0.0, 0.0])
    close(run_round(algo, 0, 3, {0: [2, 0], 1: [0, 6]}, steps={0: 1, 1: 3}, selected=[0, 1, 2]), [4 / 3, 4 / 3])
    assert algo.last_weights == pytest.approx({0: 2 / 3, 1: 2 / 9})  # tau_eff / K / ||a_i||_1
    # selected given as draw counts: client 0 drawn twice, client 1 once (K = 3 draws), both arrive.
    # (1/3)(2 [2,0]/1 + [0,6]/3) = [4/3, 2/3]; tau_eff = (1 + 1 + 3)/3 = 5/3 -> w += [20/9, 10/9]
    algo = setup(FedNova(divisor="selected"), 3, [0.0, 0.0])
    ones = torch.ones(3, dtype=torch.bool)
    recv = torch.tensor([True, True, False])
    algo.open_round(0, RoundContext(0, 3, ones, torch.tensor([2, 1, 0]), recv))
    algo.add(0, torch.tensor([2.0, 0.0], dtype=F64), ClientInfo(1, local_steps=1))
    algo.add(1, torch.tensor([0.0, 6.0], dtype=F64), ClientInfo(1, local_steps=3))
    close(algo.close_round(), [20 / 9, 10 / 9])
    assert algo.last_tau_eff == pytest.approx(5 / 3)
    # nobody arrives: unchanged
    close(run_round(algo, 1, 3, {}, selected=[0, 1]), [20 / 9, 10 / 9])


def test_fednova_divisor_selected_validation():
    with pytest.raises(ValueError, match="divisor must be one of"):
        FedNova(divisor="K")
    with pytest.raises(ValueError, match="divisor='selected' needs weighting='participating'"):
        FedNova(divisor="selected", weighting="samples")
    algo = setup(FedNova(divisor="selected"), 3, [0.0])
    with pytest.raises(ValueError, match="needs RoundContext.selected"):
        algo.open_round(0, None)
    algo.open_round(0, make_ctx(0, 3, [0], selected=[0]))
    with pytest.raises(ValueError, match="client 1 arrived but is not in RoundContext.selected"):
        algo.add(1, torch.zeros(1, dtype=F64), ClientInfo(1, 1))


def _sgd(momentum=0.0, **kw):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=momentum, **kw)


def test_persisted_momentum_breaks_the_assumed_norm():
    # Why optimizer_state="persist" is refused: with a constant gradient g, 3 steps of SGD(momentum=0.9) from a fresh
    # buffer move x by -eta ||a||_1 g with ||a||_1 = 1 + 1.9 + 2.71 = 5.61; a second round of 3 steps that keeps the
    # buffer (b = 2.71) moves it by -eta (5.61 + 2.71 (0.9 + 0.81 + 0.729)) g = -eta 12.22 g.
    g = torch.tensor([1.0, -2.0], dtype=F64)
    x = torch.zeros(2, dtype=F64, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1, momentum=0.9)
    moves = []
    for _ in range(2):
        start = x.detach().clone()
        for _ in range(3):
            opt.zero_grad()
            (g * x).sum().backward()
            opt.step()
        moves.append((start - x.detach()) / (0.1 * g))
    torch.testing.assert_close(moves[0], torch.full((2,), 5.61, dtype=F64), atol=1e-9, rtol=0)
    torch.testing.assert_close(moves[1], torch.full((2,), 5.61 + 2.71 * 2.439, dtype=F64), atol=1e-9, rtol=0)
    assert accumulation_norm(3, 0.9) == pytest.approx(5.61)


def test_check_client_solver():
    FedNova(momentum=0.9).check_client_solver(_sgd(0.9, weight_decay=5e-4), "reset")  # weight decay: objective
    FedNova().check_client_solver(_sgd(0.0), "persist")  # plain SGD keeps no state
    FedNova(prox_mu=1.0, local_lr=0.1).check_client_solver(_sgd(0.0), "reset")
    with pytest.raises(ValueError, match=r"FedNova\(momentum=0\.9\).*optimizer_state='persist'"):
        FedNova(momentum=0.9).check_client_solver(_sgd(0.9), "persist")
    with pytest.raises(ValueError, match=r"FedNova\(momentum=0\.5\) does not match the optimizer's momentum=0\.9"):
        FedNova(momentum=0.5).check_client_solver(_sgd(0.9), "reset")
    with pytest.raises(ValueError, match=r"FedNova\(momentum=0\.0\) does not match the optimizer's momentum=0\.9"):
        FedNova().check_client_solver(_sgd(0.9), "reset")
    with pytest.raises(ValueError, match="nesterov=True"):
        FedNova(momentum=0.9).check_client_solver(_sgd(0.9, nesterov=True), "reset")
    with pytest.raises(ValueError, match="dampening=0.1"):
        FedNova(momentum=0.9).check_client_solver(_sgd(0.9, dampening=0.1), "reset")
    with pytest.raises(ValueError, match=r"FedNova\(local_lr=0\.05\) does not match the optimizer's lr=0\.1"):
        FedNova(prox_mu=1.0, local_lr=0.05).check_client_solver(_sgd(0.0), "reset")
    with pytest.raises(ValueError, match="models torch.optim.SGD.*Adam"):
        FedNova().check_client_solver(torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]), "reset")
    with pytest.raises(ValueError, match="optimizer_state must be"):
        FedNova().check_client_solver(_sgd(0.0), "keep")
    two_groups = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}],
        lr=0.1,
        momentum=0.9,
    )
    two_groups.param_groups[1]["momentum"] = 0.0
    with pytest.raises(ValueError, match=r"momentum=0\.0 \(param group 1\)"):
        FedNova(momentum=0.9).check_client_solver(two_groups, "reset")
    # the helper FedACS shares names its caller
    with pytest.raises(ValueError, match=r"FedACS\(momentum=0\.9\)"):
        check_optimizer_matches("FedACS", _sgd(0.9), "persist", 0.9)


# ------------------------------------------------------------------------ against the fednova chunk's survivors
def test_divisor_selected_divides_by_the_selected_weight_not_by_one():
    # N = 4, uniform alpha = 1/4, S = {0, 1, 2} (K = 3 of 4): clients 0 (1 step, [2]) and 1 (2 steps, [4]) arrive,
    # 2 is lost. Eq. 116a: tau_eff = (1 + 2)/2 = 1.5; (1/K) sum delta_i/||a_i||_1 = (1/3)(2/1 + 4/2) = 4/3;
    # w = 1.5 * 4/3 = 2. Slip caught: multiplying by sum_{S} alpha_j (= 3/4) instead of dividing (1.125).
    algo = setup(FedNova(divisor="selected"), 4, [0.0])
    close(run_round(algo, 0, 4, {0: [2], 1: [4]}, steps={0: 1, 1: 2}, selected=[0, 1, 2]), [2.0])
    assert algo.last_tau_eff == pytest.approx(1.5)
    # an empty round: no weights, no tau_eff, w unchanged
    close(run_round(algo, 1, 4, {}, selected=[3]), [2.0])
    assert algo.last_weights == {} and algo.last_tau_eff is None


def test_accumulation_norm_by_hand_at_the_corners():
    # Plain SGD by default: tau. Momentum with prox = 1 (eta mu = 1, allowed): the exact recursion
    # B_k = rho B_{k-1} + 1 - C_k, C_{k+1} = C_k + B_k from C_1 = 0: B = 1, 0.5, -0.25 -> C = 1, 1.5, 1.25.
    # Proximal only, eta mu = 0.1, 2 steps: (1 - 0.9^2) / 0.1 = 1.9.
    # Slips caught: a momentum default of 1, the pure-momentum closed form taken for c == 1.
    assert accumulation_norm(3) == 3.0
    assert accumulation_norm(3, 0.5, 1.0) == pytest.approx(1.25)
    assert accumulation_norm(2, 0.0, 0.1) == pytest.approx(1.9)
    # the rule uses prox = prox_mu * local_lr for any prox_mu > 0 (slip caught: `prox_mu > 1`)
    assert FedNova(prox_mu=0.5, local_lr=0.2).norm(2) == pytest.approx(1.9)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FedNova(momentum=False), r"^momentum must be in \[0, 1\), got False$"),
        (lambda: FedNova(momentum="0.5"), r"^momentum must be in \[0, 1\), got '0.5'$"),
        (lambda: FedNova(prox_mu=False), r"^prox_mu must be >= 0, got False$"),
        (lambda: FedNova(prox_mu="1"), r"^prox_mu must be >= 0, got '1'$"),
        (lambda: FedNova(local_lr=0.0), r"^local_lr must lie in \(0, inf\), got 0.0$"),
        (lambda: FedNova(local_lr=float("inf")), r"^local_lr must be finite, got inf$"),
        (lambda: FedNova(prox_mu=0.1), r"^prox_mu > 0 needs local_lr \(the client learning rate\) to compute "
                                       r"\|\|a_i\|\|_1$"),
        (lambda: FedNova(prox_mu=0.5, local_lr=4.0), r"^local_lr \* prox_mu must be in \(0, 1\], got 2.0$"),
        (lambda: FedNova(weighting="all"), r"^weighting must be one of"),
        (lambda: FedNova(divisor="selected", weighting="samples"),
         r"^divisor='selected' needs weighting='participating' \(the sample counts of lost clients are not "
         r"reported; pass client_weights proportional to \|D_i\| instead\)$"),
        (lambda: FedNova(server_lr=0.0), r"^server_lr must lie in \(0, inf\), got 0.0$"),
        (lambda: FedNova(server_lr=float("inf")), r"^server_lr must be finite, got inf$"),
    ],
)
def test_bad_arguments_are_refused_naming_the_parameter_and_its_range(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_edge_values_that_are_allowed():
    # eta mu = 1 exactly is allowed ((0, 1]); momentum 0 with dampening is plain SGD (dampening acts on momentum
    # only); a local_lr without a proximal term is not compared with the optimizer's lr.
    FedNova(prox_mu=0.5, local_lr=2.0)
    FedNova().check_client_solver(_sgd(0.0, dampening=0.5), "reset")
    FedNova(local_lr=0.5).check_client_solver(_sgd(0.0), "reset")
    check_optimizer_matches("FedNova", _sgd(0.0), "reset", 0.0)  # prox_mu defaults to 0: lr not compared
    check_optimizer_matches("FedNova", _sgd(0.0), "reset", 0.0, local_lr=0.5)


def test_solver_mismatch_messages_name_the_param_group_only_when_there_are_several():
    one = _sgd(0.9)
    with pytest.raises(ValueError, match=r"does not match the optimizer's momentum=0\.9: \|\|a_i\|\|_1 would be wrong"):
        FedNova(momentum=0.5).check_client_solver(one, "reset")
    two = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "momentum": 0.5},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "momentum": 0.9}], lr=0.1)
    with pytest.raises(ValueError, match=r"momentum=0\.9 \(param group 1\): "):
        FedNova(momentum=0.5).check_client_solver(two, "reset")
    with pytest.raises(ValueError, match=r"^FedNova\(momentum=0\.9\) assumes every client's momentum buffer restarts "
                                         r"each round \(its \|\|a_i\|\|_1 is that of a fresh solver\), but "
                                         r"optimizer_state='persist' carries the buffers across rounds; use "
                                         r"optimizer_state='reset'$"):
        FedNova(momentum=0.9).check_client_solver(_sgd(0.9), "persist")


def test_round_protocol_errors_and_reported_options():
    algo = FedNova(momentum=0.5, prox_mu=0.1, local_lr=0.2, server_lr=2.0)
    assert algo.last_tau_eff is None
    assert algo.hparams() == {"momentum": 0.5, "prox_mu": 0.1, "local_lr": 0.2, "weighting": "participating",
                              "server_lr": 2.0, "divisor": "arrived"}
    selected = setup(FedNova(divisor="selected"), 2, [0.0])
    with pytest.raises(ValueError, match=r"^FedNova\(divisor='selected'\) needs RoundContext.selected \(the K "
                                         r"selected clients\)$"):
        selected.open_round(0, None)
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"^RoundContext.selected must have num_clients=2 entries$"):
        selected.open_round(0, SimpleNamespace(selected=torch.ones(3, dtype=torch.bool)))
