"""Availability processes checked where the mutation run found them unchecked: Cyclic's round-by-round marginal
under ``offset="inactive"`` against a brute-force count, CA-Fed's classes with the released code's composition and
its clipping of ``lam``, recorded traces loaded from every file type, uniform sampling's mask, and the seeded
streams the recipes draw from."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.participation import (
    Bernoulli,
    CAFedClasses,
    Cyclic,
    Full,
    LabelCorrelated,
    Markov,
    Trace,
    TwoGroup,
    UniformSample,
)
from lightning_fedhet.seeding import STATIC_KEY, StaticKey, Stream
from tests.helpers import error_text


def _philox(*entropy: int) -> np.random.Generator:
    """The counter-based seeding the docs describe, written out: Philox keyed by (seed, stream, keys...)."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([int(e) for e in entropy])))


def _brute_force_marginal(active: int, inactive: int, t: int) -> float:
    """The definition: the first active round u is uniform on {0, ..., inactive - 1}; the client is on in round t
    iff (t - u) mod (active + inactive) < active."""
    cycle = active + inactive
    return sum((t - u) % cycle < active for u in range(inactive)) / inactive


@pytest.mark.parametrize(("period", "p"), [(5, 0.2), (5, 0.6), (7, 0.5), (10, 0.8), (4, 0.0), (4, 1.0), (1, 0.5)])
def test_cyclic_inactive_offset_marginal_equals_a_brute_force_count(period: int, p: float):
    cyclic = Cyclic(period, p, offset="inactive")
    cyclic.setup(3, seed=0)
    active, inactive = int(cyclic.active[0]), int(cyclic.inactive[0])
    for t in range(3 * (active + inactive) + 1):
        got = cyclic.marginal_probs(t)
        assert got.dtype == torch.float64
        assert got.tolist() == [pytest.approx(_brute_force_marginal(active, inactive, t), abs=1e-15)] * 3, t
    # over one cycle the marginal averages to the long-run frequency p = active / cycle
    cycle = active + inactive
    mean = sum(cyclic.marginal_probs(t)[0].item() for t in range(cycle)) / cycle
    assert mean == pytest.approx(active / cycle, abs=1e-12)


def test_cyclic_marginal_by_hand_with_a_wrapping_window():
    # period 5, p = 0.4: active 2, inactive 3, cycle 5; u in {0, 1, 2}; on iff (t - u) mod 5 in {0, 1}
    cyclic = Cyclic(5, 0.4, offset="inactive")
    cyclic.setup(1, seed=0)
    # t=0: x = 0, 4, 3 -> 1 on; t=1: 1, 0, 4 -> 2; t=2: 2, 1, 0 -> 2; t=3: 3, 2, 1 -> 1; t=4: 4, 3, 2 -> 0
    assert [cyclic.marginal_probs(t).item() for t in range(6)] == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1 / 3, 0, 1 / 3])
    assert repr(cyclic) == "Cyclic(period=5, p=0.4, offset='inactive')"


def test_cafed_classes_code_composition_and_clipping_by_hand():
    n, seed = 8, 3
    # shuffle=False: clients 0-3 more available, 4-7 less; thesis classes 0,0,1,1,2,2,3,3; code 1,1,1,1,2,2,3,3
    thesis = CAFedClasses(g=0.2, nu=0.5, eps=0.05, composition="thesis", shuffle=False)
    code = CAFedClasses(g=0.2, nu=0.5, eps=0.05, composition="code", shuffle=False)
    assert thesis.classes(n, seed).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert code.classes(n, seed).tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    pi_t, lam_t = thesis.resolve(n, seed)
    pi_c, lam_c = code.resolve(n, seed)
    assert pi_t.tolist() == pi_c.tolist() == pytest.approx([0.7] * 4 + [0.3] * 4)
    assert lam_t[[0, 1, 4, 5]].tolist() == lam_c[[4, 5]].tolist() * 2 == [0.5] * 4  # correlated: nu
    weak = [2, 3, 6, 7]
    # the weak clients draw eps * z, the same z in both compositions; thesis: lam = eps z, code: (eps z + eps) / 2
    # (no clipping: the feasible range is [1 - 1/0.7, 1) = [-0.43, 1))
    np.testing.assert_allclose(lam_c[weak], 0.5 * (lam_t[weak] + 0.05), rtol=0, atol=1e-15)
    assert np.all(np.abs(lam_t[weak]) < 0.25) and len(set(lam_t[weak].tolist())) == 4


def test_cafed_classes_clip_lam_to_the_feasible_range():
    # pi = 0.9 or 0.1: lam must lie in [max(1 - 1/pi, 1 - 1/(1 - pi)), 1) = [-1/9, 1)
    low = 1.0 - 1.0 / 0.9
    pi, lam = CAFedClasses(g=0.4, nu=-0.9, eps=0.01, shuffle=False).resolve(8, 0)
    assert lam[[0, 1, 4, 5]] == pytest.approx([low] * 4, abs=1e-15)  # nu = -0.9 clipped up
    _, lam = CAFedClasses(g=0.4, nu=0.5, eps=50.0, shuffle=False).resolve(400, 0)
    weak = np.r_[100:200, 300:400]
    top = np.nextafter(1.0, 0.0)
    assert lam.max() == top and lam.min() == pytest.approx(low, abs=1e-15)  # huge noise: both ends reached
    assert np.all((lam[weak] == top) | (lam[weak] == pytest.approx(low, abs=1e-15)) | (np.abs(lam[weak]) < 1))


def test_cafed_classes_arguments():
    assert CAFedClasses().shuffle is True and CAFedClasses(eps=0.0).eps == 0.0
    with pytest.raises(ValueError, match=r"^eps must be"):
        CAFedClasses(eps=float("inf"))
    with pytest.raises((TypeError, ValueError), match=r"^shuffle must be"):
        CAFedClasses(shuffle="yes")


def test_trace_files_of_every_type(tmp_path):
    mask = np.array([[1, 0, 1], [0, 0, 1]])
    np.save(tmp_path / "t.npy", mask)
    np.savez(tmp_path / "one.npz", anything=mask)
    np.savez(tmp_path / "named.npz", other=np.ones((2, 3)), mask=mask)
    np.savez(tmp_path / "two.npz", a=mask, b=mask)
    np.savetxt(tmp_path / "t.csv", mask, delimiter=",", fmt="%d")
    np.savetxt(tmp_path / "row.csv", mask[:1], delimiter=",", fmt="%d")  # one round: still [T, N] = [1, 3]
    for name in ("t.npy", "one.npz", "named.npz", "t.csv"):
        trace = Trace(tmp_path / name)
        assert trace.mask.dtype == bool and trace.mask.tolist() == mask.astype(bool).tolist(), name
        assert repr(trace) == f"Trace(mask={str(tmp_path / name)!r}, shape=(2, 3))"
    assert Trace(tmp_path / "row.csv").mask.shape == (1, 3)
    two = str(tmp_path / "two.npz")
    assert error_text(lambda: Trace(two)) == (
        f"mask: {two!r} holds arrays ['a', 'b']; name the trace 'mask' or store only one array")
    (tmp_path / "t.txt").write_text("1,0\n")
    path = str(tmp_path / "t.txt")
    assert error_text(lambda: Trace(path)) == f"mask: unsupported file type '.txt' for {path!r}; use .npy, .npz or .csv"
    np.save(tmp_path / "objects.npy", np.array([[1, None]], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):  # never unpickles a file
        Trace(tmp_path / "objects.npy")


def test_trace_from_arrays_and_tensors():
    trace = Trace(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], requires_grad=True))
    assert trace.mask.tolist() == [[True, False], [True, True], [False, False]]
    assert repr(trace) == "Trace(mask=<array>, shape=(3, 2))"
    trace.setup(2)
    assert trace.p.dtype == torch.float64 and trace.p.tolist() == pytest.approx([2 / 3, 1 / 3])
    assert Trace([[1]]).mask.tolist() == [[True]]  # one round, one client
    for bad in ([[]], np.zeros((0, 2)), np.zeros((2, 0)), [1, 0]):
        with pytest.raises(ValueError, match=r"^mask must have shape \[T, N\]"):
            Trace(bad)
    with pytest.raises(ValueError, match=r"^mask must hold only 0/1"):
        Trace([[0, 2]])
    with pytest.raises(ValueError, match=r"^mask must be a \[T, N\] array of 0/1 values, got list"):
        Trace([[1], [1, 0]])  # ragged


def test_uniform_sample_chooses_exactly_k_as_a_bool_mask():
    sample = UniformSample(2)
    sample.setup(5, seed=0)
    assert sample.p.tolist() == pytest.approx([0.4] * 5)
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = sample.choose(np.array([1, 1, 0, 1, 1]), rng)
        assert mask.dtype == bool and mask.sum() == 2 and not mask[2]
    assert sample.choose(np.array([0, 1, 0, 0, 1]), rng).tolist() == [False, True, False, False, True]
    assert sample.choose(np.array([0, 0, 0, 1, 0]), rng).tolist() == [False, False, False, True, False]
    drawn = sample.sample(3)
    assert drawn.dtype == torch.bool and int(drawn.sum()) == 2


def _documented_stream(seed: int, key: int) -> np.random.Generator:
    """A recipe's static draws: the participation stream's ``STATIC_KEY`` draws for ``key``."""
    return _philox(seed, Stream.PARTICIPATION, STATIC_KEY, key)


def test_recipes_draw_from_their_own_documented_streams():
    # a recipe that drew from another stream would change every published result for the same seed
    low = TwoGroup(0.1).low_group(10, seed=5)
    assert low.dtype == bool
    assert np.flatnonzero(low).tolist() == sorted(_documented_stream(5, StaticKey.TWO_GROUP).permutation(10)[:5])
    classes = CAFedClasses(shuffle=True).classes(8, seed=5)
    unshuffled = CAFedClasses(shuffle=False).classes(8, seed=5)
    assert classes.tolist() == unshuffled[_documented_stream(5, StaticKey.CAFED_CLASSES).permutation(8)].tolist()
    _, lam = CAFedClasses(g=0.2, eps=0.1, shuffle=False).resolve(8, seed=5)
    noise = _documented_stream(5, StaticKey.CAFED_LAMBDA).normal(0.0, 0.1, 8)
    assert lam[[2, 3, 6, 7]].tolist() == noise[[2, 3, 6, 7]].tolist()  # the weakly correlated clients


def test_two_group_arguments_and_contiguous_groups():
    assert TwoGroup(0.1).shuffle is True
    assert TwoGroup(0.1, p_max=0.5, shuffle=False).resolve(4, 0).tolist() == [0.5, 0.5, 0.1, 0.1]
    assert TwoGroup(0.1, p_max=0.0).p_max == 0.0
    with pytest.raises(ValueError, match=r"^p_max must lie in \[0, 1\], got 1.5$"):
        TwoGroup(0.1, p_max=1.5)


def test_label_correlated_by_hand_and_its_input_errors():
    recipe = LabelCorrelated(mean=0.2, floor=0.0, alpha=1.0)
    hist = np.array([[3, 1], [0, 2], [1, 1]])
    q = _documented_stream(4, StaticKey.LABEL_CORRELATED).dirichlet([1.0, 1.0])
    # p_n = C * mean * <kappa_n, q>, kappa_n the histogram normalised; one sample is enough for a client
    expected = 2 * 0.2 * (np.array([[0.75, 0.25], [0.0, 1.0], [0.5, 0.5]]) @ q)
    np.testing.assert_allclose(recipe.probabilities(hist, 4), expected, rtol=1e-15)
    np.testing.assert_allclose(recipe.probabilities(torch.tensor(hist), 4), expected, rtol=1e-15)
    np.testing.assert_allclose(recipe.probabilities([[1, 0], [0, 1], [1, 0]], 4), 0.4 * np.array([q[0], q[1], q[0]]))

    def message(bad) -> str:
        return error_text(lambda: recipe.probabilities(bad, 0))

    assert message("counts") == "label_hist must be a [num_clients, num_classes] array of label counts, got str"
    assert message(np.array([[1 + 1j, 1]])) == (
        "label_hist must be a [num_clients, num_classes] array of label counts, got ndarray")
    for bad in (np.ones(3), np.ones((0, 2)), np.ones((2, 0)), np.ones((1, 2, 2))):
        assert message(bad) == f"label_hist must have shape [num_clients, num_classes], got {bad.shape}"
    assert recipe.probabilities(np.ones((1, 1)), 0).shape == (1,)  # one client, one class
    assert message([[1.0, -1.0], [1.0, 1.0]]) == "label_hist must hold finite non-negative counts"
    assert message([[1.0, np.nan]]) == "label_hist must hold finite non-negative counts"
    assert message(np.array([[0, 0]] * 7 + [[1, 0]])) == (
        "label_hist: every client needs at least one sample, clients [0, 1, 2, 3, 4] have none")
    assert error_text(lambda: recipe.resolve(3, 0)) == (
        "LabelCorrelated needs label_hist=[num_clients, num_classes] at the process's setup()")


def test_fedau_transitions_by_hand():
    # a = max_on, b = a (1/p - 1); where b > 1: a <- a / b, b <- 1 (the docstring's example: p = 0.02)
    a, b = Markov.fedau_transitions([0.5, 0.02, 0.0, 1.0])
    assert a.dtype == b.dtype == np.float64
    np.testing.assert_allclose(a, [0.05, 0.05 / 2.45, 0.0, 0.05], rtol=1e-12)
    np.testing.assert_allclose(b, [0.05, 1.0, 1.0, 0.0], rtol=1e-12)
    a, b = Markov.fedau_transitions(0.25, max_on=0.2)
    assert (float(a), float(b)) == pytest.approx((0.2, 0.6))
    with pytest.raises(ValueError, match=r"^max_on "):
        Markov.fedau_transitions(0.5, max_on=0.0)  # P(off->on) = 0 would never switch on
    with pytest.raises(ValueError, match=r"^p "):
        Markov.fedau_transitions(1.5)


def test_markov_lam_pairs_at_the_edge_of_feasibility():
    # P(off->on) = p (1 - lam) may be exactly 1: p = 0.8, lam = -0.25 gives a = 1, b = 0.25 (an off round is always
    # followed by an on round)
    markov = Markov(p=0.8, lam=-0.25)
    markov.setup(3, seed=0)
    states = np.stack([markov.sample(t).numpy() for t in range(200)])
    off_then = states[1:][~states[:-1]]
    assert off_then.size > 0 and off_then.all()
    # the feasible lam for p: [max(1 - 1/p, 1 - 1/(1 - p)), 1), a side dropped where p is 0 or 1
    for p, lam, low in [(0.8, -0.5, "-0.25"), (0.3, -0.9, "-0.428571"), (0.0, -0.5, "0"), (1.0, -0.5, "0")]:
        assert error_text(lambda p=p, lam=lam: Markov(p=p, lam=lam).setup(2, seed=0)) == (
            f"Markov(p, lam): infeasible pair p={p:g}, lam={lam:g}; P(off->on) = p(1-lam) and P(on->off) = "
            f"(1-p)(1-lam) must lie in [0, 1], so for this p lam must lie in [{low}, 1)")


def test_reprs_name_every_argument():
    assert repr(Markov(p=0.3, lam=0.5)) == "Markov(p=0.3, lam=0.5)"
    assert repr(Markov(p_on=0.1, p_off=0.2)) == "Markov(p_on=0.1, p_off=0.2)"
    assert repr(Markov(p=0.3, max_on=0.05)) == "Markov(p=0.3, max_on=0.05)"
    assert repr(Markov(p=CAFedClasses(shuffle=False))) == (
        "Markov(p=CAFedClasses(g=0.4, nu=0.9, eps=0.01, composition='thesis', shuffle=False))")
    assert repr(Bernoulli(0.25)) == "Bernoulli(p=0.25)"
    assert repr(Bernoulli([0.1, 0.2])) == "Bernoulli(p=<2 per-client values>)"
    assert repr(Full()) == "Full()"
    full = Full()
    full.setup(3)
    assert full.sample(0).dtype == torch.bool and full.sample(0).tolist() == [True] * 3


def test_per_client_arguments_name_themselves_when_their_length_is_wrong():
    def wrong(name: str) -> str:
        return f"{name} has 2 entries but num_clients is 3; give a scalar or exactly one value per client"

    assert error_text(lambda: Markov(p_on=[0.1, 0.2], p_off=0.1).setup(3)) == wrong("p_on")
    assert error_text(lambda: Markov(p_on=0.1, p_off=[0.1, 0.2]).setup(3)) == wrong("p_off")
    assert error_text(lambda: Markov(p=0.5, max_on=[0.1, 0.2]).setup(3)) == wrong("max_on")
    assert error_text(lambda: Markov(p=[0.5, 0.5], lam=0.1).setup(3)) == wrong("p")
    assert error_text(lambda: Cyclic(5, [0.5, 0.5]).setup(3)) == wrong("p")
    assert error_text(lambda: Bernoulli([0.1, 0.2]).setup(3)) == wrong("p")
    assert error_text(lambda: Markov()) == (
        "Markov takes exactly one of (p=, lam=), (p_on=, p_off=) or (p=, max_on=); got nothing")
    assert error_text(lambda: Markov(p=0.5)) == (
        "Markov takes exactly one of (p=, lam=), (p_on=, p_off=) or (p=, max_on=); got ['p']")
    assert error_text(lambda: Cyclic(5, CAFedClasses(shuffle=False))) == (
        "p=CAFedClasses(g=0.4, nu=0.9, eps=0.01, composition='thesis', shuffle=False) also fixes Markov "
        "correlations (lam); use Markov(p=...) with it")


def test_cyclic_reads_a_label_correlated_recipe_and_draws_its_phases_from_the_documented_stream():
    hist = np.array([[1, 2], [3, 1]])
    recipe = LabelCorrelated(mean=0.3, floor=0.0)
    cyclic = Cyclic(5, recipe)
    cyclic.setup(2, seed=7, label_hist=hist)
    active, inactive = Cyclic.block_lengths(5, recipe.probabilities(hist, 7))
    assert cyclic.active.tolist() == active.tolist() and cyclic.inactive.tolist() == inactive.tolist()
    assert active.dtype == inactive.dtype == np.int64
    # offset="uniform": the phase of client i is uniform on {0, ..., cycle_i - 1}, drawn once from its stream
    many = Cyclic(2, 0.5)
    many.setup(400, seed=3)
    expected = _documented_stream(3, StaticKey.CYCLIC_OFFSET).integers(0, np.full(400, 2))
    assert many.phase.tolist() == expected.tolist() and set(many.phase.tolist()) == {0, 1}


def test_each_rounds_draws_come_from_the_participation_stream_of_that_round():
    bernoulli = Bernoulli(0.5)
    bernoulli.setup(6, seed=9)
    for t in (0, 1, 5):
        uniforms = _philox(9, Stream.PARTICIPATION, t)
        assert bernoulli.sample(t).tolist() == (uniforms.random(6) < 0.5).tolist()


def test_edges_the_second_participation_run_left():
    # FedAU's transitions for p = 0 divide by zero on purpose: no numpy warning reaches the user
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = Markov.fedau_transitions([0.0, 0.5])
    assert a.tolist() == [0.0, 0.05] and b.tolist() == [1.0, 0.05]
    # lam = 0 with p = 0 is feasible: P(on->off) = (1 - p)(1 - lam) = 1 exactly; the client is never on
    markov = Markov(p=[0.0, 0.5], lam=0.0)
    markov.setup(2, seed=0)
    assert not any(bool(markov.sample(t)[0]) for t in range(50))
    # a probability above 1 (here 1.8 * q_0 with q_0 about 0.68) is clipped to 1, said once with the count
    recipe = LabelCorrelated(mean=0.9, floor=0.0, alpha=1.0)
    with pytest.warns(UserWarning) as caught:
        p = recipe.probabilities(np.array([[5, 0], [0, 5], [1, 1]]), 0)
    assert [str(w.message) for w in caught] == ["LabelCorrelated: clipped 1 participation probabilities above 1 to 1"]
    assert p[0] == 1.0 and 0 < p[1] < 1 and p[2] == pytest.approx(0.9)
    # a floor of 1 lifts every probability to exactly 1: nothing lies above 1, so nothing is clipped or said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lifted = LabelCorrelated(mean=0.1, floor=1.0).probabilities(np.array([[5, 0], [0, 5], [1, 1]]), 0)
    assert lifted.tolist() == [1.0, 1.0, 1.0]
    assert error_text(lambda: recipe.probabilities(np.array([[1, 0], [0, 0]]), 0)) == (
        "label_hist: every client needs at least one sample, clients [1] have none")
    assert error_text(lambda: TwoGroup(0.1, low_fraction=1.5)) == "low_fraction must lie in [0, 1], got 1.5"
    paper = LabelCorrelated()  # FedAU's App. C.6: mean 0.1, floor 0.02, alpha 0.1
    assert (paper.mean, paper.floor, paper.alpha) == (0.1, 0.02, 0.1)
    every = UniformSample(5)
    every.setup(5)  # k = N: everybody, every round
    assert every.sample(0).tolist() == [True] * 5
    with pytest.raises(RuntimeError) as err:
        Bernoulli(0.5).sample(0)
    assert str(err.value) == "Bernoulli.setup(num_clients, seed) must be called first"
