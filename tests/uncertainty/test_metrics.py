"""Uncertainty metrics against scikit-learn, hand-worked cases, and input validation."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    log_loss,
    mean_squared_error,
    roc_auc_score,
    roc_curve,
)

from hydra_deploy.errors import HydraError
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import (
    accuracy,
    aupr,
    aurc,
    auroc,
    brier,
    classification_metrics,
    ece,
    excess_aurc,
    fpr_at_tpr,
    nll,
    ood_metrics,
    ood_score,
    reliability_bins,
)

# Scores with many ties (small integers) or few (floats); both sides non-empty.
tied_side = st.lists(st.integers(0, 5).map(float), min_size=1, max_size=30)
float_side = st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=30)
side = st.one_of(tied_side, float_side)


def _sk_inputs(scores_id, scores_ood):
    """OOD positive: y = 1 for OOD."""
    y = np.r_[np.zeros(len(scores_id)), np.ones(len(scores_ood))]
    return y, np.r_[scores_id, scores_ood]


def _sk_fpr_at(y, s, tpr):
    fpr_curve, tpr_curve, _ = roc_curve(y, s, drop_intermediate=False)
    return fpr_curve[np.argmax(tpr_curve >= tpr)]


# --------------------------------------------------------------------------- OOD vs scikit-learn


@given(side, side)
def test_ood_metrics_match_sklearn(scores_id, scores_ood):
    y, s = _sk_inputs(scores_id, scores_ood)
    got = ood_metrics(np.array(scores_id), np.array(scores_ood))
    assert set(got) == {"auroc", "aupr", "fpr95"}
    assert got["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert got["aupr"] == pytest.approx(average_precision_score(y, s), abs=1e-12)
    assert got["fpr95"] == pytest.approx(_sk_fpr_at(y, s, 0.95), abs=1e-12)


@given(side, side, st.sampled_from([0.05, 0.5, 0.8, 0.95, 1.0]))
def test_fpr_at_tpr_matches_roc_curve_at_any_tpr(scores_id, scores_ood, tpr):
    y, s = _sk_inputs(scores_id, scores_ood)
    got = fpr_at_tpr(np.array(scores_id), np.array(scores_ood), tpr=tpr)
    assert got == pytest.approx(_sk_fpr_at(y, s, tpr), abs=1e-12)


@given(side, side)
def test_positive_id_equals_swapping_the_sides(scores_id, scores_ood):
    a, b = np.array(scores_id), np.array(scores_ood)
    assert ood_metrics(a, b, positive="id") == ood_metrics(b, a, positive="ood")
    y = np.r_[np.ones(len(a)), np.zeros(len(b))]  # ID positive
    assert aupr(a, b, positive="id") == pytest.approx(
        average_precision_score(y, np.r_[a, b]), abs=1e-12
    )


def test_fpr95_hand_case_and_ties_admitted_together():
    # 20 OOD scores 1..20, so TPR >= 0.95 first at threshold 2 (19 of 20 OOD admitted);
    # ID scores 0, 1.5, 2, 3: scores >= 2 admit 2 of 4 ID -> FPR 0.5.
    ood = np.arange(1.0, 21.0)
    ind = np.array([0.0, 1.5, 2.0, 3.0])
    assert fpr_at_tpr(ind, ood) == 0.5
    # Everything tied: the only threshold admits everything -> FPR 1, AUROC 0.5, AP = 3/5.
    assert ood_metrics(np.zeros(2), np.zeros(3)) == {"auroc": 0.5, "aupr": 0.6, "fpr95": 1.0}
    # Perfect separation.
    assert ood_metrics(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == {
        "auroc": 1.0,
        "aupr": 1.0,
        "fpr95": 0.0,
    }


def test_ood_score_signs_and_ensemble_scores_dict():
    rng = np.random.default_rng(0)
    scores = ensemble_scores(rng.normal(size=(6, 3, 4)))
    np.testing.assert_array_equal(ood_score(scores, "msp"), -scores["msp"].astype(np.float64))
    for name in ("predictive_entropy", "expected_entropy", "mutual_information", "disagreement"):
        np.testing.assert_array_equal(ood_score(scores[name], name), scores[name])
    with pytest.raises(HydraError, match="unknown score 'probs'"):
        ood_score(scores, "probs")


# --------------------------------------------------------------------- classification metrics


@st.composite
def probs_labels(draw):
    n = draw(st.integers(1, 25))
    c = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=draw(st.sampled_from([0.1, 1.0, 5.0])), size=(n, c))
    if draw(st.booleans()):  # coarse probabilities: ties in confidence and at bin edges
        logits = np.round(logits)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    labels = rng.integers(0, c, size=n)
    return probs, labels


@given(probs_labels())
def test_accuracy_nll_brier_match_sklearn(data):
    probs, labels = data
    classes = np.arange(probs.shape[1])
    onehot = np.eye(probs.shape[1])[labels]
    assert accuracy(probs, labels) == pytest.approx(accuracy_score(labels, probs.argmax(1)))
    picked = probs[np.arange(len(labels)), labels]
    if picked.min() > 1e-12:  # below, nll clips at eps=1e-12 and scikit-learn at float64 eps
        expected_nll = log_loss(labels, probs, labels=classes)
        assert nll(probs, labels) == pytest.approx(expected_nll, rel=1e-9)
    assert nll(probs, labels, eps=1e-3) == pytest.approx(-np.log(np.maximum(picked, 1e-3)).mean())
    # Brier: mean over examples of the sum over classes = C * mean squared error of the one-hot.
    expected_brier = probs.shape[1] * mean_squared_error(onehot, probs)
    assert brier(probs, labels) == pytest.approx(expected_brier, rel=1e-9, abs=1e-12)


def _ece_reference(probs, labels, bins):
    """Guo et al. (2017): bins (lo, hi] with edges linspace(0, 1, bins + 1)."""
    conf, pred = probs.max(1), probs.argmax(1)
    edges = np.linspace(0, 1, bins + 1)
    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            gap = abs((pred[inside] == labels[inside]).mean() - conf[inside].mean())
            total += inside.mean() * gap
    return total


@given(probs_labels(), st.sampled_from([1, 2, 5, 10, 15]))
def test_ece_matches_reference_loop(data, bins):
    probs, labels = data
    assert ece(probs, labels, bins) == pytest.approx(_ece_reference(probs, labels, bins), abs=1e-12)
    table = reliability_bins(probs, labels, bins)
    assert table["count"].sum() == len(labels)
    assert len(table["edges"]) == bins + 1


def test_ece_hand_case():
    # 5 bins: (0, .2], (.2, .4], (.4, .6], (.6, .8], (.8, 1].
    # ex 0: conf .90, pred 0, label 0 -> correct, bin (.8, 1]
    # ex 1: conf .80, pred 1, label 0 -> wrong,   bin (.6, .8]  (right-closed: .8 stays below)
    # ex 2: conf .70, pred 0, label 0 -> correct, bin (.6, .8]
    # ex 3: conf .55, pred 1, label 1 -> correct, bin (.4, .6]
    # (.4, .6]: n=1, acc 1,  conf .55 -> |gap| .45
    # (.6, .8]: n=2, acc .5, conf .75 -> |gap| .25
    # (.8, 1]:  n=1, acc 1,  conf .90 -> |gap| .10
    # ECE = (1 * .45 + 2 * .25 + 1 * .10) / 4 = 1.05 / 4 = 0.2625
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.45, 0.55]])
    labels = np.array([0, 0, 0, 1])
    assert ece(probs, labels, bins=5) == pytest.approx(0.2625, abs=1e-12)
    table = reliability_bins(probs, labels, bins=5)
    np.testing.assert_array_equal(table["count"], [0, 0, 1, 2, 1])
    np.testing.assert_allclose(table["accuracy"][2:], [1.0, 0.5, 1.0])
    np.testing.assert_allclose(table["confidence"][2:], [0.55, 0.75, 0.9])
    assert np.isnan(table["accuracy"][:2]).all()
    # one bin: |mean accuracy - mean confidence| = |0.75 - 0.7375|
    assert ece(probs, labels, bins=1) == pytest.approx(0.0125, abs=1e-12)
    # the default is 15 bins
    assert ece(probs, labels) == ece(probs, labels, bins=15)


# ------------------------------------------------------------------------------ AURC / E-AURC


def test_aurc_hand_case():
    # Sorted by confidence: right, wrong, right, wrong.
    # risks at coverage 1..4: 0/1, 1/2, 1/3, 2/4 -> AURC = (0 + .5 + 1/3 + .5) / 4 = 1/3
    # optimal (right, right, wrong, wrong): 0, 0, 1/3, 2/4 -> (1/3 + 1/2) / 4 = 5/24
    # E-AURC = 1/3 - 5/24 = 1/8
    conf = np.array([0.6, 0.9, 0.7, 0.8])  # input order does not matter
    correct = np.array([False, True, True, False])
    assert aurc(conf, correct) == pytest.approx(1 / 3, abs=1e-12)
    assert excess_aurc(conf, correct) == pytest.approx(1 / 8, abs=1e-12)


def test_aurc_ties_hand_case():
    # Two tied pairs, each with one error: expected errors in the top k are .5, 1, 1.5, 2
    # -> risks .5, .5, .5, .5 -> AURC = .5 (the mean over the 4 orders of the tied pairs).
    conf = np.array([0.9, 0.9, 0.5, 0.5])
    assert aurc(conf, np.array([1, 0, 1, 0])) == pytest.approx(0.5, abs=1e-12)
    assert aurc(conf, np.array([0, 1, 0, 1])) == pytest.approx(0.5, abs=1e-12)


def test_excess_aurc_zero_for_a_perfect_ranking():
    correct = np.array([True] * 7 + [False] * 3)
    conf = np.linspace(1.0, 0.1, 10)
    assert excess_aurc(conf, correct) == pytest.approx(0.0, abs=1e-15)
    assert aurc(conf, correct) > 0
    assert aurc(conf, np.ones(10, bool)) == 0.0
    assert excess_aurc(conf, np.zeros(10, bool)) == pytest.approx(0.0, abs=1e-15)
    assert aurc(conf, np.zeros(10, bool)) == 1.0


def _aurc_over_tie_orders(conf, correct):
    """Mean AURC over every order of the examples consistent with descending confidence."""
    values = []
    for perm in itertools.permutations(range(len(conf))):
        perm = np.array(perm)
        order = perm[np.argsort(-conf[perm], kind="stable")]
        errors = np.cumsum(~correct[order])
        values.append(np.mean(errors / np.arange(1, len(conf) + 1)))
    return float(np.mean(values))


@given(
    st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=6),
)
def test_aurc_ties_are_the_expectation_over_random_orders(pairs):
    conf = np.array([c for c, _ in pairs], dtype=float)
    correct = np.array([ok for _, ok in pairs])
    assert aurc(conf, correct) == pytest.approx(_aurc_over_tie_orders(conf, correct), abs=1e-12)
    assert excess_aurc(conf, correct) >= -1e-12


@given(probs_labels())
def test_classification_metrics_assembles_the_parts(data):
    probs, labels = data
    got = classification_metrics(probs, labels, bins=10)
    assert set(got) == {"accuracy", "nll", "brier", "ece", "aurc", "eaurc"}
    correct = probs.argmax(1) == labels
    assert got["ece"] == ece(probs, labels, 10)
    assert got["aurc"] == aurc(probs.max(1), correct)
    assert got["eaurc"] == excess_aurc(probs.max(1), correct)
    entropy = -(probs * np.log(np.maximum(probs, 1e-300))).sum(1)
    by_entropy = classification_metrics(probs, labels, confidence=-entropy)
    assert by_entropy["aurc"] == aurc(-entropy, correct)
    assert by_entropy["accuracy"] == got["accuracy"]


# ----------------------------------------------------------------------------------- refusals


def test_empty_side_is_refused():
    for fn in (ood_metrics, aupr, fpr_at_tpr):
        with pytest.raises(HydraError, match="0 in-distribution and 2 OOD"):
            fn(np.array([]), np.array([0.1, 0.2]))
        with pytest.raises(HydraError, match="2 in-distribution and 0 OOD"):
            fn(np.array([0.1, 0.2]), [])
        with pytest.raises(HydraError, match="needs both sides"):
            fn(np.array([]), np.array([0.1]), positive="id")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ood_metrics([0.1, np.nan], [0.2]), "scores_id holds 1 NaN"),
        (lambda: ood_metrics([0.1], [[0.2]]), "scores_ood must be a 1-D array"),
        (lambda: ood_metrics([0.1], [0.2], positive="in"), "positive must be 'ood' or 'id'"),
        (lambda: fpr_at_tpr([0.1], [0.2], tpr=0.0), r"tpr must lie in \(0, 1\]"),
        (lambda: accuracy(np.array([0.5, 0.5]), np.array([0])), "probs must be"),
        (lambda: accuracy(np.array([[0.5, 0.6]]), np.array([0])), "sum to 1 within 0.001"),
        (lambda: accuracy(np.array([[2.0, -1.0]]), np.array([0])), r"must lie in \[0, 1\]"),
        (lambda: accuracy(np.array([[np.nan, 1.0]]), np.array([0])), "NaN or infinite"),
        (lambda: accuracy(np.array([[0.5, 0.5]]), np.array([2])), r"labels must lie in \[0, 1\]"),
        (lambda: accuracy(np.array([[0.5, 0.5]]), np.array([-1])), "labels must lie in"),
        (lambda: accuracy(np.array([[0.5, 0.5]]), np.array([0, 1])), "one label per row"),
        (lambda: accuracy(np.array([[0.5, 0.5]]), np.array([0.0])), "integer class indices"),
        (lambda: nll(np.array([[0.5, 0.5]]), np.array([0]), eps=0.0), "eps must be positive"),
        (lambda: ece(np.array([[0.5, 0.5]]), np.array([0]), bins=0), "bins must be a positive"),
        (lambda: aurc([0.1, 0.2], [True]), "one entry per confidence"),
        (lambda: aurc([0.1, 0.2], [2, 0]), "correct must be booleans or 0/1"),
        (lambda: aurc([], []), "confidence is empty"),
        (lambda: aurc([np.nan], [True]), "confidence holds 1 NaN"),
        (
            lambda: classification_metrics(
                np.array([[0.5, 0.5]]), np.array([0]), confidence=[1, 2]
            ),
            "one entry per confidence",
        ),
    ],
)
def test_bad_inputs_are_refused(call, message):
    with pytest.raises(HydraError, match=message):
        call()


def test_probs_within_tolerance_are_accepted():
    probs = np.array([[0.5, 0.5004]])  # sums to 1.0004, within 1e-3
    assert accuracy(probs, np.array([1])) == 1.0


def test_auroc_keeps_its_negative_positive_signature():
    assert auroc(np.array([0.0, 1.0]), np.array([2.0])) == 1.0
    assert ood_metrics([0.0, 1.0], [2.0])["auroc"] == auroc(np.array([0.0, 1.0]), np.array([2.0]))


def test_metrics_import_without_torch_or_sklearn():
    code = "import sys, hydra_deploy.uncertainty.metrics; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    roots = {name.split(".")[0] for name in result.stdout.split()}
    assert "hydra_deploy" in roots
    assert not {"torch", "sklearn", "scipy"} & roots
