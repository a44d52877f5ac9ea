"""The set scores' fitted parameters as the benchmark uses them (``set_score(m).fit`` on the
temperature part, then the set functions), and selective_levels (the level each threshold is first
tested at)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from hydra_deploy.decisions import (
    SET_METHODS,
    class_scores,
    fit_raps,
    prediction_sets,
    selective_levels,
)
from hydra_deploy.errors import HydraError
from hydra_deploy.set_scores import set_score


def _probs(rng: np.random.Generator, count: int, classes: int = 6) -> np.ndarray:
    z = rng.standard_normal((count, classes)) * 2
    return np.exp(z) / np.exp(z).sum(1, keepdims=True)


@pytest.mark.parametrize("method", SET_METHODS)
def test_the_fitted_parameters_drive_the_set_functions(method):
    rng = np.random.default_rng(0)
    probs, labels = _probs(rng, 120), rng.integers(0, 6, 120)
    params = set_score(method).fit(probs, labels, 0.1)
    if method == "raps":
        lam, k_reg = fit_raps(probs, labels, 0.1)
        assert asdict(params) == {"lam": lam, "k_reg": k_reg}
    else:
        assert asdict(params) == {}
    others = _probs(rng, 30)
    scores = class_scores(others, method, params)
    assert scores.shape == (30, 6)
    sets = prediction_sets(others, 0.5, method, params)
    assert sets.shape == (30, 6)
    if method == "raps":  # the object and its keywords are the same parameters
        assert np.array_equal(scores, class_scores(others, method, lam=lam, k_reg=k_reg))


def test_an_unknown_method_is_refused_naming_the_registered_ones():
    with pytest.raises(HydraError, match=r"sets.*lac"):
        set_score("nope")


def test_selective_levels_are_fit_selectives_first_levels():
    bonferroni = selective_levels(50, 0.1, "bonferroni")
    assert bonferroni.shape == (50,) and np.allclose(bonferroni, 0.1 / 50)
    graph = selective_levels(50, 0.1, "graph", start=7)
    assert graph.sum() == pytest.approx(0.1)  # the family-wise error spent in all
    assert graph[7] == pytest.approx(0.05 + 0.001) and graph[0] == pytest.approx(0.001)
