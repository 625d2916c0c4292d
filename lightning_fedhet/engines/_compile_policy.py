"""How a cohort runs its compiled step: the mode, the recompilation budget, and falling back to the eager step.

A cohort compiles its step when asked (``compile=True`` or a ``torch.compile`` mode). If compiling fails, or one
Python value the step reads keeps changing and forces recompilation after recompilation, the step runs uncompiled from
then on, and one ``RuntimeWarning`` names the cause; the failure is recorded on the cached
:class:`~lightning_fedhet.engines._compiled.CompiledEntry`, so later rounds do not try again.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

from lightning_fedhet.engines._compiled import COMPILE_MODES, CompiledEntry, LogCollector

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


RECOMPILE_LIMIT = "recompile_limit" if "recompile_limit" in dir(torch._dynamo.config) else "cache_size_limit"


@contextmanager
def recompile_budget():
    """Room for one compilation per cohort-size bucket (and per optimizer configuration) of a long run.

    Dynamo stops compiling a function after ``recompile_limit`` variants and then runs it eagerly; the compiled
    step legitimately has one variant per bucket, so the limit is raised for its calls only.
    """
    config = torch._dynamo.config
    name = RECOMPILE_LIMIT
    previous = getattr(config, name)
    if previous >= 64:
        yield
        return
    # set and restore directly: ``config.patch`` costs ~25 us, paid at every local step of every round
    setattr(config, name, 64)
    try:
        yield
    finally:
        setattr(config, name, previous)


def compile_mode(compile: bool | str) -> str | None:
    if compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(f"compile must be False, True or one of {COMPILE_MODES}, got {compile!r}")


@contextmanager
def logging_to(module: nn.Module, collector: LogCollector):
    """Route ``module.log`` to ``collector`` for the duration of a vmapped step."""
    original = module.log
    module.log = collector
    try:
        yield
    finally:
        module.log = original


def gave_up_recompiling(entry: CompiledEntry) -> bool:
    """Whether ``entry``'s last call showed it recompiling for every new value of a Python attribute; if so, mark it
    failed (no later round compiles it again) and warn once, naming the cause."""
    cause = entry.recompile_cause()
    if cause is None or entry.failed is not None:
        return False
    entry.failed = cause
    warnings.warn(
        f"torch.compile kept recompiling the vmap cohort step: {cause}. Running it uncompiled from here",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


def warn_compile_failed(entry: CompiledEntry, err: Exception) -> None:
    """Record the failure on the cached entry (so no later round retries) and warn once."""
    if entry.failed is not None:
        return
    cause = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:400]
    entry.failed = cause
    warnings.warn(
        f"torch.compile could not compile the vmap cohort step ({cause}); running it uncompiled",
        RuntimeWarning,
        stacklevel=3,
    )
