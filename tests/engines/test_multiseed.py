"""Many seeds in one run: each seed of ``fit_seeds`` equals its own single-seed ``Trainer.fit``, or it is refused.

The reference of seed ``s`` is the ordinary run: ``seed_everything(s)``, build the module, datamodule and
``FedHetStrategy(seed=s)`` and fit them with the sequential engine. Every contract case (each rule, with Bernoulli or
Markov availability, a lossy uplink and unequal local steps) runs two seeds stacked; the BatchNorm case three.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAvg, FedCIS, FedVARP
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.early_exit_module import EarlyExitClassifier
from lightning_fedhet.engines.vmap import VmapUnsupported
from lightning_fedhet.multiseed import fit_seeds
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, UniformSteps
from tests.engines.test_contract import CASES, _settings
from tests.engines.test_vmap_pieces import LogsEachReduction
from tests.helpers import TinyClassifier, assert_same_rounds, quiet_trainer, toy_dataset

ROUNDS = 4


class _RandomInit(TinyClassifier):
    """TinyClassifier initialised from the global RNG (so each seed starts from its own model), optional BatchNorm."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__(momentum=0.5)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn_like(self.linear.weight) * 0.3)
        self.norm = torch.nn.BatchNorm1d(5, momentum=0.3) if batchnorm else torch.nn.Identity()

    def forward(self, x):
        return self.linear(self.norm(x))


_DATA = toy_dataset(96)
_VAL = toy_dataset(32, seed=9)


def _six_clients(data=_DATA, kind: type[FederatedDataModule] = FederatedDataModule, **kwargs) -> FederatedDataModule:
    """``data``'s 96 samples split into six clients of 16 in order, batches of 4 (a ``kind`` of datamodule)."""
    return kind(data, [np.arange(i * 16, (i + 1) * 16) for i in range(6)], batch_size=4, **kwargs)


def _tiny_build(case: str, batchnorm: bool = False, shared_data: bool = True, **engine_kwargs):
    factory, spec = CASES[case]

    def build(seed: int):
        model = _RandomInit(batchnorm)
        data = _DATA if shared_data else toy_dataset(96)  # a dataset object of its own per seed (same values)
        dm = _six_clients(data, val_dataset=_VAL)
        return model, dm, FedHetStrategy(algorithm=factory(), seed=seed, **_settings(spec), **engine_kwargs)

    return build


def _fedcis_build(**engine_kwargs):
    topology = CISTopology.preset("7-node", "80-15-5")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(7 * 8, 3, 8, 8, generator=gen), torch.randint(0, 10, (7 * 8,), generator=gen)
    data = TensorDataset(x, y)

    def build(seed: int):
        net = early_exit_resnet18(num_classes=10, exits=(3, 9), in_channels=3, base_width=4, norm="batch")
        model = EarlyExitClassifier(model=net, num_classes=10, lr=0.05, momentum=0.9, weight_decay=0.0)
        dm = FederatedDataModule(data, [np.arange(i * 8, (i + 1) * 8) for i in range(7)], batch_size=4)
        return model, dm, FedHetStrategy(algorithm=FedCIS(topology, p=0.3), local_steps=2, seed=seed, **engine_kwargs)

    return build


def _single(build, seed: int, rounds: int = ROUNDS) -> FedHetStrategy:
    """The ordinary run of one seed with the sequential engine (named here: the builds leave the engine to the
    default, ``"auto"``, which would pick vmap for these models)."""
    seed_everything(seed, workers=False, verbose=False)
    model, dm, strategy = build(seed)
    strategy = FedHetStrategy(spec=dataclasses.replace(strategy.spec, engine="sequential", compile=False))
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(model, datamodule=dm)
    return strategy


def _assert_equal_runs(single: FedHetStrategy, run) -> None:
    torch.testing.assert_close(run.global_params, single.global_params, rtol=1e-5, atol=1e-5)
    assert torch.equal(run.server.global_ints, single.server.global_ints)
    assert_same_rounds(single.history, run.history)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_stacked_seed_equals_its_single_run(case: str):
    # two federations in one vmap cohort per round; a slip that mixed their rows (a client trained from the other
    # seed's global model, an update sent to the other seed's server, shared rule state) changes both results
    early_exit = CASES[case] == "early-exit"
    # The early-exit ResNet (BatchNorm over batches of 4, momentum 0.9) amplifies float32 rounding: the grouped
    # convolutions of a stacked cohort and the dense ones of a single run sum in different orders, and one seed's
    # runs drifted apart by 2e-4 in 4 rounds (6e-8 in float64). Run it in float64, where 1e-5 tests the logic only.
    dtype = torch.get_default_dtype()
    if early_exit:
        torch.set_default_dtype(torch.float64)
    try:
        build = _fedcis_build() if early_exit else _tiny_build(case)
        seeds = [3, 11]
        runs = fit_seeds(build, seeds, ROUNDS)
        singles = [_single(build, seed) for seed in seeds]
    finally:
        torch.set_default_dtype(dtype)
    for single, run in zip(singles, runs):
        assert run.seed == single.seed
        _assert_equal_runs(single, run)
    assert not torch.allclose(runs[0].global_params, runs[1].global_params)  # the seeds really differ


def test_three_seeds_with_batchnorm_and_separate_datasets_equal_their_single_runs():
    # BatchNorm statistics and num_batches_tracked per seed and client; each seed's datamodule has its own dataset
    # object, so each federation's batches are gathered from its own dataset and concatenated. Validating each
    # seed's global model every 2 rounds with an ordinary Trainer (BatchNorm in eval mode there) changes nothing.
    build = _tiny_build("FedVARP", batchnorm=True, shared_data=False)
    seeds = [0, 1, 2]
    datamodule = build(0)[1]

    def evaluate(module, seed, round):
        return quiet_trainer().validate(module, datamodule=datamodule, verbose=False)[0]

    runs = fit_seeds(build, seeds, 5, eval_every=2, evaluate=evaluate)
    for seed, run in zip(seeds, runs):
        single = _single(build, seed, rounds=5)
        _assert_equal_runs(single, run)
        assert [r for r, _ in run.evals] == [2, 4, 5]
        final = quiet_trainer().validate(single.lightning_module, datamodule=datamodule, verbose=False)[0]
        assert run.evals[-1][1]["val_loss"] == pytest.approx(final["val_loss"], abs=1e-5)
        assert int(run.server.global_ints.max()) > 0
        torch.testing.assert_close(  # the module holds the seed's final global model
            torch.cat([t.detach().flatten() for t in run.flat.tensors]), run.global_params
        )


def test_metrics_and_evaluations_per_seed():
    build = _tiny_build("FedAvg-participating")
    calls = []

    def evaluate(module, seed, round):
        calls.append((seed, round))
        weight = module.linear.weight.detach().clone()
        return {"weight_norm": float(weight.norm())}

    runs = fit_seeds(build, [4, 5], 5, eval_every=2, evaluate=evaluate)
    assert calls == [(4, 2), (5, 2), (4, 4), (5, 4), (4, 5), (5, 5)]  # every 2 rounds and after the last
    for run in runs:
        assert [m["round"] for m in run.metrics] == list(range(5))
        assert [r for r, _ in run.evals] == [2, 4, 5]
        # the last evaluation saw the final global model
        assert run.evals[-1][1]["weight_norm"] == pytest.approx(float(run.module.linear.weight.detach().norm()))
        for metrics, record in zip(run.metrics, run.history):
            assert metrics["round/received"] == len(record["received"])
            assert np.isfinite(metrics["train_loss"]) == bool(record["local_steps"])


def test_refusals_name_the_cause():
    def build_bad_seed(seed):
        return _RandomInit(), FederatedDataModule(_DATA, [np.arange(96)], batch_size=4), FedHetStrategy(seed=0)

    with pytest.raises(ValueError, match=r"seed=0\).*pass seed=1"):
        fit_seeds(build_bad_seed, [1], 1)
    with pytest.raises(ValueError, match="distinct"):
        fit_seeds(_tiny_build("FedAvg-participating"), [1, 1], 1)
    with pytest.raises(ValueError, match="rounds"):
        fit_seeds(_tiny_build("FedAvg-participating"), [1], 0)

    class Scheduled(_RandomInit):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def build_scheduled(seed):
        dm = FederatedDataModule(_DATA, [np.arange(96)], batch_size=4)
        return Scheduled(), dm, FedHetStrategy(seed=seed)

    with pytest.raises(VmapUnsupported, match=r"interval='step'.*one at a time"):
        fit_seeds(build_scheduled, [0, 1], 1)

    class Adam(_RandomInit):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    def build_persist(seed):
        dm = FederatedDataModule(_DATA, [np.arange(96)], batch_size=4)
        return Adam(), dm, FedHetStrategy(seed=seed, optimizer_state="persist")

    with pytest.raises(VmapUnsupported, match="persist' with Adam.*engine='sequential'"):
        fit_seeds(build_persist, [0, 1], 1)



def _with_optimizers(configure):
    """A build whose module's ``configure_optimizers`` returns ``configure(module)``."""

    class Configured(_RandomInit):
        def configure_optimizers(self):
            return configure(self)

    def build(seed):
        return Configured(), _six_clients(), FedHetStrategy(participation=Bernoulli(0.7), local_steps=2, seed=seed)

    return build


def _sgd(module, lr=0.2):
    return torch.optim.SGD(module.parameters(), lr=lr)


def _halving(module):
    optimizer = _sgd(module)
    return optimizer, torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)


# Lightning's return forms of configure_optimizers; the schedulers halve the learning rate at the end of every
# `frequency`-th round (Lightning's default interval is "epoch", one round here)
_RETURN_FORMS = {
    "optimizer": lambda m: _sgd(m),
    "list of one optimizer": lambda m: [_sgd(m)],
    "tuple of one optimizer": lambda m: (_sgd(m),),
    "dict without a scheduler": lambda m: {"optimizer": _sgd(m)},
    "dict, scheduler every 2nd round": lambda m: (lambda o, s: {
        "optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "epoch", "frequency": 2}})(*_halving(m)),
    "dict, bare scheduler": lambda m: (lambda o, s: {"optimizer": o, "lr_scheduler": s})(*_halving(m)),
    "two lists, bare scheduler": lambda m: (lambda o, s: ([o], [s]))(*_halving(m)),
    "two lists, scheduler dict without interval": lambda m: (lambda o, s: ([o], [{"scheduler": s}]))(*_halving(m)),
}


@pytest.mark.parametrize("form", sorted(_RETURN_FORMS))
def test_each_return_form_of_configure_optimizers_equals_its_single_run(form):
    # a form read wrongly either refuses (a scheduler taken for a second optimizer) or steps the schedule at another
    # pace (frequency ignored: the learning rate halves every round instead of every second) than Lightning does
    build = _with_optimizers(_RETURN_FORMS[form])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = fit_seeds(build, [0, 1], 4)
    # the cohort applies the optimizer's update itself: torch's "scheduler stepped before the optimizer" is not true
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    for run in runs:
        _assert_equal_runs(_single(build, run.seed, rounds=4), run)


def test_the_schedulers_frequency_decides_when_the_rate_halves():
    # closed form: the same stacked seeds at lr 0.2 with the scheduler stepped after rounds 2 and 4 (frequency 2)
    # equal stacked seeds whose rounds run at 0.2, 0.2, 0.1, 0.1 by a hand-written schedule; every round (frequency
    # 1) would give 0.2, 0.1, 0.05, 0.025
    every_second = _with_optimizers(_RETURN_FORMS["dict, scheduler every 2nd round"])

    def by_hand(module):
        optimizer = _sgd(module)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda epoch: [1.0, 1.0, 0.5, 0.5, 0.25][epoch])}

    for a, b in zip(fit_seeds(every_second, [0, 1], 4), fit_seeds(_with_optimizers(by_hand), [0, 1], 4)):
        torch.testing.assert_close(a.global_params, b.global_params, rtol=0, atol=0)


_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


@pytest.mark.parametrize(("configure", "message"), [
    (lambda m: [_sgd(m), _sgd(m)], r"configure_optimizers gave 2 optimizers; the cohort steps exactly one\."),
    (lambda m: ([_sgd(m), _sgd(m)], []), r"configure_optimizers gave 2 optimizers; the cohort steps exactly one\."),
    (lambda m: 3, r"configure_optimizers returned int; return an optimizer or a dict\."),
    (lambda m: (lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "monitor": "val_loss"}})(*_halving(m)),
     r"seed 1's learning-rate scheduler \(interval='epoch', monitor='val_loss'\) is not a per-round schedule "
     r"fit_seeds can step; use interval='epoch' without a monitor, or fit the seeds one at a time with Trainer\.fit\."),
    (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _PLATEAU(o)}})(_sgd(m)),
     r"seed 1's learning-rate scheduler \(interval='epoch', monitor=None\) is not a per-round schedule.*"),
    (lambda m: (lambda o: ([o], [_PLATEAU(o)]))(_sgd(m)),
     r"seed 1's learning-rate scheduler \(interval='epoch', monitor=None\) is not a per-round schedule.*"),
], ids=["list of two", "two lists of two", "an int", "monitor", "plateau", "bare plateau"])
def test_optimizers_the_stacked_seeds_cannot_step_are_refused_naming_the_form(configure, message):
    with pytest.raises(VmapUnsupported, match=rf"^engine='vmap' cannot run this: {message} Use engine='sequential'"):
        fit_seeds(_with_optimizers(configure), [1, 2], 1)


class _StageSpy(FederatedDataModule):
    def setup(self, stage: str) -> None:
        self.stages = [*getattr(self, "stages", []), stage]


def test_each_seeds_datamodule_is_set_up_for_fit_and_a_spec_is_taken_as_its_strategy():
    # a datamodule that builds its data in setup("fit") only (Lightning's usual pattern) sees the stage "fit";
    # a FederationSpec in the strategy's place runs as FedHetStrategy(spec=...) would
    modules = []

    def build(seed, as_spec=False):
        dm = _six_clients(kind=_StageSpy)
        modules.append(dm)
        strategy = FedHetStrategy(participation=Bernoulli(0.6), channel=LossyChannel(uplink=0.2), seed=seed)
        return _RandomInit(), dm, strategy.spec if as_spec else strategy

    as_strategies = fit_seeds(build, [1, 2], 3)
    assert [dm.stages for dm in modules] == [["fit"], ["fit"]]
    for a, b in zip(as_strategies, fit_seeds(lambda seed: build(seed, as_spec=True), [1, 2], 3)):
        assert isinstance(b.strategy, FedHetStrategy) and b.strategy.seed == a.seed
        torch.testing.assert_close(b.global_params, a.global_params, rtol=0, atol=0)
        assert_same_rounds(a.history, b.history, rel=0, abs=0)


def test_each_seed_is_seeded_as_its_single_run_is_and_quietly(monkeypatch, caplog):
    # seed_everything(seed, workers=False) as the single run's reference: worker seeding left off for the rest of
    # the process (PL_SEED_WORKERS=0, which later Trainer.fit calls read) and no "Seed set to" line per seed
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    with caplog.at_level("INFO"):
        fit_seeds(_tiny_build("FedAvg-participating"), [5, 6], 1)
    assert os.environ["PL_SEED_WORKERS"] == "0"
    assert not [r for r in caplog.records if "Seed set to" in r.getMessage()]


@pytest.mark.parametrize(("built", "message"), [
    (lambda seed: [_RandomInit(), _six_clients(), FedHetStrategy(seed=seed)],
     r"^build\(seed\) must return \(module, datamodule, strategy\), got list$"),
    (lambda seed: (_RandomInit(), _six_clients()),
     r"^build\(seed\) must return \(module, datamodule, strategy\), got tuple$"),
    (lambda seed: (_RandomInit(), _six_clients(), "ddp"),
     r"^build\(3\) returned a str: fit_seeds runs FedHetStrategy configurations \(one process\); run other "
     r"strategies one seed at a time with Trainer\.fit$"),
    (lambda seed: (torch.nn.Linear(5, 3), _six_clients(), FedHetStrategy(seed=seed)),
     r"^build\(3\) must return a LightningModule first, got Linear$"),
], ids=["a list", "two items", "a strategy name", "a plain module"])
def test_builds_of_the_wrong_shape_are_refused_naming_what_came_back(built, message):
    with pytest.raises(TypeError, match=message):
        fit_seeds(built, [3], 1)


# every argument check names the argument, its allowed range and the value, before any seed is built
@pytest.mark.parametrize(("seeds", "rounds", "options", "message"), [
    ([-1], 1, {}, r"^seeds must be an integer in \[0, 4294967295\], got -1$"),
    ([2**32], 1, {}, r"^seeds must be an integer in \[0, 4294967295\], got 4294967296$"),
    ([], 1, {}, r"^seeds must name at least one seed$"),
    ([1], 0, {}, r"^rounds must be an integer >= 1, got 0$"),
    ([1], 1, {"eval_every": 0}, r"^eval_every must be an integer >= 1, got 0$"),
    ([1], 1, {"checkpoint_every": 0}, r"^checkpoint_every must be an integer >= 1, got 0$"),
])
def test_argument_checks_name_the_argument_and_its_range(seeds, rounds, options, message):
    def build(seed):
        raise AssertionError("a bad argument is refused before any seed is built")

    with pytest.raises(ValueError, match=message):
        fit_seeds(build, seeds, rounds, **options)


def test_the_largest_seed_and_the_smallest_intervals_are_accepted():
    build = _tiny_build("FedAvg-participating")
    runs = fit_seeds(build, [2**32 - 1], 1, eval_every=1, checkpoint_every=1)
    assert [run.seed for run in runs] == [2**32 - 1] and len(runs[0].history) == 1


def test_stacked_seeds_keep_each_clients_momentum_as_their_single_runs():
    # optimizer_state="persist": each seed's server keeps its own clients' SGD momentum buffers (momentum 0.5);
    # rows of two seeds share a cohort, so a buffer read from or written to the other seed's server would show
    factory, spec = CASES["FedVARP"]

    def build(seed: int):
        dm = _six_clients()
        return _RandomInit(), dm, FedHetStrategy(algorithm=factory(), seed=seed, optimizer_state="persist",
                                                 **_settings(spec))

    seeds = [3, 11]
    runs = fit_seeds(build, seeds, 6)
    for seed, run in zip(seeds, runs):
        single = _single(build, seed, rounds=6)
        _assert_equal_runs(single, run)
        kept = run.server._client_optimizer_states
        assert kept.keys() == single.server._client_optimizer_states.keys() and kept
        for client, state in single.server._client_optimizer_states.items():
            for position, entry in state[0].items():
                torch.testing.assert_close(kept[client][0][position]["momentum_buffer"], entry["momentum_buffer"],
                                           rtol=1e-5, atol=1e-6)


def test_an_epoch_scheduler_steps_once_per_round_for_every_seed():
    class Scheduled(_RandomInit):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def build(seed):
        dm = _six_clients()
        strategy = FedHetStrategy(
            algorithm=FedAvg(), participation=Bernoulli(0.7), channel=LossyChannel(uplink=0.2),
            local_steps=UniformSteps(1, 3), seed=seed,
        )  # fmt: skip
        return Scheduled(), dm, strategy

    runs = fit_seeds(build, [0, 1], 3)
    for run in runs:
        _assert_equal_runs(_single(build, run.seed, rounds=3), run)


def test_stateful_rule_instances_are_not_shared():
    # a build that hands every seed the same rule object would mix the seeds' memories: refused
    shared = FedVARP()

    def build(seed):
        dm = _six_clients()
        return _RandomInit(), dm, FedHetStrategy(algorithm=shared, seed=seed)

    with pytest.raises(ValueError, match="same FedVARP object"):
        fit_seeds(build, [0, 1], 1)


# seeds 1 and 4 agree and the last, 7, differs in one thing: every later seed is compared with the first
_OTHER = 7
_LAST_DIFFERS = {
    "module": ({"batchnorm": True}, {},
               r"^seed 7's module differs from seed 1's in its tensors: fit_seeds stacks seeds of one configuration; "
               r"fit different models one at a time$"),
    "learning rate": ({"lr": 0.2}, {},
                      r"^seed 7's optimizer settings differ from seed 1's: fit_seeds stacks seeds of one "
                      r"configuration; fit different optimizers one at a time$"),
    "compile": ({}, {"engine": "vmap", "compile": True},
                r"^seed 7's strategy has compile=True, seed 1's None: pass the same to every seed$"),
}


class _Configurable(_RandomInit):
    def __init__(self, batchnorm: bool = False, lr: float = 0.1) -> None:
        super().__init__(batchnorm)
        self.lr = lr


@pytest.mark.without_compiler  # the compile=True seed is refused before anything compiles
@pytest.mark.parametrize("differ", sorted(_LAST_DIFFERS))
def test_seeds_of_different_configurations_are_refused_naming_the_seed(differ):
    module_kwargs, strategy_kwargs, message = _LAST_DIFFERS[differ]

    def build(seed):
        dm = _six_clients()
        other = seed == _OTHER
        model = _Configurable(**(module_kwargs if other else {}))
        return model, dm, FedHetStrategy(seed=seed, **(strategy_kwargs if other else {}))

    with pytest.raises(ValueError, match=message):
        fit_seeds(build, [1, 4, _OTHER], 1)


def test_rounds_in_which_no_client_is_available_equal_their_single_runs():
    # Bernoulli(0.15) over 6 clients: some rounds have nobody (no cohort, nothing logged), the others someone
    def build(seed):
        dm = _six_clients()
        return _RandomInit(), dm, FedHetStrategy(participation=Bernoulli(0.15), seed=seed)

    runs = fit_seeds(build, [0, 1], 6)
    empty = [len(record["received"]) == 0 for run in runs for record in run.history]
    assert any(empty) and not all(empty)
    for run in runs:
        _assert_equal_runs(_single(build, run.seed, rounds=6), run)
        for metrics, record in zip(run.metrics, run.history):
            assert np.isnan(metrics["train_loss"]) == (len(record["received"]) == 0)


def test_a_part_shared_by_later_seeds_is_refused_when_the_first_has_none():
    shared = LossyChannel(uplink=0.2)

    def build(seed):
        dm = _six_clients()
        return _RandomInit(), dm, FedHetStrategy(seed=seed, channel=None if seed == 1 else shared)

    message = (r"^seeds 4 and 7 were given the same LossyChannel object as channel: it keeps per-run state, so "
               r"build\(seed\) must create a new one for every seed$")
    with pytest.raises(ValueError, match=message):
        fit_seeds(build, [1, 4, 7], 1)


def test_compiled_stacked_seeds_equal_their_single_runs():
    # the compiled cohort (padded to a bucket size) with the rows of two federations and BatchNorm buffers
    build = _tiny_build("FedAvg-known_p", batchnorm=True, engine="vmap", compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to the eager cohort would be vacuous
        runs = fit_seeds(build, [0, 1], ROUNDS)
    for run in runs:
        _assert_equal_runs(_single(_tiny_build("FedAvg-known_p", batchnorm=True), run.seed), run)


def test_each_seeds_logged_values_are_reduced_as_training_step_asked():
    # a sum counts that seed's client steps of the round, a max is at least the seed's mean training loss
    def build(seed: int):
        dm = _six_clients()
        strategy = FedHetStrategy(participation=Bernoulli(0.6), local_steps=UniformSteps(1, 3), seed=seed)
        return LogsEachReduction(), dm, strategy

    runs = fit_seeds(build, [3, 4], 3)
    for run in runs:
        for metrics, record in zip(run.metrics, run.server.history):
            assert metrics["steps_taken"] == sum(record["local_steps"].values())
            if record["local_steps"]:
                assert metrics["loss_max"] >= metrics["train_loss"]
    assert [m["steps_taken"] for m in runs[0].metrics] != [m["steps_taken"] for m in runs[1].metrics]


def test_a_seed_with_no_client_in_a_round_logs_nan_while_another_seed_trains():
    # Bernoulli(0.15) over 6 clients: in some rounds one seed trains and the other has nobody. The idle seed logged
    # nothing, so each of its names reads NaN (a sum of nothing is not 0 steps, a max of nothing is not 0), while
    # the training seed's sum counts its own steps only.
    def build(seed: int):
        dm = _six_clients()
        return LogsEachReduction(), dm, FedHetStrategy(participation=Bernoulli(0.15), seed=seed)

    runs = fit_seeds(build, [0, 1], 8)
    trained = [[bool(record["local_steps"]) for record in run.server.history] for run in runs]
    mixed = [t for t in range(8) if trained[0][t] != trained[1][t]]
    assert mixed, "no round in which exactly one seed trained: pick other seeds"
    for t in mixed:
        idle, busy = (0, 1) if trained[1][t] else (1, 0)
        for name in ("steps_taken", "loss_max", "loss_min", "loss_mean"):
            assert np.isnan(runs[idle].metrics[t][name]), (t, name)
        assert runs[busy].metrics[t]["steps_taken"] == sum(runs[busy].server.history[t]["local_steps"].values())
