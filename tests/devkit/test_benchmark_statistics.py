"""The interval `server_overhead.py --part api` decides issue 24's bar with: default minus native
tracing, same-round pairs, a distribution-free interval for their median."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_median_interval():
    sys.path.insert(0, str(BENCHMARKS))  # (server_overhead imports its neighbours by name)
    try:
        spec = importlib.util.spec_from_file_location("_benchmark_statistics", BENCHMARKS / "server_overhead.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module.median_interval


median_interval = _load_median_interval()


def test_the_sign_test_ranks():
    assert median_interval(list(range(1, 41))) == (13, 27)  # n/2 -+ 1.96 sqrt(n)/2 = 20 -+ 6.2
    assert median_interval([5, 1, 3, 2, 4] * 8)[0] <= 3 <= median_interval([5, 1, 3, 2, 4] * 8)[1]
    assert median_interval([6, 1, 5, 2, 4, 3]) == (1, 6)  # 6 values: the whole range (1 - 2/64 of the time)
    assert median_interval([5, 1, 4, 2, 3]) is None  # fewer: no 95% interval at all


@pytest.mark.parametrize("n", [12, 24, 40])
def test_it_holds_the_true_median_about_95_times_in_100(n):
    rng = random.Random(n)
    trials = 4000
    held = 0
    for _ in range(trials):
        values = [rng.expovariate(1.0) - 0.6931471805599453 for _ in range(n)]  # (skewed, median 0)
        low, high = median_interval(values)
        held += low <= 0 <= high
    assert 0.93 <= held / trials <= 0.995
