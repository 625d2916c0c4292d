"""FedVARP (FedStale paper Eq. 7; FedAU paper's code): hand-computed rounds, empty rounds, resume.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedStale, FedVARP
from tests.algorithms.rule_rounds import F64, check_resume, close, make_ctx, run_round, setup


def test_fedvarp_hand_computed_participating():
    # N=3, alpha=1/3, participating: w += (1/3) sum_j y_j + (1/|R|) sum_R (delta_i - y_i); then y_i <- delta_i
    algo = setup(FedVARP(), 3, [0.0, 0.0])
    # round 0: y = 0. fresh = (1/2)([3,0] + [0,3]) = [1.5, 1.5] -> w1 = [1.5, 1.5]; y0=[3,0], y1=[0,3]
    close(run_round(algo, 0, 3, {0: [3, 0], 1: [0, 3]}), [1.5, 1.5])
    assert algo.last_weights == pytest.approx({0: 0.5, 1: 0.5})
    # round 1: stale = (1/3)([3,0]+[0,3]+0) = [1,1]; fresh = ([6,0] - y1=[0,3]) / 1 = [6,-3]
    # step = [7,-2] -> w2 = [8.5, -0.5]; y1 <- [6,0]
    close(run_round(algo, 1, 3, {1: [6, 0]}), [8.5, -0.5])
    # round 2: stale = (1/3)([3,0]+[6,0]+0) = [3,0]; fresh = (1/2)(([0,3]-[3,0]) + ([3,3]-0)) = (1/2)[0,6] = [0,3]
    # step = [3,3] -> w3 = [11.5, 2.5]
    close(run_round(algo, 2, 3, {0: [0, 3], 2: [3, 3]}), [11.5, 2.5])
    assert algo.memory_bytes == 3 * 2 * 4


def test_fedvarp_empty_round():
    for empty, expected in (("skip", [1.5, 1.5]), ("stale", [2.5, 2.5])):
        algo = setup(FedVARP(empty_round=empty), 3, [0.0, 0.0])
        close(run_round(algo, 0, 3, {0: [3, 0], 1: [0, 3]}), [1.5, 1.5])
        # nobody arrives: "skip" keeps w; "stale" adds (1/3)(y0+y1+y2) = (1/3)[3,3] = [1,1]
        close(run_round(algo, 1, 3, {}), expected)
        assert algo.last_weights == {}


def _fedstale_paper(w0, p, rounds, beta, empty_round):
    """The FedStale paper's server update written out with plain tensors (uniform 1/N, N = len(p)).

    Eq. 7 (U-FedVARP, beta = 1): w += (1/N) sum_{i=1..N} h_i + (1/N) sum_{i in S} (Delta_i - h_i) / p_i
    Eq. 9 (FedStale):            w += beta (1/N) sum_i h_i + (1/N) sum_{i in S} (Delta_i - beta h_i) / p_i
    then h_i <- Delta_i for i in S (Algorithm 2, h_i = 0 initially). A round with S empty is skipped (both
    reference codes) or, with empty_round="stale", applies the stale term alone (Eq. 7/9 read literally).
    """
    n = len(p)
    h = [torch.zeros_like(w0) for _ in range(n)]
    w = w0.clone()
    out = []
    for deltas in rounds:
        if deltas or empty_round == "stale":
            if beta == 1.0:  # Eq. 7, written separately from Eq. 9
                step = sum(h) / n + sum((deltas[i] - h[i]) / p[i] for i in deltas) / n
            else:  # Eq. 9
                step = beta * sum(h) / n + sum((deltas[i] - beta * h[i]) / p[i] for i in deltas) / n
            w = w + step
        for i, delta in deltas.items():
            h[i] = delta.clone()
        out.append(w.clone())
    return out


@pytest.mark.parametrize("empty_round", ["skip", "stale"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_known_p_matches_a_transcription_of_the_fedstale_paper(beta, seed, empty_round):
    # Random participation: N = 5 clients with p_i in [0.2, 1], Bernoulli arrivals, d = 3, 10 rounds, round 4 empty.
    n, d, rounds = 5, 3, 10
    gen = torch.Generator().manual_seed(100 + seed)
    p = 0.2 + 0.8 * torch.rand(n, generator=gen, dtype=F64)
    w0 = torch.randn(d, generator=gen, dtype=F64)
    seq = []
    for t in range(rounds):
        arrived = (torch.rand(n, generator=gen, dtype=F64) < p).nonzero().flatten().tolist()
        seq.append({} if t == 4 else {i: torch.randn(d, generator=gen, dtype=F64) for i in arrived})
    expected = _fedstale_paper(w0, p.tolist(), seq, beta, empty_round)

    kwargs = dict(weighting="known_p", memory_dtype=F64, empty_round=empty_round)
    algo = FedVARP(**kwargs) if beta == 1.0 else FedStale(beta=beta, **kwargs)
    algo.setup(n, w0.clone())
    for t, deltas in enumerate(seq):
        algo.open_round(t, make_ctx(t, n, deltas.keys(), p=p))
        for i, delta in deltas.items():
            algo.add(i, delta.clone(), ClientInfo(1, 1))
        torch.testing.assert_close(algo.close_round(), expected[t], atol=1e-12, rtol=0)
    assert (expected[-1] - w0).abs().max() > 0.1  # the run moved, and not only by fresh updates
    assert sum(1 for deltas in seq if deltas) >= 5


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: FedVARP(), id="fedvarp"),
        pytest.param(lambda: FedVARP(weighting="known_p", memory_dtype=torch.bfloat16), id="fedvarp_known"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedVARP(weighting="samples"), "weighting"),
        (lambda: FedVARP(memory_dtype=torch.int32), "memory_dtype"),
        (lambda: FedVARP(empty_round="never"), "empty_round"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    with pytest.raises(ValueError, match="participation_probs"):
        setup(FedVARP(weighting="known_p"), 3, [0.0]).open_round(0, make_ctx(0, 3, [0], p=[0.5, 1.5, 1.0]))
    # the same client twice in a round, and a wrong shape
    varp = setup(FedVARP(), 2, [0.0, 0.0])
    varp.open_round(0, None)
    varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="already added"):
        varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="shape"):
        varp.add(1, torch.zeros(3, dtype=F64), ClientInfo(1, 1))
