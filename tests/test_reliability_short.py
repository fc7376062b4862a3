"""A short run of each `make reliability` row (the full sizes take minutes): each must come out
clean, against a node process of its own."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "reliability"))

import scenarios  # noqa: E402
from harness import table  # noqa: E402

SHORT = [
    (scenarios.cuts, {"trials": 20}),
    (scenarios.fuzz, {"frames": 600}),
    (scenarios.slow_peers, {"peers": 60}),
    (scenarios.auth, {"probes": 8}),
    (scenarios.leases, {"sessions": 10}),
    (scenarios.drain, {"heads": 2}),
    (scenarios.bounds, {"sessions": 500, "big_frames": 4}),
]


@pytest.mark.parametrize("scenario, size", SHORT, ids=[s.__name__ for s, _ in SHORT])
def test_a_short_run_of_the_row_is_clean(scenario, size):
    row = scenario(**size)
    assert row.clean(), table([row])
