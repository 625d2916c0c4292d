"""FedHetStrategy's ``device`` against the Trainer's accelerator: ``device=None`` (the default) follows the Trainer's
device; an explicit device the accelerator cannot use is refused at setup, naming ``device`` and the fixes, instead of
Lightning's "Device should be GPU, got cpu" from deep inside the fit.

No GPU here: a CUDA Trainer is built with Lightning's availability checks patched (:func:`_pretend_cuda`), and only
the strategy's resolved device is read; nothing runs on it."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.data import IID
from lightning_fedhet.strategy import check_device_matches_accelerator, resolve_device


def test_matching_device_and_accelerator_pass():
    check_device_matches_accelerator(torch.device("cpu"), CPUAccelerator())
    check_device_matches_accelerator(torch.device("cuda", 0), CUDAAccelerator())
    check_device_matches_accelerator(torch.device("cpu"), None)  # not attached to a Trainer yet


def test_an_explicit_cpu_device_with_a_gpu_accelerator_names_the_fixes():
    expected = r"FedHetStrategy\(device='cpu'\) but the Trainer chose CUDAAccelerator"
    with pytest.raises(ValueError, match=expected) as err:
        check_device_matches_accelerator(torch.device("cpu"), CUDAAccelerator())
    assert str(err.value) == (
        "FedHetStrategy(device='cpu') but the Trainer chose CUDAAccelerator: pass Trainer(accelerator='cpu') to "
        "simulate on the CPU, or leave device unset (the Trainer's device) or pass FedHetStrategy(device='cuda:0') "
        "(the accelerator's device) to train the clients there")


def test_a_gpu_device_with_the_cpu_accelerator_is_refused():
    with pytest.raises(ValueError, match=r"device='cuda:0'\) but the Trainer chose CPUAccelerator"):
        check_device_matches_accelerator(torch.device("cuda", 0), CPUAccelerator())


def test_a_trainer_refuses_the_mismatch_before_any_round(tmp_path):
    """End to end on this CPU machine: a CUDA device with ``accelerator="cpu"`` stops at setup; no round ran."""
    from lightning_fedhet.classifier import Classifier

    strategy = FedHetStrategy(num_clients=2, device="cuda:0")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=r"device='cuda:0'\) but the Trainer chose CPUAccelerator"):
        trainer.fit(Classifier(torch.nn.Linear(3, 2), num_classes=2), torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.current_epoch == 0


# ----------------------------------------------------------------------------- device=None: the Trainer's device
def test_resolve_device_takes_the_explicit_device_else_the_trainers_first_else_the_cpu():
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert resolve_device(torch.device("cpu"), [cuda1]) == torch.device("cpu")  # explicit wins, even if wrong
    assert resolve_device(None, [cuda1, cuda0]) == cuda1  # the first, as Lightning's single-device strategy takes it
    assert resolve_device(None, None) == torch.device("cpu")  # no Trainer attached yet
    assert resolve_device(None, []) == torch.device("cpu")


def test_device_none_follows_a_cpu_trainer(tmp_path):
    from lightning_fedhet.classifier import Classifier

    strategy = FedHetStrategy(num_clients=2, partitioner=IID(), engine="sequential", seed=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    assert strategy.root_device == torch.device("cpu")
    model = Classifier(torch.nn.Linear(3, 2), num_classes=2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    assert len(strategy.history) == 1 and next(model.parameters()).device == torch.device("cpu")


@contextmanager
def _pretend_cuda(indices: list[int]):
    """A CUDA accelerator Lightning accepts on this GPU-less machine, with devices ``cuda:i`` for ``i`` in ``indices``
    (nothing may run on them: the tests only build Trainers and read the strategy's device)."""
    devices = [torch.device("cuda", i) for i in indices]
    with mock.patch.object(CUDAAccelerator, "is_available", return_value=True), \
            mock.patch.object(CUDAAccelerator, "parse_devices", return_value=list(indices)), \
            mock.patch.object(CUDAAccelerator, "get_parallel_devices", return_value=devices):
        yield


@pytest.mark.parametrize("indices", [[0], [1]])
def test_device_none_follows_a_cuda_accelerator_object(indices):
    strategy = FedHetStrategy(num_clients=2)
    assert strategy.root_device == torch.device("cpu")  # before a Trainer
    with _pretend_cuda(indices):
        trainer = pl.Trainer(strategy=strategy, accelerator=CUDAAccelerator(), devices=indices, logger=False)
    assert isinstance(trainer.accelerator, CUDAAccelerator)
    assert strategy.root_device == torch.device("cuda", indices[0])
    check_device_matches_accelerator(strategy.root_device, trainer.accelerator)  # setup's check passes


def test_device_none_follows_a_cuda_accelerator_given_to_the_strategy():
    strategy = FedHetStrategy(num_clients=2, accelerator=CUDAAccelerator())
    with _pretend_cuda([0]):
        pl.Trainer(strategy=strategy, logger=False)  # Trainer(accelerator="auto") takes the strategy's
    assert strategy.root_device == torch.device("cuda", 0)


def test_an_explicit_cpu_device_is_still_refused_at_setup_by_a_cuda_trainer():
    strategy = FedHetStrategy(num_clients=2, device="cpu")
    with _pretend_cuda([0]):
        pl.Trainer(strategy=strategy, accelerator=CUDAAccelerator(), devices=1, logger=False)
    assert strategy.root_device == torch.device("cpu")  # the explicit device, not the Trainer's
    with pytest.raises(ValueError, match=r"FedHetStrategy\(device='cpu'\) but the Trainer chose CUDAAccelerator"):
        strategy.setup_environment()  # refused before anything reaches the (absent) GPU


def test_each_trainer_hands_the_strategy_its_own_devices():
    """A strategy used by a second Trainer follows that Trainer: Lightning would adopt a non-empty
    ``parallel_devices`` of the strategy as the Trainer's own (forcing the first Trainer's accelerator)."""
    strategy = FedHetStrategy(num_clients=2)
    with _pretend_cuda([1]):
        pl.Trainer(strategy=strategy, accelerator=CUDAAccelerator(), devices=[1], logger=False)
    assert strategy.root_device == torch.device("cuda", 1) and strategy.parallel_devices is None
    with _pretend_cuda([0]):
        pl.Trainer(strategy=strategy, devices=[0], logger=False)  # the strategy keeps its CUDA accelerator
    assert strategy.root_device == torch.device("cuda", 0)


def test_cuda_without_an_index_takes_the_current_cuda_device_when_cuda_runs():
    # slip caught: cuda:0 whatever device torch.cuda has made current (mocked: no GPU here)
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "current_device", return_value=3):
        assert resolve_device(torch.device("cuda"), None) == torch.device("cuda", 3)
        assert resolve_device(None, [torch.device("cuda")]) == torch.device("cuda", 3)


def test_cuda_without_an_index_resolves_to_an_indexed_device():
    # slip caught: handing Lightning torch.device("cuda"): CUDAAccelerator.setup_device -> torch.cuda.set_device
    # raises "Expected a torch.device with a specified index" (seen on an H200 with FedHetStrategy(device="cuda")).
    # Without CUDA here the index is 0; with CUDA it is the current device.
    expected = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert resolve_device(torch.device("cuda"), None) == torch.device("cuda", expected)
    assert resolve_device(None, [torch.device("cuda")]) == torch.device("cuda", expected)
    assert resolve_device(torch.device("cuda", 1), None) == torch.device("cuda", 1)
    assert resolve_device(torch.device("cpu"), None) == torch.device("cpu")


# ----------------------------------------------------------------------------- FedASTStrategy: the same rule
def test_fedast_strategy_follows_the_trainers_device_and_refuses_a_mismatch():
    from lightning_fedhet.asynchronous import FedASTStrategy

    strategy = FedASTStrategy()
    assert strategy.root_device == torch.device("cpu")  # before a Trainer
    with _pretend_cuda([1]):
        pl.Trainer(strategy=strategy, accelerator=CUDAAccelerator(), devices=[1], logger=False)
    assert strategy.root_device == torch.device("cuda", 1)
    explicit = FedASTStrategy(device="cpu")
    with _pretend_cuda([0]):
        pl.Trainer(strategy=explicit, accelerator=CUDAAccelerator(), devices=1, logger=False)
    with pytest.raises(ValueError, match=r"FedASTStrategy\(device='cpu'\) but the Trainer chose CUDAAccelerator"):
        explicit.setup_environment()
