"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest

from nodeagent.engine import int4_cpu


@pytest.fixture
def torchs_int4(monkeypatch):
    """int4 projections on torch's kernel, as where the exact kernel cannot run."""
    monkeypatch.setenv("SUPERFLUID_INT4_KERNEL", "0")
    int4_cpu.int4_kernel.cache_clear()
    yield
    monkeypatch.delenv("SUPERFLUID_INT4_KERNEL")
    int4_cpu.int4_kernel.cache_clear()
