"""selective_risk_at: the error rate of the most confident share, at given coverages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.errors import HydraError
from hydra_deploy.uncertainty.metrics import selective_risk_at

COVERAGES = tuple(round(0.05 * i, 2) for i in range(1, 21))


def test_reads_the_most_confident_share():
    confidence = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    correct = ~np.array([0, 0, 0, 0, 1, 0, 1, 1, 1, 1], dtype=bool)
    curve = list(selective_risk_at(confidence, correct, COVERAGES))
    assert curve[COVERAGES.index(0.4)] == 0.0  # the 4 most confident are right
    assert curve[COVERAGES.index(0.5)] == pytest.approx(1 / 5)
    assert curve[COVERAGES.index(1.0)] == pytest.approx(5 / 10)
    assert curve[0] == 0.0  # 5% of 10: the top one


def test_ties_are_taken_in_input_order():
    confidence = np.array([0.5, 0.5, 0.5, 0.5])
    assert selective_risk_at(confidence, [False, True, True, True], [0.25]) == [1.0]
    assert selective_risk_at(confidence, [True, False, True, True], [0.25]) == [0.0]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=40),
    st.floats(0.01, 1.0),
)
def test_equals_counting_the_answered(pairs, coverage):
    confidence = np.array([c for c, _ in pairs])
    correct = np.array([ok for _, ok in pairs])
    (got,) = selective_risk_at(confidence, correct, [coverage])
    order = sorted(range(len(pairs)), key=lambda i: -confidence[i])  # stable: input order
    answered = order[: max(1, int(np.ceil(coverage * len(pairs) - 1e-9)))]
    assert got == pytest.approx(np.mean([not correct[i] for i in answered]))


@pytest.mark.parametrize("coverages", [[], [0.0], [1.5], [-0.1]])
def test_refuses_coverages_outside_zero_one(coverages):
    with pytest.raises(HydraError, match="coverages must be shares"):
        selective_risk_at([0.9, 0.1], [True, False], coverages)
