"""The device a single-device strategy of ours trains on: the one it was given, else the Trainer's.

Lightning's accelerator connector hands a strategy the Trainer's devices through ``parallel_devices``; a strategy
that has none of its own follows them, as Lightning's own strategies do, so it can be dropped into an existing GPU
``Trainer``. An explicit device the Trainer's accelerator cannot use is refused at setup, naming ``device`` and the
fixes. :class:`~lightning_fedhet.FedHetStrategy` and :class:`~lightning_fedhet.asynchronous.FedASTStrategy` share it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class TrainerDeviceMixin:
    """``root_device``: the explicit ``device``, else the first device of the Trainer the strategy joined, else the
    CPU (no Trainer yet). Mix in before Lightning's ``SingleDeviceStrategy``, whose other arguments it passes on."""

    _trainer_devices: list[torch.device] | None = None

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        #: the explicit ``device``, or None: the Trainer's
        self._explicit_device = None if device is None else torch.device(device)
        # not passed on: Lightning's single-device strategy reads its own device only in the root_device replaced below
        super().__init__(**kwargs)

    @property
    @override
    def root_device(self) -> torch.device:
        """The device clients train on: the explicit ``device``, else the Trainer's (see :func:`resolve_device`)."""
        return resolve_device(self._explicit_device, self._trainer_devices)

    @property
    def parallel_devices(self) -> None:
        """Always ``None`` when read, so that Lightning's accelerator connector hands every Trainer this strategy
        joins its own devices (it fills in a strategy's empty ``parallel_devices``, and would instead adopt a
        non-empty list as the Trainer's, forcing a second Trainer onto the first one's accelerator)."""
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._trainer_devices = list(devices) if devices else None

    @override
    def setup_environment(self) -> None:
        """Refuse an explicit device the Trainer's accelerator cannot use before any work: ``device="cpu"`` with
        ``Trainer(accelerator="gpu")`` would otherwise fail deep inside Lightning with "Device should be GPU, got
        cpu"."""
        check_device_matches_accelerator(self.root_device, self.accelerator, type(self).__name__)
        super().setup_environment()


def resolve_device(device: torch.device | None, trainer_devices: list[torch.device] | None) -> torch.device:
    """The device clients train on: ``device`` when one was given, else the first of ``trainer_devices`` (the
    Trainer's accelerator's devices, which Lightning's accelerator connector hands the strategy; Lightning's own
    single-device strategy takes the first too), else the CPU (no Trainer attached yet)."""
    if device is not None:
        return _indexed(torch.device(device))
    if trainer_devices:
        return _indexed(torch.device(trainer_devices[0]))
    return torch.device("cpu")


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` without an index as ``cuda:<current device>`` (``cuda:0`` where CUDA is not initialised): Lightning's
    ``CUDAAccelerator.setup_device`` calls ``torch.cuda.set_device``, which refuses a device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def check_device_matches_accelerator(
    device: torch.device, accelerator: pl.accelerators.Accelerator | None, strategy: str = "FedHetStrategy"
) -> None:
    """Raise a ``ValueError`` naming ``strategy``'s ``device`` and the two fixes when ``accelerator`` (the Trainer's)
    cannot run on ``device``: a CPU device with a GPU accelerator, or a GPU device with the CPU accelerator."""
    if accelerator is None:
        return
    on_cpu = isinstance(accelerator, pl.accelerators.CPUAccelerator)
    if on_cpu == (device.type == "cpu"):
        return
    kind = type(accelerator).__name__
    if device.type == "cpu":
        raise ValueError(
            f"{strategy}(device='cpu') but the Trainer chose {kind}: pass Trainer(accelerator='cpu') to simulate "
            f"on the CPU, or leave device unset (the Trainer's device) or pass {strategy}(device='cuda:0') (the "
            "accelerator's device) to train the clients there"
        )
    raise ValueError(
        f"{strategy}(device='{device}') but the Trainer chose {kind}: pass the matching "
        f"Trainer(accelerator=...) or {strategy}(device='cpu')"
    )
