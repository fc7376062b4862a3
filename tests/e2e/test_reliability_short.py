"""A short run of each `make reliability` row (the full sizes take minutes): each must come out
clean, against a node process of its own. The torch soak has no short run: its reference
tokens take a while to compute, and its node warms up (RSS growing) for about a minute."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))

import scenarios  # noqa: E402
from harness import table  # noqa: E402

SHORT = [(scenario, short) for scenario, _, short in scenarios.ROWS if short is not None]


@pytest.mark.parametrize("scenario, size", SHORT, ids=[s.__name__ for s, _ in SHORT])
def test_a_short_run_of_the_row_is_clean(scenario, size):
    row = scenario(**size)
    assert row.clean(), table([row])
