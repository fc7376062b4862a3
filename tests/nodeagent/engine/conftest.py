"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest

from nodeagent.engine import cpu_kernels


@pytest.fixture
def torchs_kernels(monkeypatch):
    """Quantized projections on torch's kernels, as where the node's CPU kernels cannot run."""
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    cpu_kernels.cpu_kernels.cache_clear()
    yield
    monkeypatch.delenv("SUPERFLUID_CPU_KERNELS")
    cpu_kernels.cpu_kernels.cache_clear()
