"""FedHetStrategy's ``device`` against the Trainer's accelerator: a mismatch is refused at setup, naming ``device``
and the fixes, instead of Lightning's "Device should be GPU, got cpu" from deep inside the fit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.strategy import check_device_matches_accelerator


def test_matching_device_and_accelerator_pass():
    check_device_matches_accelerator(torch.device("cpu"), CPUAccelerator())
    check_device_matches_accelerator(torch.device("cuda", 0), CUDAAccelerator())
    check_device_matches_accelerator(torch.device("cpu"), None)  # not attached to a Trainer yet


def test_the_default_cpu_device_with_a_gpu_accelerator_names_both_fixes():
    expected = r"device='cpu'\) \(the default\) but the Trainer chose CUDAAccelerator"
    with pytest.raises(ValueError, match=expected) as err:
        check_device_matches_accelerator(torch.device("cpu"), CUDAAccelerator())
    assert "Trainer(accelerator='cpu')" in str(err.value) and "device='cuda:0'" in str(err.value)


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
