"""Property: any argument to a participation process (or a recipe) builds a working process or raises
ValueError/TypeError naming the parameter; the same for ``setup(num_clients, seed)``, where lengths are checked.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

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
from tests.property_inputs import PROPERTY, arg, build, counts, ints, junk, probs, seeds


def check_process(proc, num_clients, seed, *params: str, **setup_kwargs) -> None:
    """``proc.setup(num_clients, seed)`` succeeds and gives valid draws, or raises naming a parameter."""
    if proc is None:
        return
    repr(proc)
    done = build(lambda: proc.setup(num_clients, seed, **setup_kwargs) or True, "num_clients", "seed", *params)
    if done is None:
        return
    n = proc.num_clients
    assert n >= 1
    masks = {}
    for t in (0, 1, 7):
        mask = proc.sample(t)
        assert mask.dtype == torch.bool and mask.shape == (n,)
        masks[t] = mask
    # a pure function of (seed, round): drawn again, and in another order, every round's mask is the same
    for t in (7, 0, 1):
        assert torch.equal(proc.sample(t), masks[t]), t
    p = proc.p
    assert p.dtype == torch.float64 and p.shape == (n,)
    assert bool(((p >= 0) & (p <= 1)).all()), p
    for t in (0, 7):
        marginal = proc.marginal_probs(t)
        assert marginal.dtype == torch.float64 and marginal.shape == (n,)
        assert bool(((marginal >= 0) & (marginal <= 1)).all()), marginal
        # a client that is never (always) available has marginal 0 (1) in every round
        assert not bool((masks[t] & (marginal == 0)).any()) and bool((masks[t] | (marginal < 1)).all())


@PROPERTY
@given(num_clients=counts, seed=seeds)
def test_full(num_clients, seed):
    check_process(Full(), num_clients, seed)


@PROPERTY
@given(k=arg(ints(1, 12)), num_clients=counts, seed=seeds)
def test_uniform_sample(k, num_clients, seed):
    proc = build(lambda: UniformSample(k), "k")
    check_process(proc, num_clients, seed, "k")


@PROPERTY
@given(p=arg(probs()), num_clients=counts, seed=seeds)
def test_bernoulli(p, num_clients, seed):
    proc = build(lambda: Bernoulli(p), "p")
    check_process(proc, num_clients, seed, "p")


@PROPERTY
@given(p=arg(probs()), lam=arg(probs(-0.99, 0.99)), block=arg(ints(1, 8)), num_clients=counts, seed=seeds)
def test_markov_lam(p, lam, block, num_clients, seed):
    proc = build(lambda: Markov(p=p, lam=lam, block=block), "p", "lam", "block")
    check_process(proc, num_clients, seed, "p", "lam")


@PROPERTY
@given(p_on=arg(probs()), p_off=arg(probs()), block=arg(ints(1, 8)), num_clients=counts, seed=seeds)
def test_markov_transition(p_on, p_off, block, num_clients, seed):
    proc = build(lambda: Markov(p_on=p_on, p_off=p_off, block=block), "p_on", "p_off", "block")
    check_process(proc, num_clients, seed, "p_on", "p_off")


@PROPERTY
@given(p=arg(probs()), max_on=arg(probs()), num_clients=counts, seed=seeds)
def test_markov_max_on(p, max_on, num_clients, seed):
    proc = build(lambda: Markov(p=p, max_on=max_on), "p", "max_on")
    check_process(proc, num_clients, seed, "p", "max_on")


@PROPERTY
@given(
    kwargs=st.dictionaries(st.sampled_from(["p", "lam", "p_on", "p_off", "max_on"]), arg(probs()), max_size=5),
)
def test_markov_forms(kwargs):
    """Any combination of the keyword arguments: one of the three forms, or an error naming the arguments."""
    proc = build(lambda: Markov(**kwargs), "Markov", "p", "lam", "p_on", "p_off", "max_on")
    check_process(proc, 3, 0, "p", "lam", "p_on", "p_off", "max_on")


@PROPERTY
@given(period=arg(ints(1, 200)), p=arg(probs()), offset=arg(st.sampled_from(["uniform", "inactive"])),
       num_clients=counts, seed=seeds)
def test_cyclic(period, p, offset, num_clients, seed):
    proc = build(lambda: Cyclic(period, p, offset), "period", "p", "offset")
    check_process(proc, num_clients, seed, "p")


masks = st.one_of(
    st.integers(1, 5).flatmap(lambda n: st.lists(st.lists(st.sampled_from([0, 1, True, False]), min_size=n,
                                                             max_size=n), min_size=1, max_size=4)),
    st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(st.integers(0, 1), min_size=n, max_size=n), min_size=1,
                                                 max_size=4)).map(np.array),
    st.sampled_from(["missing.npy", "trace.txt", "", "."]),
)


@PROPERTY
@given(mask=arg(masks), num_clients=counts, seed=seeds)
def test_trace(mask, num_clients, seed):
    proc = build(lambda: Trace(mask), "mask")
    check_process(proc, num_clients, seed, "mask")


label_hists = st.one_of(
    st.integers(1, 5).flatmap(
        lambda n: st.lists(st.lists(st.integers(0, 9), min_size=n, max_size=n), min_size=1, max_size=6)
    ).map(np.array),
    junk,
)


@PROPERTY
@given(mean=arg(probs(0.01, 1.0, 1)), floor=arg(probs(0.0, 1.0, 1)), alpha=arg(st.floats(1e-3, 100)),
       label_hist=label_hists, num_clients=counts, seed=seeds)
def test_label_correlated(mean, floor, alpha, label_hist, num_clients, seed):
    recipe = build(lambda: LabelCorrelated(mean, floor, alpha), "mean", "floor", "alpha")
    if recipe is None:
        return
    repr(recipe)
    proc = Bernoulli(recipe)
    assert proc.needs_label_hist
    check_process(proc, num_clients, seed, "label_hist", "p", label_hist=label_hist)


@PROPERTY
@given(p_min=arg(probs(max_len=1)), p_max=arg(probs(max_len=1)), low_fraction=arg(probs(max_len=1)),
       shuffle=arg(st.booleans()), num_clients=counts, seed=seeds)
def test_two_group(p_min, p_max, low_fraction, shuffle, num_clients, seed):
    recipe = build(lambda: TwoGroup(p_min, p_max, low_fraction, shuffle), "p_min", "p_max", "low_fraction", "shuffle")
    if recipe is None:
        return
    repr(recipe)
    check_process(Bernoulli(recipe), num_clients, seed, "p")
    check_process(Markov(p=recipe, lam=0.5), num_clients, seed, "p", "lam")


@PROPERTY
@given(g=arg(st.floats(0.01, 0.49)), nu=arg(st.floats(-0.99, 0.99)), eps=arg(st.floats(0, 1)),
       composition=arg(st.sampled_from(["thesis", "code"])), shuffle=arg(st.booleans()), num_clients=counts,
       seed=seeds)
def test_cafed_classes(g, nu, eps, composition, shuffle, num_clients, seed):
    recipe = build(lambda: CAFedClasses(g, nu, eps, composition, shuffle), "g", "nu", "eps", "composition", "shuffle")
    if recipe is None:
        return
    repr(recipe)
    proc = Markov(p=recipe)
    check_process(proc, num_clients, seed, "p", "lam")
    if proc.num_clients:
        lam = proc.lam
        assert bool(((lam > -1) & (lam < 1)).all())
