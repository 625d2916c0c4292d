"""F3AST as run in CA-Fed's experiments (Ribero et al. 2023): top-k available clients by alpha^2/r^2, weights alpha/r,
with the three activity rates r: the library's EMA, the authors' code's (1-beta) pi + beta 1[active], the thesis' pi.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import F3AST, ClientInfo
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, mask, vec

ALPHA4 = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
PI4 = [0.5, 0.25, 0.75, 1.0]


def test_f3ast_hand_computed():
    # alpha = [0.1, 0.2, 0.3, 0.4], beta = 0.5, r starts at 0.5 for everyone, k = 2
    # round 0, available {0, 1, 3}: r = 0.5*0.5 + 0.5*[1, 1, 0, 1] = [0.75, 0.75, 0.25, 0.75]
    #   scores alpha^2/r^2 over available: 0: 0.01/0.5625 = 0.0178, 1: 0.04/0.5625 = 0.0711, 3: 0.16/0.5625 = 0.284
    #   -> top 2 = {3, 1}; weights alpha/r: q_1 = 0.2/0.75 = 4/15, q_3 = 0.4/0.75 = 8/15
    #   deltas 15 and 30 -> w = 4 + 16 = 20
    algo = F3AST(k=2, beta=0.5, init_rate=0.5)
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [False, True, False, True]
    assert torch.allclose(algo.rates, vec(0.75, 0.75, 0.25, 0.75))
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [1, 3], [1, 3]))
    algo.add(1, vec(15.0), ClientInfo(1, 1))
    algo.add(3, vec(30.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(20.0))
    assert algo.last_weights == pytest.approx({1: 4 / 15, 3: 8 / 15})
    # round 1, available {0, 1, 2}: r = 0.5*[0.75, 0.75, 0.25, 0.75] + 0.5*[1, 1, 1, 0] = [0.875, 0.875, 0.625, 0.375]
    #   scores: 0: 0.01/0.7656 = 0.0131, 1: 0.04/0.7656 = 0.0522, 2: 0.09/0.3906 = 0.2304 -> top 2 = {2, 1}
    #   q_1 = 0.2/0.875 = 8/35, q_2 = 0.3/0.625 = 0.48; client 2's upload lost -> w = 20 + (8/35)*35 = 28
    assert algo.select(1, mask(4, [0, 1, 2]), None).tolist() == [False, True, True, False]
    algo.open_round(1, ctx_for(1, 4, [0, 1, 2], [1, 2], [1]))
    algo.add(1, vec(35.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(28.0))
    # bias-corrected EMA without init_rate: after rounds on/off/on with beta = 0.5:
    # v = 0.5, 0.25, 0.625; u = 0.5, 0.75, 0.875 -> r = 0.625/0.875 = 5/7
    b = F3AST(k=1, beta=0.5)
    b.setup(1, torch.zeros(1, dtype=F64))
    for t, on in enumerate([True, False, True]):
        b.select(t, torch.tensor([on]), None)
    assert torch.allclose(b.rates, vec(5 / 7))


def test_f3ast_authors_code_rate_from_the_oracle_every_round():
    # rate="code": r_i = (1 - beta) pi_i + beta 1[i available], recomputed every round (no memory). beta = 0.5,
    # alpha = [0.1, 0.2, 0.3, 0.4], pi = [0.5, 0.25, 0.75, 1.0], k = 2.
    # round 0, available {0, 1, 3}: r = [0.25 + 0.5, 0.125 + 0.5, 0.375, 0.5 + 0.5] = [0.75, 0.625, 0.375, 1.0]
    #   scores alpha^2/r^2 over available: 0: 0.01/0.5625 = 0.0178, 1: 0.04/0.390625 = 0.1024, 3: 0.16/1 = 0.16
    #   -> top 2 = {3, 1}; q_1 = 0.2/0.625 = 0.32, q_3 = 0.4/1.0 = 0.4; deltas 10 and 5 -> w = 3.2 + 2 = 5.2
    algo = F3AST(k=2, beta=0.5, rate="code", pi=PI4)
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [False, True, False, True]
    assert torch.allclose(algo.rates, vec(0.75, 0.625, 0.375, 1.0))
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [1, 3], [1, 3]))
    algo.add(1, vec(10.0), ClientInfo(1, 1))
    algo.add(3, vec(5.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(5.2))
    assert algo.last_weights == pytest.approx({1: 0.32, 3: 0.4})
    # round 1, available {0, 1, 2}: r = [0.75, 0.625, 0.375 + 0.5, 0.5] = [0.75, 0.625, 0.875, 0.5] (client 3's
    #   rate is back to 0.5 * pi: nothing is carried over). Scores: 0: 0.0178, 1: 0.1024, 2: 0.09/0.765625 = 0.1176
    #   -> top 2 = {2, 1}; q_2 = 0.3/0.875 = 12/35; only client 2 arrives with delta 35 -> w = 5.2 + 12 = 17.2
    assert algo.select(1, mask(4, [0, 1, 2]), None).tolist() == [False, True, True, False]
    assert torch.allclose(algo.rates, vec(0.75, 0.625, 0.875, 0.5))
    algo.open_round(1, ctx_for(1, 4, [0, 1, 2], [1, 2], [2]))
    algo.add(2, vec(35.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(17.2))
    assert algo.last_weights == pytest.approx({2: 12 / 35})


def test_f3ast_exact_rate_is_the_oracle_pi():
    # rate="exact" (the thesis): r = pi whatever happens. Available {0, 1, 3}: alpha^2/pi^2 = 0: 0.04, 1: 0.64,
    # 3: 0.16 -> top 2 = {1, 3}; q_1 = 0.2/0.25 = 0.8, q_3 = 0.4/1.0 = 0.4; deltas 1 and 2 -> w = 0.8 + 0.8 = 1.6
    algo = F3AST(k=2, beta=0.5, rate="exact", pi=PI4)
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [False, True, False, True]
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [1, 3], [1, 3]))
    algo.add(1, vec(1.0), ClientInfo(1, 1))
    algo.add(3, vec(2.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(1.6))
    for t, avail in enumerate([[2], [0, 1, 2, 3], []], start=1):
        algo.select(t, mask(4, avail), None)
        assert torch.allclose(algo.rates, torch.tensor(PI4, dtype=F64))
        algo.open_round(t, ctx_for(t, 4, avail, [], []))
        algo.close_round()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: F3AST(k=0), "k"),
        (lambda: F3AST(k=2, beta=1.5), "beta"),
        (lambda: F3AST(k=2, init_rate=[0.5, 0.0]), "init_rate"),
        (lambda: F3AST(k=2, rate="oracle"), "rate"),
        (lambda: F3AST(k=2, rate="code"), "pi"),
        (lambda: F3AST(k=2, rate="exact"), "pi"),
        (lambda: F3AST(k=2, rate="code", pi=[0.5, 0.0]), r"pi must lie in \(0, 1\]"),
        (lambda: F3AST(k=2, pi=[0.5, 0.5]), "pi is only used"),
        (lambda: F3AST(k=2, rate="code", pi=[0.5, 0.5], init_rate=0.5), "init_rate is only used"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_oracle_pi_length_is_checked_at_setup():
    with pytest.raises(ValueError, match="pi has 3 entries but num_clients is 4"):
        F3AST(k=2, rate="code", pi=[0.5, 0.5, 0.5]).setup(4, torch.zeros(1, dtype=F64))


@pytest.mark.parametrize(
    "factory",
    [lambda: F3AST(k=2, beta=0.2), lambda: F3AST(k=2, beta=0.2, rate="code", pi=[0.9, 0.8, 0.6, 0.5, 0.3])],
    ids=["ema", "code"],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)
