"""hydra_deploy.decisions: each guarantee as a property over many random splits of exchangeable
synthetic data, the definitions against brute force and scipy, the record, and the refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from hydra_deploy.decisions import (
    DECISION_MARGIN,
    SET_TOLERANCE,
    _graph_rejections,
    accept_mask,
    apply_decisions,
    binomial_cdf,
    binomial_upper_bound,
    calibrated_scores,
    class_scores,
    conformal_quantile,
    decision_metrics,
    fit_decisions,
    fit_raps,
    fit_selective,
    fit_temperature,
    min_calibration_size,
    ood_mask,
    prediction_sets,
    selective_grid,
    selective_pvalues,
    selective_start,
    set_floor,
    temperature_nll,
    temperature_warning,
)
from hydra_deploy.errors import DataError, ParameterError
from hydra_deploy.export_folder import (
    DecisionRecord,
    ExportFolderError,
    ExportInfo,
    OodRule,
    SelectiveRule,
    SetRule,
)
from hydra_deploy.set_scores import SET_METHODS, SET_SCORES, RapsParams
from hydra_deploy.uncertainty import ece, ensemble_scores

SHA = "0" * 64
DATA = "1" * 64


def population(count: int, classes: int = 6, members: int = 3, seed: int = 0, sharp: float = 2.0):
    """Exchangeable labelled member logits: a shared signal plus member noise, labels drawn from a
    softmax of the signal at temperature 1/``sharp`` (so the raw ensemble is not calibrated)."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(0.0, 1.5, (count, classes))
    p = np.exp(sharp * signal)
    p /= p.sum(axis=1, keepdims=True)
    labels = (p.cumsum(axis=1) > rng.random((count, 1))).argmax(axis=1)
    logits = signal[:, None, :] + rng.normal(0.0, 0.6, (count, members, classes))
    return logits, labels


@pytest.fixture(scope="module")
def pool():
    return population(60_000)


def _splits(pool, n_cal: int, n_test: int, count: int, seed: int):
    logits, labels = pool
    rng = np.random.default_rng(seed)
    for _ in range(count):
        rows = rng.choice(len(labels), n_cal + n_test, replace=False)
        yield (
            (logits[rows[:n_cal]], labels[rows[:n_cal]]),
            (logits[rows[n_cal:]], labels[rows[n_cal:]]),
        )


def _mc_margin(values: np.ndarray) -> float:
    """Four standard errors of a mean over splits (the Monte Carlo error allowed)."""
    return 4.0 * float(np.std(values, ddof=1)) / math.sqrt(len(values))


# --- the guarantees, over many random splits ------------------------------------------------------
@pytest.mark.parametrize("method", SET_METHODS)
@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_split_conformal_sets_cover_at_least_1_minus_alpha(pool, method, alpha):
    n = 150
    coverage = []
    for (cal_z, cal_y), (test_z, test_y) in _splits(pool, 2 * n, 1000, 300, seed=int(alpha * 100)):
        p_cal = ensemble_scores(cal_z, dtype=np.float64)["probs"]
        params = SET_SCORES[method].fit(p_cal[:n], cal_y[:n], alpha)
        scores = class_scores(p_cal[n:], method, params)
        qhat = conformal_quantile(scores[np.arange(n), cal_y[n:]], alpha)
        p_test = ensemble_scores(test_z, dtype=np.float64)["probs"]
        sets = prediction_sets(p_test, qhat, method, params)
        coverage.append(sets[np.arange(len(test_y)), test_y].mean())
    coverage = np.array(coverage)
    margin = _mc_margin(coverage)
    assert coverage.mean() >= 1 - alpha - margin
    if method == "lac":  # continuous scores: coverage is also at most 1 - alpha + 1/(n + 1)
        assert coverage.mean() <= 1 - alpha + 1 / (n + 1) + margin


def test_fit_decisions_end_to_end_guarantees(pool):
    """The whole fit (T on one part, quantiles on the other): set coverage >= 1 - alpha, the
    selective risk above its target in at most delta of the splits, ID flagged <= alpha_ood."""
    alpha, risk, delta, ood_alpha = 0.1, 0.2, 0.1, 0.05
    coverage, violated, flagged, answered = [], [], [], []
    for i, ((cal_z, cal_y), (test_z, test_y)) in enumerate(_splits(pool, 1000, 4000, 200, seed=7)):
        record = fit_decisions(
            cal_z,
            cal_y,
            onnx_sha256=SHA,
            data_sha256=DATA,
            alpha=alpha,
            risk=risk,
            delta=delta,
            ood_alpha=ood_alpha,
            seed=i,
        )
        decided = apply_decisions(test_z, record)
        coverage.append(decided["prediction_set"][np.arange(len(test_y)), test_y].mean())
        accept = decided["accept"]
        errors = decided["prediction"] != test_y
        violated.append(errors[accept].mean() > risk if accept.any() else False)
        answered.append(accept.mean())
        flagged.append(decided["ood_flag"].mean())
    coverage, violated, flagged = map(np.array, (coverage, violated, flagged))
    assert coverage.mean() >= 1 - alpha - _mc_margin(coverage)
    # the population risk exceeds the target with probability <= delta; a finite test part adds
    # its own noise, so allow the Monte Carlo error of a share over 200 splits
    assert violated.mean() <= delta + 4 * math.sqrt(delta * (1 - delta) / len(violated))
    assert flagged.mean() <= ood_alpha + _mc_margin(flagged)
    assert np.mean(answered) > 0.2  # the guarantee is not bought by answering nothing


def test_class_conditional_sets_cover_every_class(pool):
    alpha, n = 0.1, 3000
    per_class = []
    for (cal_z, cal_y), (test_z, test_y) in _splits(pool, n, 6000, 60, seed=3):
        p_cal = ensemble_scores(cal_z, dtype=np.float64)["probs"]
        scores = class_scores(p_cal, "lac")
        true = scores[np.arange(n), cal_y]
        qhat = np.array([conformal_quantile(true[cal_y == c], alpha) for c in range(6)])
        sets = prediction_sets(ensemble_scores(test_z, dtype=np.float64)["probs"], qhat, "lac")
        covered = sets[np.arange(len(test_y)), test_y]
        per_class.append([covered[test_y == c].mean() for c in range(6)])
    per_class = np.array(per_class)
    for c in range(6):
        assert per_class[:, c].mean() >= 1 - alpha - _mc_margin(per_class[:, c])


# --- definitions ---------------------------------------------------------------------------------
@given(n=st.integers(1, 400), alpha=st.floats(0.001, 0.999))
def test_conformal_quantile_is_the_corrected_order_statistic(n, alpha):
    scores = np.random.default_rng(n).random(n)
    rank = math.ceil((n + 1) * (1 - alpha) - 1e-9)
    if rank > n:
        with pytest.raises(DataError, match=f"needs at least {min_calibration_size(alpha)}"):
            conformal_quantile(scores, alpha)
        assert n < min_calibration_size(alpha)
    else:
        assert conformal_quantile(scores, alpha) == np.sort(scores)[max(rank, 1) - 1]
        assert n >= min_calibration_size(alpha)


@pytest.mark.parametrize(("alpha", "n"), [(0.1, 9), (0.05, 19), (0.02, 49), (0.01, 99), (0.5, 1)])
def test_min_calibration_size(alpha, n):
    assert min_calibration_size(alpha) == n
    conformal_quantile(np.zeros(n), alpha)
    if n > 1:
        with pytest.raises(DataError, match=f"calibration examples: {n - 1} given, too few"):
            conformal_quantile(np.zeros(n - 1), alpha)


def _aps_brute(p: np.ndarray, lam: float = 0.0, k_reg: int = 0) -> np.ndarray:
    """APS/RAPS scores from their definition, one class at a time."""
    out = np.zeros_like(p)
    for b, row in enumerate(p):
        for y in range(len(row)):
            # classes ranked at or above y: larger p, or equal p and a lower index
            above = [j for j in range(len(row)) if row[j] > row[y] or (row[j] == row[y] and j <= y)]
            out[b, y] = sum(row[j] for j in above) + lam * max(0, len(above) - k_reg)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    classes=st.integers(1, 7),
    lam=st.sampled_from([0.0, 0.01, 0.3]),
    k_reg=st.integers(0, 3),
)
def test_aps_and_raps_scores_follow_their_definition_with_ties(seed, classes, lam, k_reg):
    rng = np.random.default_rng(seed)
    logits = rng.integers(-2, 3, (5, classes)).astype(np.float64)  # many ties
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    method = "raps" if lam else "aps"
    np.testing.assert_allclose(
        class_scores(p, method, lam=lam, k_reg=k_reg), _aps_brute(p, lam, k_reg), atol=1e-12
    )
    qhat = float(rng.random())
    sets = prediction_sets(p, qhat, method, lam=lam, k_reg=k_reg)
    top = np.argsort(-p, axis=1, kind="stable")[:, 0]
    assert sets[np.arange(5), top].all()  # never empty
    expected = _aps_brute(p, lam, k_reg) <= qhat
    expected[np.arange(5), top] = True
    np.testing.assert_array_equal(sets, expected)
    lac = prediction_sets(p, qhat, "lac")
    np.testing.assert_array_equal(lac, p >= 1 - qhat)


def test_temperature_is_the_nll_minimiser():
    logits, labels = population(3000, members=1, sharp=0.5)  # over-confident: T > 1
    t = fit_temperature(logits, labels)
    reference = optimize.minimize_scalar(
        lambda log_t: temperature_nll(logits, labels, math.exp(log_t)),
        bounds=(math.log(0.05), math.log(20)),
        method="bounded",
    )
    assert t == pytest.approx(math.exp(reference.x), rel=1e-3)
    assert t == pytest.approx(2.0, rel=0.15)  # labels drawn at temperature 1 / 0.5
    assert temperature_nll(logits, labels, t) < temperature_nll(logits, labels, 1.0)


def test_temperature_stays_in_its_bounds():
    logits = np.zeros((4, 2, 3))
    logits[:, :, 0] = 1.0
    labels = np.array([1, 2, 1, 2])  # always wrong: the NLL falls as T grows
    assert fit_temperature(logits, labels) == pytest.approx(20.0)


@given(n=st.integers(1, 300), k=st.integers(0, 300), p=st.floats(0.001, 0.999))
def test_binomial_cdf_equals_scipy(n, k, p):
    k = min(k, n)
    assert binomial_cdf(k, n, p) == pytest.approx(stats.binom.cdf(k, n, p), rel=1e-9, abs=1e-300)


@given(n=st.integers(1, 500), k=st.integers(0, 500), level=st.floats(0.001, 0.5))
def test_upper_bound_is_clopper_pearson(n, k, level):
    k = min(k, n - 1)
    expected = stats.beta.ppf(1 - level, k + 1, n - k)
    assert binomial_upper_bound(k, n, level) == pytest.approx(expected, abs=1e-9)


def test_bonferroni_threshold_is_the_lowest_certified_on_a_fixed_grid():
    rng = np.random.default_rng(0)
    confidence = rng.random(2000)
    correct = rng.random(2000) < confidence  # more confident, more often right
    grid = selective_grid(rng.random(500))
    assert len(grid) <= 50 and np.all(np.diff(grid) > 0)
    tau, details = fit_selective(confidence, correct, grid, 0.1, 0.1, procedure="bonferroni")
    assert details["procedure"] == "bonferroni"
    level = 0.1 / len(grid)
    for threshold in grid:
        answered = confidence >= threshold + DECISION_MARGIN  # the deployed comparison
        k, n = int((~correct[answered]).sum()), int(answered.sum())
        certified = n > 0 and stats.binom.cdf(k, n, 0.1) <= level
        if threshold < tau:
            assert not certified
        elif threshold == tau:
            assert certified
    assert details["coverage"] == pytest.approx((confidence >= tau + DECISION_MARGIN).mean())


def _bretz_reference(pvalues: np.ndarray, weights: np.ndarray, graph: np.ndarray, delta: float):
    """Bretz et al. (2009)'s sequentially rejective graph algorithm, written out in full (the
    weight and transition updates of their Algorithm 1), on any graph."""
    w, g = weights.astype(float).copy(), graph.astype(float).copy()
    active = set(range(len(pvalues)))
    rejected = set()
    while True:
        hits = [j for j in sorted(active) if pvalues[j] <= w[j] * delta]
        if not hits:
            return rejected
        j = hits[-1]  # another order than the library's: the result must not depend on it
        active.remove(j)
        rejected.add(j)
        new_w, new_g = w.copy(), np.zeros_like(g)
        for i in active:
            new_w[i] = w[i] + w[j] * g[j, i]
            for k in active:
                if i != k:
                    denominator = 1.0 - g[i, j] * g[j, i]
                    if denominator > 0:
                        new_g[i, k] = (g[i, k] + g[i, j] * g[j, k]) / denominator
        new_w[j] = 0.0
        w, g = new_w, new_g


@settings(max_examples=200, deadline=None)
@given(
    pvalues=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
    start=st.integers(0, 29),
    delta=st.floats(0.01, 0.3),
)
def test_graph_test_is_bretz_algorithm_on_the_chain(pvalues, start, delta):
    p = np.asarray(pvalues)
    start = start % len(p)
    # a p-value exactly at a level the weights can reach is a tie that float sums in another
    # order may put on either side: left out (it has probability 0 on real data)
    levels = np.arange(2 * len(p) + 1) * delta / (2 * len(p))
    assume(np.abs(p[:, None] - levels[None, :]).min() > 1e-9)
    weights = np.full(len(p), 0.5 / len(p))
    weights[start] += 0.5
    chain = np.zeros((len(p), len(p)))
    for j in range(1, len(p)):
        chain[j, j - 1] = 1.0  # a rejected threshold passes its level to the next lower one
    assert set(_graph_rejections(p, start, delta)) == _bretz_reference(p, weights, chain, delta)
    # it rejects at least what its two halves reject alone: Bonferroni at delta / 2, and the
    # fixed sequence at delta / 2 down from the start
    assert set(np.flatnonzero(p <= delta / 2 / len(p))) <= set(_graph_rejections(p, start, delta))
    sequence = []
    for j in range(start, -1, -1):
        if p[j] > delta / 2:
            break
        sequence.append(j)
    assert set(sequence) <= set(_graph_rejections(p, start, delta))


def _selective_world(rng, count: int):
    """Confidences and correctness with a known risk curve: P(error | c) = 0.3 (1 - c)^2 on
    c ~ U(0, 1), so the selective risk of answering c >= tau is 0.1 (1 - tau)^2."""
    confidence = rng.random(count)
    correct = rng.random(count) >= 0.3 * (1 - confidence) ** 2
    return confidence, correct


def test_graph_procedure_keeps_its_guarantee_and_answers_more():
    # P(selective risk > target) <= delta over fresh calibration data from a population whose
    # risk curve is known exactly (no finite test part to add its own noise); the graph answers
    # at least as much as Bonferroni on average
    rng = np.random.default_rng(7)
    target, delta, trials = 0.05, 0.1, 400
    failures, graph_cov, bonf_cov = [], [], []
    for _ in range(trials):
        tune_c, tune_ok = _selective_world(rng, 200)
        held_c, held_ok = _selective_world(rng, 200)
        grid = selective_grid(tune_c)
        start = selective_start(tune_c, tune_ok, grid, target, len(held_c))
        for procedure, coverages in (("graph", graph_cov), ("bonferroni", bonf_cov)):
            try:
                tau, _ = fit_selective(
                    held_c, held_ok, grid, target, delta, procedure=procedure, start=start
                )
            except DataError:
                coverages.append(0.0)
                continue
            tau += DECISION_MARGIN  # what is answered: confidence >= tau + margin
            coverages.append(1.0 - tau)
            if procedure == "graph":
                failures.append(0.1 * (1 - tau) ** 2 > target)
    failures = np.asarray(failures, dtype=float)
    assert failures.mean() <= delta + 3 * math.sqrt(delta * (1 - delta) / len(failures))
    assert np.mean(graph_cov) > np.mean(bonf_cov)


def test_selective_start_is_fixed_by_the_temperature_part():
    rng = np.random.default_rng(3)
    tune_c, tune_ok = _selective_world(rng, 300)
    grid = selective_grid(tune_c)
    start = selective_start(tune_c, tune_ok, grid, 0.05, 300)
    assert 0 <= start < len(grid)
    # the predicted p-value is smallest there
    pvalues = selective_pvalues(tune_c, tune_ok, grid, 0.05)
    assert pvalues[start] <= np.median(pvalues)


def test_graph_procedure_needs_a_start():
    with pytest.raises(ParameterError, match=r"start.*selective_start"):
        fit_selective(np.ones(10), np.ones(10, bool), np.array([0.5]), 0.1, 0.1)


def test_unreachable_risk_names_the_best_achievable():
    rng = np.random.default_rng(1)
    confidence, correct = rng.random(300), rng.random(300) < 0.7  # confidence says nothing
    grid = selective_grid(rng.random(300))
    with pytest.raises(
        DataError,
        match=r"no threshold reaches a selective risk of 0.01 .* best these data can guarantee is 0\.\d+",
    ):
        fit_selective(confidence, correct, grid, 0.01, 0.1, procedure="bonferroni")
    with pytest.raises(DataError, match=r"best these data can guarantee is 0\.\d+"):
        fit_selective(confidence, correct, grid, 0.01, 0.1, start=len(grid) // 2)


# --- the whole fit and its application ----------------------------------------------------------
def test_record_round_trips_through_json_and_hydra_json(tmp_path):
    logits, labels = population(800)
    record = fit_decisions(
        logits,
        labels,
        onnx_sha256=SHA,
        data_sha256=DATA,
        sets="raps",
        risk=0.3,
        ood_score="mutual_information",
    )
    again = DecisionRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record
    info = ExportInfo.from_record(
        {"format": "hydra-export/1", "decisions": record.to_dict()}, tmp_path / "hydra.json"
    )
    assert info.decisions == record
    conditional = fit_decisions(
        logits, labels, onnx_sha256=SHA, data_sha256=DATA, class_conditional=True, alpha=0.2
    )
    assert len(conditional.sets.qhat) == 6
    assert DecisionRecord.from_dict(json.loads(json.dumps(conditional.to_dict()))) == conditional


@pytest.mark.parametrize("method", SET_METHODS)
def test_every_set_score_fits_and_its_record_round_trips(method):
    logits, labels = population(600)
    record = fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA, sets=method)
    assert record.sets.method == method
    assert isinstance(record.sets.params, SET_SCORES[method].Params)
    if method == "raps":  # the function before the registry
        probs = calibrated_scores(logits, 1.0)["probs"]
        params = SET_SCORES["raps"].fit(probs[:300], labels[:300], 0.1)
        assert fit_raps(probs[:300], labels[:300], 0.1) == (params.lam, params.k_reg)
    text = json.dumps(record.to_dict())
    again = DecisionRecord.from_dict(json.loads(text))
    assert again == record and json.dumps(again.to_dict()) == text
    conditional = fit_decisions(
        logits, labels, onnx_sha256=SHA, data_sha256=DATA, sets=method, class_conditional=True,
        alpha=0.3,
    )  # fmt: skip
    assert DecisionRecord.from_dict(json.loads(json.dumps(conditional.to_dict()))) == conditional


@pytest.mark.parametrize(
    ("entry", "params"),
    [
        ({"method": "lac", "alpha": 0.1, "class_conditional": False, "qhat": 0.8}, None),
        ({"method": "aps", "alpha": 0.05, "class_conditional": True, "qhat": [0.7, 0.9]}, None),
        (
            {"method": "raps", "alpha": 0.1, "class_conditional": False, "qhat": 0.95},
            RapsParams(0.01, 2),
        ),
    ],
)
def test_records_of_the_first_set_scores_read_and_rewrite_the_same(entry, params):
    # as hydra-deploy wrote them before the registry: RAPS's lambda and k_reg in every record
    old = {**entry, "lambda": 0.0 if params is None else 0.01, "k_reg": 0 if params is None else 2}
    rule = SetRule.from_dict(old, "test", num_classes=2)
    assert rule.to_dict() == old and list(rule.to_dict()) == list(old)
    assert rule.params == (params or SET_SCORES[entry["method"]].Params())
    assert (rule.lam, rule.k_reg) == (old["lambda"], old["k_reg"])  # the fields before params
    if params is not None:  # given by name, as before params; checked on read
        assert SetRule("raps", 0.1, (0.95,), lam=0.01, k_reg=2) == rule
        with pytest.raises(ExportFolderError, match="malformed k_reg"):
            SetRule.from_dict({**old, "k_reg": -1}, "test", num_classes=2)
        with pytest.raises(ExportFolderError, match="malformed lambda"):
            SetRule.from_dict({**old, "lambda": None}, "test", num_classes=2)


def test_set_score_parameters_are_checked():
    with pytest.raises(ParameterError, match=r"^sets must be one of lac, aps, raps"):
        prediction_sets(np.full((1, 3), 1 / 3), 0.5, "naive")
    with pytest.raises(ParameterError, match="LAC sets have no parameter lamda"):
        class_scores(np.full((1, 3), 1 / 3), "lac", lamda=0.1)
    with pytest.raises(ParameterError, match="APS sets take NoParams parameters"):
        SetRule("aps", 0.1, (0.5,), params=RapsParams())
    # RAPS's names, given for every method as the calls before the registry did: ignored
    assert SetRule("lac", 0.1, (0.5,), lam=0.0, k_reg=0) == SetRule("lac", 0.1, (0.5,))
    np.testing.assert_array_equal(
        class_scores(np.array([[0.5, 0.3, 0.2]]), "aps", lam=0.0, k_reg=0),
        class_scores(np.array([[0.5, 0.3, 0.2]]), "aps"),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "hydra-decisions/9"}, "this version reads 'hydra-decisions/1'"),
        ({"temperature": -1.0}, "malformed temperature"),
        ({"temperature": float("nan")}, "malformed temperature"),
        ({"onnx_sha256": "xyz"}, "malformed onnx_sha256"),
        ({"num_classes": 0}, "malformed num_classes"),
        (
            {"sets": {"method": "naive", "alpha": 0.1, "qhat": 0.5, "lambda": 0, "k_reg": 0}},
            "malformed method",
        ),
        (
            {"sets": {"method": "lac", "alpha": 1.5, "qhat": 0.5, "lambda": 0, "k_reg": 0}},
            "malformed alpha",
        ),
        (
            {
                "sets": {
                    "method": "lac",
                    "alpha": 0.1,
                    "qhat": [0.5],
                    "lambda": 0,
                    "k_reg": 0,
                    "class_conditional": True,
                }
            },
            "malformed qhat",
        ),
        (
            {
                "selective": {
                    "score": "msp",
                    "target_risk": 0.1,
                    "delta": 0.0,
                    "tau": 0.5,
                    "grid_size": 5,
                    "coverage": 0.5,
                }
            },
            "malformed delta",
        ),
        ({"ood": {"score": "energy", "alpha": 0.05, "threshold": 1.0}}, "malformed score"),
        ({"ood": [1]}, "malformed ood"),
        ({"in_graph": "yes"}, "malformed in_graph"),
    ],
)
def test_malformed_records_are_refused_with_the_refit_command(change, message):
    logits, labels = population(400)
    record = fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA, risk=0.4).to_dict()
    with pytest.raises(ExportFolderError, match=message) as caught:
        DecisionRecord.from_dict({**record, **change})
    assert "hydra-calibrate" in str(caught.value)


def test_a_record_for_another_model_is_refused():
    record = DecisionRecord(1.0, 3, SHA, DATA, 10, 10, 0.5, 0, sets=SetRule("lac", 0.1, (0.5,)))
    record.check_fitted_on(SHA, "export/x")
    with pytest.raises(
        ExportFolderError,
        match=r"fitted on another model.onnx than export/x .* hydra-calibrate export/x",
    ):
        record.check_fitted_on("f" * 64, "export/x")


def test_apply_decisions_follows_each_rule():
    logits, labels = population(600, seed=5)
    record = DecisionRecord(
        temperature=1.7,
        num_classes=6,
        onnx_sha256=SHA,
        data_sha256=DATA,
        n_temperature=300,
        n_quantile=300,
        holdout=0.5,
        seed=0,
        sets=SetRule("lac", 0.1, (0.8,)),
        selective=SelectiveRule("predictive_entropy", 0.1, 0.1, 0.9, 50, 0.5),
        ood=OodRule("msp", 0.05, -0.4),
    )
    out = apply_decisions(logits, record)
    calibrated = ensemble_scores(logits / 1.7, dtype=np.float64)
    np.testing.assert_allclose(out["calibrated_probs"], calibrated["probs"], rtol=1e-6)
    np.testing.assert_array_equal(out["prediction_set"], calibrated["probs"] >= 1 - 0.8)
    np.testing.assert_array_equal(out["accept"], calibrated["predictive_entropy"] <= 0.9)
    np.testing.assert_array_equal(out["ood_flag"], calibrated["msp"] < 0.4)
    metrics = decision_metrics(logits, labels, record)
    assert metrics["coverage"] == pytest.approx(
        out["prediction_set"][np.arange(600), labels].mean()
    )
    raw = ensemble_scores(logits, dtype=np.float64)["probs"]
    assert metrics["ece_raw"] == pytest.approx(ece(raw, labels))
    assert metrics["ece"] == pytest.approx(ece(calibrated["probs"], labels), abs=1e-6)
    unlabelled = decision_metrics(logits, None, record)
    assert set(unlabelled) == {"count", "mean_set_size", "empty_sets", "answered", "flag_rate"}


def test_nonfinite_logits_abstain_and_are_flagged_only_when_allowed():
    logits, labels = population(300)
    record = fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA, risk=0.4)
    bad = logits[:4].copy()
    bad[1, 0, 2] = np.nan
    with pytest.raises(Exception, match="NaN or infinite"):
        apply_decisions(bad, record)
    out = apply_decisions(bad, record, allow_nonfinite=True)
    assert out["prediction"][1] == -1 and not out["prediction_set"][1].any()
    assert not out["accept"][1] and out["ood_flag"][1]
    assert np.isnan(out["calibrated_probs"][1]).all()


# --- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"alpha": 0.0}, ParameterError, "alpha must be in"),
        ({"alpha": 1.0}, ParameterError, "alpha must be in"),
        ({"risk": 1.2}, ParameterError, "risk must be in"),
        ({"risk": 0.1, "delta": -0.1}, ParameterError, "delta must be in"),
        ({"ood_alpha": 2}, ParameterError, "ood_alpha must be in"),
        ({"holdout": 1.0}, ParameterError, "holdout must be in"),
        ({"sets": "naive"}, ParameterError, "sets must be one of lac, aps, raps"),
        ({"ood_score": "energy"}, ParameterError, "ood_score must be one of"),
        (
            {"alpha": 0.001},
            DataError,
            r"120 calibration examples \(60 for the temperature, 60 for the thresholds\) are too "
            r"few for prediction sets: alpha 0.001 needs at least 999 for the thresholds, so at "
            "least 1998 in all; give more labelled data, or a larger alpha",
        ),
        (
            {"alpha": 0.001, "holdout": 0.3},
            DataError,
            r"\(84 for the temperature, 36 for the thresholds\) .* so at least 3329 in all",
        ),
        (
            {"alpha": None, "ood_alpha": 0.001},
            DataError,
            "too few for the OOD flag: ood_alpha 0.001 needs at least 999 for the thresholds, so "
            "at least 1998 in all",
        ),
        (
            {"risk": 0.0001},
            DataError,
            r"on 120 calibration examples \(60 for the temperature, 60 for the thresholds\), "
            "tested on the ones for the thresholds: the best these data can guarantee is",
        ),
        (
            {"class_conditional": True, "class_names": list("abcdef")},
            DataError,
            r"are too few for class-conditional sets: class \d \([a-f]\) .*has \d+ of the 60 "
            "for the thresholds",
        ),
    ],
)
def test_fit_refusals_are_one_line(kwargs, error, message):
    logits, labels = population(120)
    labels[labels == 5] = 0
    labels[:3] = 5  # class 5 is rare
    with pytest.raises(error, match=message) as caught:
        fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA, **kwargs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("logits", "labels", "message"),
    [
        (np.zeros((5, 2, 3)), np.array([0, 1, 2, 3, 0]), "outside the model's classes 0..2"),
        (np.zeros((5, 2, 3)), np.array([0, 1, -1, 0, 0]), "outside the model's classes"),
        (np.zeros((5, 2, 3)), np.array([0.5, 1, 1, 0, 0]), "class indices"),
        (np.zeros((5, 2, 3)), np.array([0, 1]), "one class index per example"),
        (np.full((5, 2, 3), np.inf), np.zeros(5, int), "NaN or infinite"),
        (np.zeros((5, 3)), np.zeros(5, int), "examples, members, classes"),
    ],
)
def test_bad_data_is_refused(logits, labels, message):
    with pytest.raises(DataError, match=message):
        fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA)


def test_one_class_and_extreme_logits():
    logits = np.zeros((40, 2, 1))
    record = fit_decisions(logits, np.zeros(40, int), onnx_sha256=SHA, data_sha256=DATA, alpha=0.2)
    assert apply_decisions(logits, record)["prediction_set"].all()
    rng = np.random.default_rng(2)
    extreme = rng.choice([-1e4, 0.0, 1e4], (200, 3, 4))
    labels = extreme.mean(axis=1).argmax(axis=1)
    record = fit_decisions(extreme, labels, onnx_sha256=SHA, data_sha256=DATA, sets="aps")
    out = apply_decisions(extreme, record)
    assert np.isfinite(out["calibrated_probs"]).all()
    assert out["prediction_set"].any(axis=1).all()


def test_scores_tied_with_qhat_up_to_rounding_are_in_the_set():
    # p = 1/3 in exact arithmetic; qhat the score 1 - 1/3 a few bits below, as another sum gives
    p = np.array([[1 / 3, 1 / 3, 1 - 2 / 3]])
    qhat = np.nextafter(np.nextafter(1 - 1 / 3, 0), 0)
    assert prediction_sets(p, qhat, "lac").all()
    assert not prediction_sets(p, qhat - 1e-4, "lac").any()  # a real gap still excludes


def test_confident_aps_sets_keep_the_documented_rule():
    # every lower class's APS score is within 1e-6 of 1: an absolute tolerance took them all in
    p = np.array([[0.999999, 5e-7, 3e-7, 2e-7]])
    qhat = 0.9999995
    by_rule = class_scores(p, "aps") <= qhat
    assert by_rule.tolist() == [[True, True, False, False]]
    assert prediction_sets(p, qhat, "aps").tolist() == by_rule.tolist()
    assert prediction_sets(p, qhat, "raps", lam=0.0, k_reg=0).tolist() == by_rule.tolist()


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    classes=st.integers(2, 12),
    sharpness=st.floats(1.0, 40.0),
    method=st.sampled_from(SET_METHODS),
)
def test_sets_differ_from_the_rule_only_within_the_relative_tolerance(
    seed, classes, sharpness, method
):
    # the tolerance is relative to the room compared (p for LAC, the tail mass below the class
    # for APS/RAPS): a class is added beyond "score <= qhat" only where its room is within
    # SET_TOLERANCE of qhat's (plus float64's rounding of 1 - qhat)
    rng = np.random.default_rng(seed)
    z = sharpness * rng.normal(size=(200, classes))
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    params = RapsParams(0.01, 1) if method == "raps" else None
    scores = class_scores(p, method, params)
    qhat = float(np.quantile(scores[np.arange(200), rng.integers(0, classes, 200)], 0.9))
    sets = prediction_sets(p, qhat, method, params)
    by_rule = scores <= qhat
    if SET_SCORES[method].top_always_in:
        by_rule[np.arange(200), np.argsort(-p, axis=1, kind="stable")[:, 0]] = True
    extra = sets & ~by_rule
    room = 1.0 - scores
    bar = 1.0 - qhat
    assert np.all(room[extra] >= bar - SET_TOLERANCE * abs(bar) - 2e-15)
    assert not np.any(by_rule & ~sets)  # nothing the rule holds is left out
    assert np.all(set_floor(qhat) <= bar)


def test_accept_and_flag_at_the_threshold_take_the_conservative_side():
    tau, threshold = 0.8, -0.6
    assert not accept_mask([tau], "msp", tau)[0]  # a score exactly at tau abstains
    assert accept_mask([tau + 2 * DECISION_MARGIN], "msp", tau)[0]
    assert not accept_mask([0.5], "predictive_entropy", 0.5)[0]
    assert accept_mask([0.5 - 2 * DECISION_MARGIN], "predictive_entropy", 0.5)[0]
    assert not ood_mask([threshold], threshold)[0]  # exactly at the threshold: not flagged
    assert ood_mask([threshold + 2 * DECISION_MARGIN], threshold)[0]
    assert not accept_mask([np.nan], "msp", tau)[0] and not ood_mask([np.nan], threshold)[0]


def test_an_old_selective_rule_reads_as_bonferroni():
    entry = {
        "score": "msp",
        "target_risk": 0.1,
        "delta": 0.1,
        "tau": 0.7,
        "grid_size": 5,
        "coverage": 0.5,
    }
    assert SelectiveRule.from_dict(entry, "test").procedure == "bonferroni"
    rule = SelectiveRule.from_dict({**entry, "procedure": "graph"}, "test")
    assert SelectiveRule.from_dict(rule.to_dict(), "test") == rule
    with pytest.raises(ExportFolderError, match="procedure"):
        SelectiveRule.from_dict({**entry, "procedure": "holm"}, "test")


def test_a_temperature_at_its_bound_is_warned_about(caplog):
    # a temperature part without a single error: the NLL falls without end as T shrinks
    logits, _ = population(400)
    labels = ensemble_scores(logits)["prediction"]
    with caplog.at_level("WARNING", logger="hydra_deploy"):
        record = fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=DATA)
    assert record.temperature == pytest.approx(0.05, rel=0.02)
    assert any(
        "is at the lower bound of its search" in r.message and "errs on 0 of them" in r.message
        for r in caplog.records
    )
    assert temperature_warning(1.3, logits, labels) is None
    logits, labels = population(400)
    assert temperature_warning(fit_temperature(logits, labels), logits, labels) is None
