"""Fixtures of the engine tests."""

import pytest

from lightning_fedhet.engines import _compiled


@pytest.fixture
def identity_compile(monkeypatch):
    """torch.compile replaced by the identity: the compiled steps run as the plain functions they compile (so the
    tests that use it compile nothing and may run under mutation testing, see docs/testing.md)."""
    monkeypatch.setattr(_compiled.torch, "compile", lambda fn, **kwargs: fn)
