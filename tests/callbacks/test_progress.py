"""RoundProgressBar counts rounds (total = max_epochs); RoundPrinter prints labelled lines above it."""

import re

import pytest
import torch
from lightning_fedhet.callbacks import RoundPrinter, RoundProgressBar, round_postfix

from lightning_fedhet import IID, FederatedDataModule, FedHetStrategy, UniformSample
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset


def _fit(callbacks, rounds=3, progress_bar=False, **kwargs):
    dm = FederatedDataModule(toy_dataset(40), IID(), num_clients=8, batch_size=4, val_dataset=toy_dataset(12, seed=1))
    strategy = FedHetStrategy(participation=UniformSample(3), local_steps=2, seed=0)
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=rounds, callbacks=callbacks, enable_progress_bar=progress_bar, **kwargs
    )
    trainer.fit(TinyClassifier(), datamodule=dm)
    return trainer, strategy


def test_progress_bar_counts_rounds_with_round_postfix(capsys):
    bar = RoundProgressBar()
    trainer, strategy = _fit([bar], rounds=4, progress_bar=True)
    tqdm_bar = bar.train_progress_bar
    assert tqdm_bar.total == trainer.max_epochs == 4
    assert tqdm_bar.n == 4
    assert tqdm_bar.desc.startswith("Rounds")
    last = strategy.history[-1]
    assert tqdm_bar.postfix.startswith("available=3, selected=3, received=3, steps=6")
    assert round_postfix(last) == {"available": 3, "selected": 3, "received": 3, "steps": 6}
    # the bar moved once per round, never per local step (6 steps a round would overshoot a total of 4)
    shown = re.findall(r"Rounds:\s+\d+%\|[^|]*\|\s*(\d+)/4", capsys.readouterr().out)
    assert shown and all(int(n) <= 4 for n in shown) and shown[-1] == "4"


def test_round_postfix_shows_rejections_only_when_there_are_some():
    record = {"available": torch.arange(5), "selected": torch.arange(3), "received": torch.tensor([0]),
              "rejected": torch.tensor([1, 2]), "local_steps": {0: 2, 1: 2, 2: 5}}
    assert round_postfix(record) == {"available": 5, "selected": 3, "received": 1, "steps": 9, "rejected": 2}


def test_round_printer_prints_labelled_columns_every_n_rounds(capsys):
    _fit([RoundPrinter(every_n_rounds=2)], rounds=5, check_val_every_n_epoch=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert [line.split("|")[0].strip() for line in lines] == ["round    2/5", "round    4/5", "round    5/5"]
    cols = [c.strip() for c in lines[0].split("|")]
    assert cols[1:5] == ["available 3", "selected 3", "received 3", "local steps 6"]
    assert re.fullmatch(r"val_loss \d\.\d{4}", cols[5]) and re.fullmatch(r"wall \d+\.\d s", cols[-1])
    assert "val_loss" not in lines[2]  # round 5 did not validate


def test_round_printer_writes_above_the_progress_bar(capsys):
    _fit([RoundProgressBar(), RoundPrinter()], rounds=2, progress_bar=True)
    out = capsys.readouterr().out
    # tqdm.write clears the bar's line first, so each printed round starts on a line of its own
    printed = [seg.strip() for seg in re.split(r"[\r\n]", out) if seg.strip().startswith("round ")]
    assert [p.split("|")[0].strip() for p in printed] == ["round    1/2", "round    2/2"]
    assert all("Rounds:" not in p for p in printed)


def test_round_printer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every_n_rounds must be an integer >= 1"):
        RoundPrinter(every_n_rounds=0)


@pytest.mark.parametrize("callback", [RoundProgressBar, RoundPrinter])
def test_round_progress_needs_the_federated_strategy(callback):
    trainer = quiet_trainer(max_epochs=1, callbacks=[callback()], enable_progress_bar=callback is RoundProgressBar)
    loader = torch.utils.data.DataLoader(toy_dataset(8), batch_size=4)
    with pytest.raises(TypeError, match=f"{callback.__name__} needs Trainer\\(strategy=FedHetStrategy"):
        trainer.fit(TinyClassifier(), train_dataloaders=loader)
