"""FedHetStrategy(seed=None) follows Lightning's global seed (seed_everything); an explicit seed wins.

The strategy-level tests need ``FedHetStrategy(seed=None)`` to resolve its seed with
``lightning_fedhet.seeding.resolve_seed`` when fitting starts; they fail until the strategy does.
"""

import numpy as np
import pytest
from lightning.pytorch import seed_everything

from lightning_fedhet import IID, FederatedDataModule, FedHetStrategy, UniformSample
from lightning_fedhet.seeding import resolve_seed
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset


@pytest.fixture(autouse=True)
def _restore_global_seed(monkeypatch):
    # seed_everything writes PL_GLOBAL_SEED; monkeypatch restores the variable after each test
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


def test_resolve_seed_explicit_wins_then_global_then_zero(monkeypatch):
    assert resolve_seed(None) == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    assert resolve_seed(None) == 17
    assert resolve_seed(3) == 3
    assert resolve_seed(np.int64(4)) == 4
    seed_everything(42, verbose=False)
    assert resolve_seed(None) == 42


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_resolve_seed_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0"):
        resolve_seed(bad)


def test_resolve_seed_rejects_bad_environment(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    with pytest.raises(ValueError, match="PL_GLOBAL_SEED must be an integer >= 0"):
        resolve_seed(None)


def _selected(global_seed: int, strategy_seed: int | None = None, rounds: int = 4) -> list[list[int]]:
    """Clients selected per round (UniformSample(2) of 10) after seed_everything(global_seed)."""
    seed_everything(global_seed, verbose=False)
    strategy = FedHetStrategy(participation=UniformSample(2), local_steps=1, seed=strategy_seed)
    dm = FederatedDataModule(toy_dataset(40), IID(), num_clients=10, batch_size=4)
    quiet_trainer(strategy=strategy, max_epochs=rounds).fit(TinyClassifier(), datamodule=dm)
    assert strategy.seed == (global_seed if strategy_seed is None else strategy_seed)
    return [record["selected"].tolist() for record in strategy.history]


def test_global_seed_drives_selection_when_strategy_seed_is_none():
    one, two, one_again = _selected(1), _selected(2), _selected(1)
    assert one == one_again
    # 4 rounds of 2-of-10 draws: equal by chance with probability (1/45)^4 ~ 2.4e-7 for independent seeds
    assert one != two


def test_explicit_strategy_seed_wins_over_global_seed():
    assert _selected(1, strategy_seed=5) == _selected(2, strategy_seed=5)
