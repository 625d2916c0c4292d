"""The engine contract: for every algorithm, every engine gives the sequential engine's run, or refuses clearly.

Each case runs 4 rounds with heterogeneity switched on (Bernoulli or Markov availability, a lossy uplink,
unequal local steps) and compares, against ``engine="sequential"``:

* the global parameters (rtol 1e-5, atol 1e-6), and
* every history entry's client ids (available / selected / received / rejected), local steps and weights.

A new engine (or engine option) is added to ``ENGINE_VARIANTS`` and must pass unchanged. An engine that cannot
simulate a case must refuse at setup with an error that names the cause and ``engine='sequential'``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedCIS
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.early_exit_module import EarlyExitClassifier
from lightning_fedhet.engines.vmap import VmapUnsupported
from lightning_fedhet.participation import Bernoulli, Markov
from lightning_fedhet.system import LossyChannel, UniformSteps
from tests.algorithms.rules import RULE_CLASSES, RULES
from tests.helpers import TinyClassifier, assert_same_rounds, quiet_trainer, toy_dataset

ROUNDS = 4
NUM_CLIENTS = 6

#: engine name -> extra FedHetStrategy arguments; every entry must pass every case
ENGINE_VARIANTS: dict[str, dict] = {"vmap": dict(engine="vmap"), "auto": dict(engine="auto")}

_hetero = dict(
    participation=lambda: Bernoulli(0.7),
    channel=lambda: LossyChannel(uplink=0.2),
    local_steps=lambda: UniformSteps(1, 3),
)
_markov = dict(participation=lambda: Markov(p=0.5, lam=0.6), local_steps=lambda: 2)

#: case name -> (algorithm factory from the shared list of rules, strategy settings)
CASES = {
    "FedAvg-known_p": (RULES["FedAvg-known_p"], _hetero),
    "FedAvg-participating": (RULES["FedAvg"], _hetero),
    "FedVARP": (RULES["FedVARP"], _hetero),
    "MIFA": (RULES["MIFA"], _hetero),
    "FedStale": (RULES["FedStale"], _hetero),
    "FedAU": (RULES["FedAU"], _hetero),
    "UPGAPL": (RULES["UPGAPL"], _hetero),
    "DMAPL": (RULES["DMAPL"], _hetero),
    "UDMAPL": (RULES["UDMAPL"], _hetero),
    "FedNova": (RULES["FedNova"], _hetero),  # the module's SGD momentum (checked at setup)
    "FedACS": (RULES["FedACS"], dict(channel=_hetero["channel"], local_steps=_hetero["local_steps"])),
    "SampledFedAvg": (RULES["SampledFedAvg"], dict(channel=_hetero["channel"])),
    "CAFedAvg": (RULES["CAFedAvg"], dict(channel=_hetero["channel"], local_steps=_hetero["local_steps"])),
    "OS": (RULES["OS"], dict(channel=_hetero["channel"], local_steps=_hetero["local_steps"])),
    "CAFed": (RULES["CAFed"], _markov),
    "CAFed-probe": (RULES["CAFed-probe"], _markov),
    "AdaFed": (RULES["AdaFed"], _markov),
    "F3AST": (RULES["F3AST"], _markov),
    "FedCIS": "early-exit",  # its own model and data, below
}


def _settings(spec: dict) -> dict:
    return {k: v() for k, v in spec.items()}


class _TinyBatchNorm(TinyClassifier):
    """BatchNorm1d (running statistics, num_batches_tracked) before the linear layer, SGD with momentum."""

    def __init__(self) -> None:
        super().__init__(momentum=0.5)
        self.norm = torch.nn.BatchNorm1d(5, momentum=0.3)

    def forward(self, x):
        return self.linear(self.norm(x))


def _run_tiny(
    engine_kwargs: dict,
    case: str,
    strategy_cls: type = FedHetStrategy,
    model_cls: type = TinyClassifier,
    rounds: int = ROUNDS,
    **trainer_kwargs,
):
    factory, spec = CASES[case]
    torch.manual_seed(0)
    model = TinyClassifier(momentum=0.5) if model_cls is TinyClassifier else model_cls()
    data = FederatedDataModule(toy_dataset(96), [np.arange(i * 16, (i + 1) * 16) for i in range(6)], batch_size=4)
    strategy = strategy_cls(algorithm=factory(), seed=5, **_settings(spec), **engine_kwargs)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **trainer_kwargs)
    trainer.fit(model, datamodule=data)
    return strategy


def _run_fedcis(
    engine_kwargs: dict,
    weight_decay: float = 0.0,
    strategy_cls: type = FedHetStrategy,
    norm: str = "group",
    rounds: int = ROUNDS,
    **trainer_kwargs,
):
    topology = CISTopology.preset("7-node", "80-15-5")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7 * 8, 3, 8, 8, generator=gen)
    y = torch.randint(0, 10, (7 * 8,), generator=gen)
    data = FederatedDataModule(TensorDataset(x, y), [np.arange(i * 8, (i + 1) * 8) for i in range(7)], batch_size=4)
    torch.manual_seed(0)
    net = early_exit_resnet18(num_classes=10, exits=(3, 9), in_channels=3, base_width=4, norm=norm)
    model = EarlyExitClassifier(model=net, num_classes=10, lr=0.05, momentum=0.9, weight_decay=weight_decay)
    strategy = strategy_cls(algorithm=FedCIS(topology, p=0.3), local_steps=2, seed=3, **engine_kwargs)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **trainer_kwargs)
    trainer.fit(model, datamodule=data)
    return strategy


def _run(engine_kwargs: dict, case: str, strategy_cls: type = FedHetStrategy, **trainer_kwargs):
    """One contract case; ``strategy_cls`` and ``trainer_kwargs`` let the many-process strategy reuse it."""
    if CASES[case] == "early-exit":
        return _run_fedcis(engine_kwargs, strategy_cls=strategy_cls, **trainer_kwargs)
    return _run_tiny(engine_kwargs, case, strategy_cls, **trainer_kwargs)


_reference_cache: dict[str, FedHetStrategy] = {}


def _reference(case: str) -> FedHetStrategy:
    if case not in _reference_cache:
        _reference_cache[case] = _run({"engine": "sequential"}, case)  # named: the default, "auto", may pick vmap
    return _reference_cache[case]


def _assert_same_run(ref: FedHetStrategy, out: FedHetStrategy, rounds: int = ROUNDS) -> None:
    torch.testing.assert_close(out.global_params, ref.global_params, rtol=1e-5, atol=1e-6)
    assert len(ref.history) == rounds
    assert_same_rounds(ref.history, out.history)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_engine_matches_sequential_or_refuses(variant: str, case: str):
    reference = _reference(case)
    assert any(len(h["received"]) for h in reference.history), "the case must aggregate something"
    try:
        out = _run(ENGINE_VARIANTS[variant], case)
    except VmapUnsupported as err:
        assert "engine='sequential'" in str(err)
        pytest.fail(f"{variant} refused {case}: {err}")  # none of today's cases should need a refusal
    _assert_same_run(reference, out)


PERSIST_ROUNDS = 6
#: rules whose client solver must restart each round (their normalisation is a fresh solver's): they refuse persist
_RESTARTING = {"FedACS", "FedNova"}
_persist_reference_cache: dict[str, FedHetStrategy] = {}


def _persisted_reference(case: str) -> FedHetStrategy:
    if case not in _persist_reference_cache:
        _persist_reference_cache[case] = _run_tiny(
            dict(engine="sequential", optimizer_state="persist"), case, rounds=PERSIST_ROUNDS)
    return _persist_reference_cache[case]


def _assert_same_kept_states(ref: FedHetStrategy, out: FedHetStrategy) -> None:
    kept, reference = out.server._client_optimizer_states, ref.server._client_optimizer_states
    assert kept.keys() == reference.keys() and len(reference) >= 4, "most clients trained and kept a state"
    for client, state in reference.items():
        assert state[0].keys() == kept[client][0].keys() == {0, 1}  # the weight's and the bias's buffer
        for position, entry in state[0].items():
            torch.testing.assert_close(kept[client][0][position]["momentum_buffer"], entry["momentum_buffer"],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c] != "early-exit" and c not in _RESTARTING))
def test_vmap_keeps_each_clients_momentum_as_the_sequential_engine(case: str):
    # optimizer_state="persist", SGD momentum 0.5, 6 rounds: clients come and go (Bernoulli / Markov / a lossy
    # uplink), so a buffer kept in one round is read rounds later, and unequal local steps (1-3) leave finished rows
    # in a cohort, whose buffers must not move. Slips caught: buffers not read back (= reset), rows mixed up, a
    # finished row's buffer stepped on, the server's copy not written.
    reference = _persisted_reference(case)
    out = _run_tiny(dict(engine="vmap", optimizer_state="persist"), case, rounds=PERSIST_ROUNDS)
    _assert_same_run(reference, out, rounds=PERSIST_ROUNDS)
    _assert_same_kept_states(reference, out)


@pytest.mark.parametrize("case", ["FedAvg-known_p", "FedVARP"])
def test_compiled_vmap_keeps_each_clients_momentum_as_the_sequential_engine(case: str):
    reference = _persisted_reference(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to the eager cohort would be vacuous
        out = _run_tiny(dict(engine="vmap", compile=True, optimizer_state="persist"), case, rounds=PERSIST_ROUNDS)
    _assert_same_run(reference, out, rounds=PERSIST_ROUNDS)
    _assert_same_kept_states(reference, out)


def test_persisted_momentum_differs_from_reset():
    # the persist cases above are not vacuous: keeping the buffers changes this run
    reset = _run_tiny(dict(engine="sequential"), "FedAvg-known_p", rounds=PERSIST_ROUNDS)
    assert (reset.global_params - _persisted_reference("FedAvg-known_p").global_params).abs().max() > 1e-4


def test_vmap_refuses_persist_for_per_client_configs():
    with pytest.raises(VmapUnsupported, match="persist.*different part of the model.*engine='sequential'"):
        _run_fedcis(dict(engine="vmap", optimizer_state="persist"))


BATCHNORM_ROUNDS = 5


def _run_batchnorm(engine_kwargs: dict, case: str):
    if CASES[case] == "early-exit":
        return _run_fedcis(engine_kwargs, norm="batch", rounds=BATCHNORM_ROUNDS)
    return _run_tiny(engine_kwargs, case, model_cls=_TinyBatchNorm, rounds=BATCHNORM_ROUNDS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_vmap_with_batchnorm_matches_sequential(case: str):
    # Per-client running statistics and num_batches_tracked under vmap, averaged by the server as under the
    # sequential engine: the global vector holds the parameters and the running means/variances, so a shared
    # (not per-client) statistic, a missing buffer update or a buffer averaged like a parameter would differ here.
    reference = _run_batchnorm({"engine": "sequential"}, case)
    out = _run_batchnorm(dict(engine="vmap"), case)
    _assert_same_run(reference, out, rounds=BATCHNORM_ROUNDS)
    ref_ints, out_ints = reference.server.global_ints, out.server.global_ints
    assert torch.equal(out_ints, ref_ints)
    assert int(ref_ints.max()) > 0  # num_batches_tracked moved: the buffers were trained
    buffers = reference.global_params[reference.server.num_parameters :]
    assert ((buffers != 0) & (buffers != 1)).any()  # running means/variances left their initial zeros and ones


def test_every_rule_of_the_package_has_a_case():
    covered = {FedCIS} | {type(case[0]()) for case in CASES.values() if case != "early-exit"}
    missing = set(RULE_CLASSES) - covered
    assert not missing, f"no engine contract case for {sorted(cls.__name__ for cls in missing)}"


def test_vmap_refuses_per_client_configs_with_weight_decay():
    with pytest.raises(VmapUnsupported, match="weight_decay.*engine='sequential'"):
        _run_fedcis(dict(engine="vmap"), weight_decay=5e-4)


@pytest.mark.parametrize("case", ["FedAvg-known_p", "FedVARP"])
def test_compiled_vmap_matches_sequential(case: str):
    # Bernoulli participation, a lossy uplink and unequal local steps (1-3) over 4 rounds; compiling on a CPU costs
    # seconds, so the compiled variant runs two representative cases (a stateless and a stateful rule)
    _assert_same_run(_reference(case), _run(dict(engine="vmap", compile=True), case))


class _TinyCNN(TinyClassifier):
    """Conv 3x3 (4 channels) -> BatchNorm -> ReLU -> 2x2 max-pool -> linear, SGD with momentum: the CNN case of the
    fast path, with running statistics stacked per client inside the compiled graph."""

    def __init__(self) -> None:
        super().__init__(momentum=0.5)
        torch.manual_seed(7)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.linear = torch.nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        return self.linear(torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2).flatten(1))


def _run_cnn(engine_kwargs: dict, rounds: int = 5) -> FedHetStrategy:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 1, 6, 6, generator=gen), torch.randint(0, 3, (96,), generator=gen)
    data = FederatedDataModule(TensorDataset(x, y), [np.arange(i * 16, (i + 1) * 16) for i in range(6)], batch_size=4)
    strategy = FedHetStrategy(seed=5, **_settings(_hetero), **engine_kwargs)
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(_TinyCNN(), datamodule=data)
    return strategy


def test_compiled_vmap_matches_sequential_on_a_cnn():
    # Bernoulli participation, a lossy uplink and unequal local steps (1-3) over 5 rounds, fp32, 1e-5
    reference = _run_cnn(dict(engine="sequential"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to the eager cohort would be vacuous
        compiled = _run_cnn(dict(engine="vmap", compile=True))
    assert sum(len(h["received"]) for h in reference.history) >= 10
    initial = torch.cat([p.detach().flatten() for p in [*_TinyCNN().parameters(), *_TinyCNN().norm.buffers()][:-1]])
    assert (reference.global_params - initial).abs().max() > 1e-3  # the model did train
    torch.testing.assert_close(compiled.global_params, reference.global_params, rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled.server.global_ints, reference.server.global_ints)  # num_batches_tracked
    for a, b in zip(reference.history, compiled.history):
        assert torch.equal(a["received"], b["received"]) and a["local_steps"] == b["local_steps"]
