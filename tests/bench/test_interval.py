"""The interval `make bench` prints beside a median of paired trials (`serve.median_interval`)."""

import random
import statistics
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from serve import median_interval  # noqa: E402


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=60))
def test_the_interval_is_two_of_the_values_around_their_median(values):
    low, high = median_interval(values)
    assert low in values and high in values
    assert low <= statistics.median(values) <= high


def test_of_27_values_it_takes_the_8th_and_20th_smallest():
    values = random.Random(3).sample(range(1000), 27)
    assert median_interval(values) == (sorted(values)[7], sorted(values)[19])


def test_it_holds_the_true_median_at_least_as_often_as_it_says():
    rng = random.Random(8)
    for n in (9, 27, 40):
        intervals = [median_interval([rng.gauss(0, 1) for _ in range(n)]) for _ in range(2000)]
        held = sum(low <= 0 <= high for low, high in intervals)
        assert 0.95 <= held / 2000 <= 0.995, (n, held)
