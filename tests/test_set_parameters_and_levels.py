"""fit_set_parameters (what each set method fits on the temperature part, as the keywords of the
set functions) and selective_levels (the level each threshold is first tested at)."""

from __future__ import annotations

import numpy as np
import pytest

from hydra_deploy.decisions import (
    SET_METHODS,
    class_scores,
    fit_raps,
    fit_set_parameters,
    prediction_sets,
)
from hydra_deploy.errors import HydraError


def _probs(rng: np.random.Generator, count: int, classes: int = 6) -> np.ndarray:
    z = rng.standard_normal((count, classes)) * 2
    return np.exp(z) / np.exp(z).sum(1, keepdims=True)


@pytest.mark.parametrize("method", ["lac", "aps", "raps"])
def test_the_parameters_are_the_set_functions_keywords(method):
    rng = np.random.default_rng(0)
    probs, labels = _probs(rng, 120), rng.integers(0, 6, 120)
    params = fit_set_parameters(probs, labels, method, 0.1)
    if method == "raps":
        lam, k_reg = fit_raps(probs, labels, 0.1)
        assert params == {"lam": lam, "k_reg": k_reg}
    else:
        assert params == {}
    others = _probs(rng, 30)
    assert class_scores(others, method, **params).shape == (30, 6)
    assert prediction_sets(others, 0.5, method, **params).shape == (30, 6)


def test_every_library_method_is_fitted_and_an_unknown_one_refused():
    rng = np.random.default_rng(1)
    probs, labels = _probs(rng, 60), rng.integers(0, 6, 60)
    for method in SET_METHODS:
        assert isinstance(fit_set_parameters(probs, labels, method, 0.2), dict)
    with pytest.raises(HydraError, match="sets"):
        fit_set_parameters(probs, labels, "nope", 0.2)


def test_selective_levels_are_fit_selectives_first_levels():
    from hydra_deploy.decisions import selective_levels

    bonferroni = selective_levels(50, 0.1, "bonferroni")
    assert bonferroni.shape == (50,) and np.allclose(bonferroni, 0.1 / 50)
    graph = selective_levels(50, 0.1, "graph", start=7)
    assert graph.sum() == pytest.approx(0.1)  # the family-wise error spent in all
    assert graph[7] == pytest.approx(0.05 + 0.001) and graph[0] == pytest.approx(0.001)
