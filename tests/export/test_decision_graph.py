"""add_decisions / remove_decisions: the decisions as graph outputs, run in ONNX Runtime, equal
apply_decisions (float64) but where float32 cannot tell (a score or a class's room within float32's
rounding of its threshold, or two probabilities whose order float32 and float64 see differently),
and exactly so for a score at tau or at the OOD threshold (issue 34)."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper

from hydra_deploy.decisions import (
    apply_decisions,
    calibrated_scores,
    class_scores,
    conformal_quantile,
    decision_margin,
    fit_decisions,
    prediction_sets,
    set_floor,
    split_rows,
)
from hydra_deploy.errors import ExportError, command_spelling
from hydra_deploy.export.decision_graph import (
    DECISION_OPS,
    DECISION_OUTPUTS,
    PREFIX,
    TOPK_MAX_K,
    _float32_bound,
    add_decisions,
    remove_decisions,
)
from hydra_deploy.export_folder import DecisionRecord, OodRule, SelectiveRule, SetRule
from hydra_deploy.set_scores import SET_METHODS, SET_SCORES, RapsParams
from hydra_deploy.uncertainty.metrics import ood_score

HASHES = {"onnx_sha256": "0" * 64, "data_sha256": "1" * 64}
TOL = 1e-5  # relative (absolute below 1): a float32 score against float64 near a threshold
ROOM_TOL = 1e-5  # relative: a float32 class room against float64 near the set's floor
#: every registered set score: each property below runs over each (a new entry is tested here)
METHODS = SET_METHODS
# (accept score, OOD score) per set method: each score is used by both rules somewhere
PAIRS = (
    ("msp", "predictive_entropy"),
    ("predictive_entropy", "mutual_information"),
    ("mutual_information", "msp"),
)
SCORES = {method: PAIRS[i % len(PAIRS)] for i, method in enumerate(METHODS)}
#: hand-set parameters where a score's defaults would leave a part of it out (RAPS: no penalty)
PARAMS = {"raps": RapsParams(lam=1e-7, k_reg=1)}


# --- models, records and running them ---------------------------------------------------------------
def logits_model(members: int | str, classes: int | str, opset: int = 17) -> onnx.ModelProto:
    """``member_logits = Identity(x)``, x float32 [batch, members, classes]."""
    shape = ["batch", members, classes]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["member_logits"], name="logits")],
        "logits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("member_logits", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def labelled_logits(count: int, members: int, classes: int, seed: int = 0):
    """Member logits that share most of their signal (a calibrated T near 1) and their labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, count)
    shared = rng.normal(size=(count, 1, classes)) + 2.0 * np.eye(classes)[labels][:, None]
    return shared + 0.5 * rng.normal(size=(count, members, classes)), labels


@functools.cache
def fitted(
    method: str | None,
    conditional: bool = False,
    accept: str | None = "msp",
    ood: str | None = "msp",
    members: int = 3,
    classes: int = 5,
) -> DecisionRecord:
    """A record fitted on synthetic labelled logits (None: that rule left out)."""
    logits, labels = labelled_logits(600, members, classes)
    return fit_decisions(
        logits,
        labels,
        **HASHES,
        alpha=None if method is None else 0.1,
        sets=method or "lac",
        class_conditional=conditional,
        risk=None if accept is None else 0.3,
        accept_score=accept or "msp",
        ood_alpha=None if ood is None else 0.05,
        ood_score=ood or "msp",
    )


def record_with(temperature: float, classes: int, **rules) -> DecisionRecord:
    """A hand-written record (the rules given, the others None)."""
    return DecisionRecord(
        temperature, classes, **HASHES, n_temperature=10, n_quantile=10, holdout=0.5, seed=0,
        **rules,
    )  # fmt: skip


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@functools.cache
def decided_session(record: DecisionRecord, opset: int = 17) -> ort.InferenceSession:
    """A session of ``logits_model(3, classes, opset)`` with ``record``'s decisions."""
    return session(add_decisions(logits_model(3, record.num_classes, opset), record))


def run(sess: ort.InferenceSession, x: np.ndarray) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {sess.get_inputs()[0].name: x}), strict=True))


# --- comparing with apply_decisions -------------------------------------------------------------------
def near(score: np.ndarray, threshold) -> np.ndarray:
    threshold = np.asarray(threshold, dtype=np.float64)
    return np.abs(score - threshold) <= TOL * np.maximum(1.0, np.abs(threshold))


def order_differs(p64: np.ndarray, p32: np.ndarray) -> np.ndarray:
    """[B, C]: classes whose rank (p descending, ties by lower index) against some other class is
    not the same in the float64 and the graph's float32 probabilities."""
    index = np.arange(p64.shape[1])
    lower = index[:, None] < index[None, :]

    def before(p):  # [B, C, C]: class i is ranked above class j
        return (p[:, :, None] > p[:, None, :]) | ((p[:, :, None] == p[:, None, :]) & lower)

    differs = before(p64) != before(p32.astype(np.float64))
    return differs.any(axis=2) | differs.any(axis=1)


def near_floor(room: np.ndarray, floor, magnitude: np.ndarray) -> np.ndarray:
    """[B, C]: a class room within float32's rounding of the set's floor, relative to the terms it
    is made of (the score's room_magnitude: the mass below the class, RAPS's penalty at its rank;
    0 where the graph computes the room exactly)."""
    floor = np.asarray(floor, dtype=np.float64)
    scale = magnitude + np.abs(floor)
    return (magnitude > 0) & (np.abs(room - floor) <= ROOM_TOL * scale + 1e-30)


def ambiguous(x: np.ndarray, record: DecisionRecord, got: dict) -> dict[str, np.ndarray]:
    """Per bool output, where float32 may rightly differ from float64: the defining score within
    TOL of the value it is compared with (tau or the OOD threshold moved by decision_margin), a
    class's room within ROOM_TOL of the set's floor, and for a score that ranks the classes a rank
    that float32 sees differently."""
    scores = calibrated_scores(x, record.temperature)
    out = {}
    if record.sets is not None:
        rule = record.sets
        score = SET_SCORES[rule.method]
        qhat = np.asarray(rule.qhat) if rule.class_conditional else rule.qhat[0]
        room = score.room(scores["probs"], rule.params)
        magnitude = score.room_magnitude(scores["probs"], rule.params)
        out["prediction_set"] = near_floor(room, set_floor(qhat), magnitude)
        if score.sorts:
            out["prediction_set"] |= order_differs(scores["probs"], got["calibrated_probs"])
    if record.selective is not None:
        rule = record.selective
        sign = 1.0 if rule.score == "msp" else -1.0
        bar = rule.tau + sign * decision_margin(rule.tau)
        out["accept"] = near(scores[rule.score], bar)
    if record.ood is not None:
        rule = record.ood
        out["ood_flag"] = near(
            ood_score(scores, rule.score), rule.threshold + decision_margin(rule.threshold)
        )
    return out


def assert_matches(x: np.ndarray, record: DecisionRecord, got: dict) -> dict[str, int]:
    """The graph's outputs equal apply_decisions' outside the ambiguous entries; returns how many
    entries were ambiguous per output."""
    expected = apply_decisions(x, record)
    rules = {"prediction_set": record.sets, "accept": record.selective, "ood_flag": record.ood}
    assert set(got) == {"member_logits", "calibrated_probs"} | {
        name for name, rule in rules.items() if rule is not None
    }
    np.testing.assert_allclose(got["calibrated_probs"], expected["calibrated_probs"], atol=TOL)
    counts = {}
    for name, mask in ambiguous(x, record, got).items():
        assert got[name].dtype == bool and got[name].shape == expected[name].shape
        wrong = (got[name] != expected[name]) & ~mask
        assert not wrong.any(), f"{name} differs at {np.argwhere(wrong)[:5].tolist()}"
        counts[name] = int(mask.sum())
    return counts


# --- random logits --------------------------------------------------------------------------------------
VALUES = st.one_of(
    st.sampled_from([-1e4, -3.0, -1.0, 0.0, 0.5, 2.0, 1e4]),  # repeats: equal logits in a row
    st.floats(-8.0, 8.0, width=32),
)


@st.composite
def logit_batches(draw, members: int = 3, classes: int = 5) -> np.ndarray:
    batch = draw(st.integers(1, 6))
    x = draw(hnp.arrays(np.float32, (batch, members, classes), elements=VALUES))
    if draw(st.booleans()):
        x[0] = x[0, 0, 0]  # one example's logits all equal: every class tied
    if batch > 1 and draw(st.booleans()):
        x[-1] = x[0]  # a duplicated example
    return x


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("conditional", [False, True], ids=["marginal", "class-conditional"])
@pytest.mark.parametrize("method", METHODS)
@given(x=logit_batches())
def test_graph_equals_apply_decisions(method, conditional, opset, x):
    record = fitted(method, conditional, *SCORES[method])
    # hypothesis seeks out near-ties (float32 ties what float64 orders), so the ambiguous entries
    # are not rare here: test_ambiguous_entries_are_rare counts them on continuous logits
    assert_matches(x, record, run(decided_session(record, opset), x))


@st.composite
def confident_batches(draw, members: int = 3, classes: int = 5) -> np.ndarray:
    """Confident examples: one class 8 to 25 logits above the others (p of the rest down to
    ~1e-11), the others spread or tied."""
    batch = draw(st.integers(1, 4))
    small = st.one_of(st.sampled_from([0.0, -1.0, -3.0]), st.floats(-4.0, 0.0, width=32))
    x = draw(hnp.arrays(np.float32, (batch, members, classes), elements=small))
    tops = draw(hnp.arrays(np.int64, batch, elements=st.integers(0, classes - 1)))
    lift = draw(hnp.arrays(np.float32, batch, elements=st.floats(8.0, 25.0, width=32)))
    x[np.arange(batch), :, tops] += lift[:, None]
    return x


# qhat near 1: the set's floor (1 - qhat) is as small as the tail of a confident input
QHATS = (0.999, 0.99999, 0.9999995, 1.0 - 1e-7, 1.0 - 1e-9)


@pytest.mark.parametrize("qhat", QHATS)
@pytest.mark.parametrize("method", METHODS)
@given(x=confident_batches())
def test_confident_inputs_get_the_numpy_set(method, qhat, x):
    """Issue 34: with qhat near 1, the graph's sets equal numpy's wherever no class's room (its
    probability, or the mass ranked below it) is within float32 rounding of 1 - qhat; a set never
    takes in a class whose room is clearly below the floor (what 1 - cumulative lost in float32)."""
    record = record_with(1.0, 5, sets=SetRule(method, 0.1, (qhat,), params=PARAMS.get(method)))
    assert_matches(x, record, run(decided_session(record), x))


@pytest.mark.parametrize("method", METHODS)
def test_confident_inputs_are_rarely_ambiguous(method):
    """On 3000 confident examples at each qhat near 1 no set entry is within float32's rounding
    of the floor, and (for a score whose room is a probability or a mass: a rank score's qhat
    near 1 is k = 1) many sets hold more than one class: the comparison is exercised."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-4.0, 0.0, size=(3000, 3, 5)).astype(np.float32)
    lift = rng.uniform(8.0, 25.0, 3000).astype(np.float32)
    x[np.arange(3000), :, rng.integers(0, 5, 3000)] += lift[:, None]
    score, params = SET_SCORES[method], PARAMS.get(method)
    probs = calibrated_scores(x, 1.0)["probs"]
    for qhat in QHATS:
        record = record_with(1.0, 5, sets=SetRule(method, 0.1, (qhat,), params=params))
        counts = assert_matches(x, record, run(decided_session(record), x))
        assert counts["prediction_set"] <= 3  # of 15000 entries
        if qhat < 0.9999 or not score.room_magnitude(probs, record.sets.params).any():
            continue
        assert (apply_decisions(x, record)["prediction_set"].sum(axis=1) > 1).mean() > 0.2


@pytest.mark.parametrize("method", METHODS)
def test_ambiguous_entries_are_rare(method):
    record = fitted(method, True, *SCORES[method])
    logits, _ = labelled_logits(4000, 3, 5, seed=1)
    x = (2.0 * logits).astype(np.float32)  # sharper than calibration: both tails of the scores
    counts = assert_matches(x, record, run(decided_session(record), x))
    assert counts["prediction_set"] <= 0.001 * x.shape[0] * 5
    assert counts["accept"] <= 0.001 * x.shape[0] and counts["ood_flag"] <= 0.001 * x.shape[0]


@pytest.mark.parametrize(
    "rules",
    [
        (None, None, None),
        ("aps", None, None),
        (None, "msp", None),
        (None, None, "msp"),
        ("lac", "predictive_entropy", None),
        (None, "msp", "mutual_information"),
    ],
)
def test_only_the_rules_the_record_holds_become_outputs(rules):
    method, accept, ood = rules
    record = fitted(method, False, accept, ood)
    x = labelled_logits(50, 3, 5, seed=2)[0].astype(np.float32)
    assert_matches(x, record, run(decided_session(record), x))


@pytest.mark.parametrize("conditional", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_one_class(method, conditional):
    # one class: every confidence is 1 (an entropy 0), so no threshold passes by the margin and no
    # selective rule can be fitted; this one is written by hand
    record = replace(
        fitted(method, conditional, None, "mutual_information", classes=1),
        selective=SelectiveRule("predictive_entropy", 0.1, 0.1, 0.5, 10, 0.5),
    )
    x = np.array([[[0.0], [3.0], [-2.0]], [[-1e4], [1e4], [0.0]]], dtype=np.float32)
    got, expected = run(decided_session(record), x), apply_decisions(x, record)
    for name in ("calibrated_probs", "prediction_set", "accept", "ood_flag"):
        np.testing.assert_array_equal(got[name], expected[name])  # p = 1 exactly: no rounding


def at_threshold_logits() -> np.ndarray:
    """22 examples [22, 3, 5] of every kind: spread, confident, tied, uniform, extreme."""
    rng = np.random.default_rng(7)
    rows = [rng.normal(size=(3, 5)) for _ in range(10)]
    rows += [3.0 * rng.normal(size=(3, 5)) + 6.0 * np.eye(5)[k % 5] for k in range(6)]  # confident
    rows += [np.zeros((3, 5)), np.full((3, 5), 2.5)]  # uniform: msp 1/5, entropy log 5, MI 0
    rows += [np.array([[1.0, 1.0, 0.0, -1.0, -1.0]] * 3)]  # tied pairs
    rows += [np.array([[2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0], [0, 0, 2.0, 0, 0]])]
    rows += [np.array([[1e4, -1e4, 0, 0, 0]] * 3), np.eye(5)[:3] * 1e4]  # msp 1; members disagree
    return np.asarray(rows, dtype=np.float32)


# (accept score, OOD score): every score is used by both rules
AT_THRESHOLD = [
    ("msp", "predictive_entropy"),
    ("predictive_entropy", "mutual_information"),
    ("mutual_information", "msp"),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("accept_score, ood_score_name", AT_THRESHOLD)
def test_a_score_at_tau_or_at_the_ood_threshold_gets_the_same_answer(
    accept_score, ood_score_name, temperature
):
    """Issue 34, part 5: an example whose float64 score is exactly tau (the OOD threshold) is
    decided alike by apply_decisions and the graph: abstain (not flagged), bit for bit; 22
    examples per score pair and temperature, 132 per rule over the test."""
    x = at_threshold_logits()
    scores = calibrated_scores(x, temperature)
    accept_at = scores[accept_score]  # tau in the score's own units
    ood_at = ood_score(scores, ood_score_name)
    for i in range(len(x)):
        record = record_with(
            temperature,
            5,
            selective=SelectiveRule(accept_score, 0.1, 0.1, float(accept_at[i]), 10, 0.5),
            ood=OodRule(ood_score_name, 0.05, float(ood_at[i])),
        )
        example = x[i : i + 1]
        expected = apply_decisions(example, record)
        got = run(session(add_decisions(logits_model(3, 5), record)), example)
        assert expected["accept"].tolist() == [False]  # not past tau by the margin: abstain
        assert expected["ood_flag"].tolist() == [False]  # not past the threshold by the margin
        np.testing.assert_array_equal(got["accept"], expected["accept"], err_msg=f"example {i}")
        np.testing.assert_array_equal(got["ood_flag"], expected["ood_flag"], err_msg=f"example {i}")


def test_scores_clearly_past_or_short_of_the_bar_agree():
    """A score 2e-4 (relative above 1) past the bar it is compared with (tau or the OOD threshold,
    moved by the margin) passes on both paths; 2e-4 short of it, on neither."""
    x = at_threshold_logits()[:16]
    scores = calibrated_scores(x, 1.0)
    for score, ood_name in AT_THRESHOLD:
        accept_value, ood_value = scores[score], ood_score(scores, ood_name)
        for i in range(len(x)):
            for past in (True, False):
                # accept: msp >= tau + margin, an entropy <= tau - margin; flag: > threshold + margin
                gap = (1.0 if past else -1.0) * 2e-4
                sign = 1.0 if score == "msp" else -1.0
                tau = accept_value[i] - sign * gap * max(1.0, abs(accept_value[i]))
                threshold = ood_value[i] - gap * max(1.0, abs(ood_value[i]))
                record = record_with(
                    1.0,
                    5,
                    selective=SelectiveRule(score, 0.1, 0.1, float(tau), 10, 0.5),
                    ood=OodRule(ood_name, 0.05, float(threshold)),
                )
                expected = apply_decisions(x[i : i + 1], record)
                got = run(session(add_decisions(logits_model(3, 5), record)), x[i : i + 1])
                assert expected["accept"].tolist() == [past], (score, i)
                assert expected["ood_flag"].tolist() == [past], (ood_name, i)
                np.testing.assert_array_equal(got["accept"], expected["accept"])
                np.testing.assert_array_equal(got["ood_flag"], expected["ood_flag"])


def test_a_confident_input_keeps_a_two_class_aps_set():
    """Issue 34: p = [0.999999, 5e-7, 3e-7, 2e-7] at qhat = 0.9999995 is a two-class APS set (the
    mass below class 1 is 5e-7 = 1 - qhat; class 2's is 2e-7), in numpy and in the graph: the
    room is the small tail itself, not 1 minus a cumulative sum that float32 rounds to 1."""
    p = np.array([[0.999999, 5e-7, 3e-7, 2e-7]])
    record = record_with(1.0, 4, sets=SetRule("aps", 0.1, (0.9999995,)))
    expected = [[True, True, False, False]]
    np.testing.assert_array_equal(prediction_sets(p, 0.9999995, "aps"), expected)
    # logits giving such probabilities (float32 holds log p only to ~1e-7 relative, so class 2's p
    # is raised by 1e-4 of itself: class 1's room then clears the floor by more than rounding)
    target = p * [1.0, 1.0, 1.0 + 1e-4, 1.0]
    x = np.repeat(np.log(target).astype(np.float32)[:, None, :], 3, axis=1)
    probs = calibrated_scores(x, 1.0)["probs"]
    np.testing.assert_allclose(probs, p, rtol=2e-4)
    got = run(decided_session(record), x)
    np.testing.assert_array_equal(apply_decisions(x, record)["prediction_set"], expected)
    np.testing.assert_array_equal(got["prediction_set"], expected)
    # the same at RAPS without a penalty, and LAC (p_y >= 1 - qhat: class 1's 5e-7 is at the floor)
    for rule in (
        SetRule("raps", 0.1, (0.9999995,), lam=0.0, k_reg=1),
        SetRule("lac", 0.1, (0.9999995,)),
    ):
        other = record_with(1.0, 4, sets=rule)
        got = run(decided_session(other), x)
        np.testing.assert_array_equal(
            got["prediction_set"], apply_decisions(x, other)["prediction_set"]
        )
        assert got["prediction_set"].sum() <= 2


@pytest.mark.parametrize("method", ["aps", "raps"])
def test_tied_classes_rank_by_lower_index(method):
    # p = [0.2, 0.4, 0.4]: the scores 0.4 (class 1), 0.8 (class 2, ranked after its tie), 1.0
    record = DecisionRecord(
        1.0, 3, **HASHES, n_temperature=10, n_quantile=10, holdout=0.5, seed=0,
        sets=SetRule(method, 0.1, (0.6,), lam=0.1 if method == "raps" else 0.0, k_reg=1),
    )  # fmt: skip
    x = np.log(np.array([[[0.2, 0.4, 0.4]] * 3, [[0.4, 0.4, 0.2]] * 3], dtype=np.float32))
    got = run(decided_session(record), x)
    expected = [[False, True, False], [True, False, False]]
    np.testing.assert_array_equal(apply_decisions(x, record)["prediction_set"], expected)
    np.testing.assert_array_equal(got["prediction_set"], expected)
    assert set(got) == {"member_logits", "calibrated_probs", "prediction_set"}


def test_topk_sets_are_the_k_top_ranked_classes_in_numpy_and_in_the_graph():
    """The top-k score, one registry entry: a class's score is its rank (1 + the classes with a
    larger p, + the tied ones of lower index), qhat the conformal quantile of the true classes'
    ranks on the quantile part is a whole k, and the set is the k top-ranked classes: numpy and
    the graph in ONNX Runtime give the same sets."""
    logits, labels = labelled_logits(600, 3, 5)
    record = fit_decisions(logits, labels, **HASHES, sets="topk", risk=0.3)
    assert record.sets.method == "topk" and record.sets.to_dict()["qhat"] == record.sets.qhat[0]
    # the numpy half against the definition, one class at a time
    probs = calibrated_scores(logits, record.temperature)["probs"]
    ranks = np.array(
        [[1 + sum(q > row[y] or (q == row[y] and j < y) for j, q in enumerate(row))
          for y in range(len(row))] for row in probs]
    )  # fmt: skip
    np.testing.assert_array_equal(class_scores(probs, "topk"), ranks)
    quantile_rows = split_rows(600, record.holdout, record.seed)[1]
    k = conformal_quantile(ranks[quantile_rows, labels[quantile_rows]], 0.1)
    assert record.sets.qhat == (k,) and k == int(k) and 1 < k < 5
    np.testing.assert_array_equal(apply_decisions(logits, record)["prediction_set"], ranks <= k)
    # the graph: ties of every kind (equal logits give equal float32 and float64 probabilities)
    tied = np.array(
        [[[0, 2, 2, 2, 0]] * 3, [[1, 1, 0, -1, -1]] * 3, [[0.0] * 5] * 3, [[3, 0, 0, 0, 3]] * 3],
        dtype=np.float32,
    )
    x = np.concatenate([tied, logits[:200].astype(np.float32)])
    got = run(decided_session(record), x)
    expected = apply_decisions(x, record)
    assert k == 2  # the tied rows' sets, by hand
    np.testing.assert_array_equal(
        expected["prediction_set"][:4],
        [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 1]],
    )
    for name in ("prediction_set", "accept", "ood_flag"):
        np.testing.assert_array_equal(got[name], expected[name])
    np.testing.assert_allclose(got["calibrated_probs"], expected["calibrated_probs"], atol=TOL)
    # class-conditional: one k per class, each the quantile of that class's true ranks
    conditional = fitted("topk", True)
    assert all(q == int(q) for q in conditional.sets.qhat)
    assert_matches(x, conditional, run(decided_session(conditional), x))


@pytest.mark.parametrize("method", METHODS)
def test_extreme_logits_and_batch_one(method):
    record = fitted(method, False, *SCORES[method])
    rows = [
        [[1e4, -1e4, 0, 0, 0]] * 3,  # one class certain, three tied at 0
        [[1e4, 1e4, -1e4, -1e4, -1e4]] * 3,  # two tied at 1/2
        [[1e4, 0, 0, 0, 0], [0, 1e4, 0, 0, 0], [0, 0, 1e4, 0, 0]],  # members disagree
        [[-1e4] * 5] * 3,  # uniform
    ]
    for row in rows:
        x = np.array([row], dtype=np.float32)  # batch 1
        assert_matches(x, record, run(decided_session(record), x))


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_examples_get_no_set_no_answer_and_a_flag(method):
    record = fitted(method, False, *SCORES[method])
    x = labelled_logits(5, 3, 5, seed=3)[0].astype(np.float32)
    x[1, 0, 2], x[2, 1, 0], x[3, 2, 4] = np.nan, np.inf, -np.inf
    got = run(decided_session(record), x)
    expected = apply_decisions(x, record, allow_nonfinite=True)
    np.testing.assert_array_equal(np.isnan(got["calibrated_probs"]).all(axis=1), [0, 1, 1, 1, 0])
    for name in ("prediction_set", "accept", "ood_flag"):
        np.testing.assert_array_equal(got[name][1:4], expected[name][1:4])
    finite = [0, 4]
    assert_matches(x[finite], record, {k: v[finite] for k, v in got.items()})


@pytest.mark.parametrize("opset", [17, 18])
def test_the_graph_is_valid_and_uses_only_the_listed_operators(opset):
    record = fitted("raps", True, "mutual_information", "msp")
    plain = logits_model(3, 5, opset)
    model = add_decisions(plain, record)
    assert plain == logits_model(3, 5, opset)  # a copy: the model given is left as it was
    onnx.checker.check_model(model, full_check=True)
    added = model.graph.node[1:]
    assert {node.op_type for node in added} <= set(DECISION_OPS)
    assert all(node.name.startswith(PREFIX) for node in added)
    assert all(t.name.startswith(PREFIX) for t in model.graph.initializer)
    outputs = {o.name: o.type.tensor_type for o in model.graph.output}
    assert list(outputs) == ["member_logits", *DECISION_OUTPUTS]
    assert outputs["calibrated_probs"].elem_type == TensorProto.FLOAT
    assert {outputs[name].elem_type for name in DECISION_OUTPUTS[1:]} == {TensorProto.BOOL}
    topk_k = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in added:
        if node.op_type == "TopK":  # K is an initializer (TensorRT parses no computed K)
            assert topk_k[node.input[1]].tolist() in ([1], [5])


# ops onnx-tensorrt's importers turn into several layers, or layers without the node's name
MULTI_LAYER_OPS = {"Softmax", "LogSoftmax", "CumSum", "LessOrEqual", "GreaterOrEqual"}
# onnx-tensorrt's elementwiseHelper: an input of lower rank gets a broadcasting IShuffleLayer
ELEMENTWISE_OPS = {"Add", "Sub", "Mul", "Div", "Max", "Equal", "Less", "Greater", "And", "Or"}


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("method", METHODS)
def test_every_decision_node_is_one_tensorrt_layer_of_its_own_name(method, opset):
    """Issue 34, part 2: no operator that TensorRT's parser splits into several or unnamed layers,
    no broadcasting across ranks (a shuffle layer of the parser's), ReduceMax's axes in the form
    the opset takes (an attribute before 18, an initializer from 18), ReduceSum's an initializer,
    and names --layerPrecisions can spell."""
    record = fitted(method, method == "raps", *SCORES[method])
    model = add_decisions(logits_model(3, 5, opset), record)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in (*inferred.input, *inferred.value_info, *inferred.output)
    }
    ranks.update((t.name, len(t.dims)) for t in inferred.initializer)
    initializers = {t.name for t in model.graph.initializer}
    added = model.graph.node[1:]
    names = [node.name for node in added]
    assert len(set(names)) == len(names)
    assert not any("," in name or ":" in name for name in names)
    assert not {node.op_type for node in added} & MULTI_LAYER_OPS
    for node in added:
        if node.op_type in ELEMENTWISE_OPS:
            assert len({ranks[i] for i in node.input}) == 1, node.name
        attributes = {a.name for a in node.attribute}
        if node.op_type == "ReduceMax":
            assert (len(node.input) == 2) == (opset >= 18)
            assert ("axes" in attributes) == (opset < 18)
        if node.op_type in ("ReduceMax", "ReduceSum") and len(node.input) == 2:
            assert node.input[1] in initializers and "axes" not in attributes
        if node.op_type == "ReduceSum":
            assert len(node.input) == 2
    x = labelled_logits(30, 3, 5, seed=8)[0].astype(np.float32)
    assert_matches(x, record, run(session(model), x))


def test_float32_bounds_make_one_comparison_exact():
    """v (float32) > / < the stored float32 bound is the float64 comparison with the threshold,
    for thresholds that are float32 values, halfway between two, and anywhere."""
    rng = np.random.default_rng(9)
    base = np.concatenate([rng.normal(size=200), rng.uniform(0, 1e-6, 50), [0.0, 1.0, -1.0]])
    f32 = base.astype(np.float32)
    thresholds = np.concatenate(
        [
            f32.astype(np.float64),  # exactly a float32
            (f32.astype(np.float64) + np.nextafter(f32, np.float32(np.inf)).astype(np.float64)) / 2,
            base,
        ]
    )
    for t in thresholds:
        near_t = np.float32(t) + np.arange(-3, 4, dtype=np.float32) * np.spacing(np.float32(t))
        values = np.concatenate([near_t, [np.float32(np.nan)]]).astype(np.float32)
        wide = values.astype(np.float64)
        with np.errstate(invalid="ignore"):
            for relation, compare in (
                (">=", wide >= t), (">", wide > t), ("<=", wide <= t), ("<", wide < t)
            ):  # fmt: skip
                bound = np.float32(_float32_bound(t, relation))
                got = values > bound if relation in (">=", ">") else values < bound
                np.testing.assert_array_equal(got, compare, err_msg=f"{relation} {t!r}")


# --- refusals ---------------------------------------------------------------------------------------------
def test_refusals():
    record = fitted("aps")
    no_logits = logits_model(3, 5)
    no_logits.graph.output[0].name = "logits"
    no_logits.graph.node[0].output[0] = "logits"
    half = logits_model(3, 5)
    half.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    clash = logits_model(3, 5)  # a tensor of its own named like a decision output
    clash.graph.node.append(helper.make_node("Neg", ["member_logits"], ["accept"]))
    cases = [
        (no_logits, "no 'member_logits' output"),
        (logits_model(3, 7), "fitted for 5 classes but the model has 7"),
        (logits_model("members", 5), "fixed member count"),
        (logits_model(3, 5, opset=12), "opset 13 or newer"),
        (half, "not float32"),
        (add_decisions(logits_model(3, 5), record), "call remove_decisions(model) first"),
        (clash, "already has decisions (accept)"),
    ]
    for model, message in cases:
        with pytest.raises(ExportError) as refused:
            add_decisions(model, record)
        assert message in str(refused.value) and "\n" not in str(refused.value)


def test_dynamic_class_count_is_taken_from_the_record():
    record = fitted("aps", True, "msp", "predictive_entropy")
    sess = session(add_decisions(logits_model(3, "classes"), record))
    x = labelled_logits(40, 3, 5, seed=4)[0].astype(np.float32)
    assert_matches(x, record, run(sess, x))


def test_topk_limit_refuses_sorted_sets_over_too_many_classes():
    classes = TOPK_MAX_K + 1
    record = DecisionRecord(
        1.0, classes, **HASHES, n_temperature=10, n_quantile=10, holdout=0.5, seed=0,
        sets=SetRule("aps", 0.1, (0.9,)),
        selective=SelectiveRule("msp", 0.1, 0.1, 0.5, 10, 0.5),
        ood=OodRule("msp", 0.05, -0.2),
    )  # fmt: skip
    with pytest.raises(ExportError, match=r"TopK takes K <= 3840.*\(sets='lac'\)"):
        add_decisions(logits_model(3, classes), record)
    with command_spelling({}), pytest.raises(ExportError, match=r"K <= 3840.*\(--sets lac\)"):
        add_decisions(logits_model(3, classes), record)
    lac = replace(record, sets=SetRule("lac", 0.1, (0.9,)))  # LAC sorts nothing: no limit
    x = np.random.default_rng(5).normal(size=(2, 3, classes)).astype(np.float32)
    assert_matches(x, lac, run(decided_session(lac), x))


# --- remove_decisions -----------------------------------------------------------------------------------
def test_remove_decisions_restores_the_outputs_and_allows_new_ones():
    base = logits_model(3, 5)
    extra = helper.make_node("Neg", ["member_logits"], ["negated"], name="negated")
    base.graph.node.append(extra)  # an output of the model's own, kept
    base.graph.output.append(
        helper.make_tensor_value_info("negated", TensorProto.FLOAT, ["batch", 3, 5])
    )
    first = add_decisions(base, fitted("raps", True, "mutual_information", "msp"))
    removed = remove_decisions(first)
    assert [o.name for o in removed.graph.output] == ["member_logits", "negated"]
    assert [n.name for n in removed.graph.node] == ["logits", "negated"]
    assert not removed.graph.initializer
    onnx.checker.check_model(removed, full_check=True)
    x = labelled_logits(8, 3, 5, seed=6)[0].astype(np.float32)
    out = run(session(removed), x)
    np.testing.assert_array_equal(out["member_logits"], x)
    np.testing.assert_array_equal(out["negated"], -x)

    again = fitted("lac", False, "predictive_entropy", None)
    replaced = add_decisions(removed, again)
    got = run(session(replaced), x)
    got.pop("negated")
    assert_matches(x, again, got)
    assert remove_decisions(base) == base  # nothing to remove: the same model


# --- a real export --------------------------------------------------------------------------------------
def test_decisions_in_a_tiny_hydra_export(tiny_export):
    model = onnx.load(str(tiny_export / "model.onnx"))
    plain = session(model)
    images = torch.randn(240, 3, 16, 16, generator=torch.Generator().manual_seed(0)).numpy()
    logits = plain.run(["member_logits"], {"pixel_values": images})[0]
    labels = logits.mean(axis=1).argmax(axis=1)  # the model's own answer: accurate "labels"
    labels[::7] = (labels[::7] + 1) % logits.shape[2]
    record = fit_decisions(logits, labels, **HASHES, sets="aps", risk=0.3, ood_score="msp")

    decided = add_decisions(model, record)
    onnx.checker.check_model(decided)
    got = dict(
        zip(
            [o.name for o in decided.graph.output],
            session(decided).run(None, {"pixel_values": images[:16]}),
            strict=True,
        )
    )
    np.testing.assert_array_equal(got["member_logits"], logits[:16])
    assert_matches(logits[:16], record, got)
    restored = remove_decisions(decided)
    assert [o.name for o in restored.graph.output] == [o.name for o in model.graph.output]
    assert len(restored.graph.node) == len(model.graph.node)
