"""Uncertainty scores (numpy) and the ensemble head in the exported graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers.vit import tiny_vit
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.special import log_softmax as scipy_log_softmax
from scipy.special import softmax as scipy_softmax
from scipy.stats import entropy as scipy_entropy

from hydra_deploy.errors import HydraError
from hydra_deploy.export import export_onnx
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores


def reference(logits: np.ndarray) -> dict[str, np.ndarray]:
    """The definitions, one example and member at a time (scipy-free, float64)."""
    B = logits.shape[0]
    out = {
        k: []
        for k in (
            "probs",
            "msp",
            "predictive_entropy",
            "expected_entropy",
            "mutual_information",
            "disagreement",
        )
    }
    for b in range(B):
        member = [np.exp(row - row.max()) / np.exp(row - row.max()).sum() for row in logits[b]]
        probs = np.mean(member, axis=0)
        entropy = lambda p: -sum(x * np.log(x) for x in p if x > 0)  # noqa: E731
        pe, ee = entropy(probs), np.mean([entropy(p) for p in member])
        out["probs"].append(probs)
        out["msp"].append(probs.max())
        out["predictive_entropy"].append(pe)
        out["expected_entropy"].append(ee)
        out["mutual_information"].append(max(pe - ee, 0.0))
        out["disagreement"].append(np.mean([np.argmax(r) != np.argmax(probs) for r in logits[b]]))
    return {k: np.asarray(v) for k, v in out.items()}


@given(
    arrays(
        np.float64,
        st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(2, 7)),
        elements=st.floats(-30, 30),
    )
)
def test_scores_match_their_definitions(logits):
    scores = ensemble_scores(logits)
    expected = reference(logits)
    for name, value in expected.items():
        np.testing.assert_allclose(scores[name], value, atol=2e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(
        np.log(scores["member_probs"].astype(np.float64).clip(1e-300)),
        scipy_log_softmax(logits, axis=-1).clip(np.log(1e-300)),
        atol=1e-4,
        rtol=1e-5,
    )
    assert (scores["mutual_information"] >= 0).all()
    np.testing.assert_allclose(scores["probs"].sum(-1), 1.0, atol=1e-5)


def test_scores_hand_case():
    # two members, fully confident in different classes: maximal disagreement, MI = log 2
    logits = np.array([[[50.0, 0.0], [0.0, 50.0]]])
    scores = ensemble_scores(logits)
    np.testing.assert_allclose(scores["probs"], [[0.5, 0.5]], atol=1e-6)
    assert scores["mutual_information"][0] == pytest.approx(np.log(2), abs=1e-5)
    assert scores["expected_entropy"][0] == pytest.approx(0.0, abs=1e-5)
    # identical members: MI = 0, nobody disagrees
    same = ensemble_scores(np.array([[[1.0, 2.0, 3.0]] * 3]))
    assert same["mutual_information"][0] == pytest.approx(0.0, abs=1e-6)
    assert same["disagreement"][0] == 0.0


def test_scores_refuse_bad_input():
    with pytest.raises(HydraError, match="batch, members, classes"):
        ensemble_scores(np.zeros((2, 3)))
    with pytest.raises(HydraError, match="no empty axis"):
        ensemble_scores(np.zeros((0, 3, 4)))
    with pytest.raises(HydraError, match="float array"):
        ensemble_scores(np.zeros((1, 2, 3), dtype=bool))
    logits = np.zeros((4, 2, 3))
    logits[2, 1, 0] = np.nan
    logits[3, 0, 2] = np.inf
    with pytest.raises(
        HydraError,
        match=r"NaN or infinite values in 2 of 4 examples \(first: example 2, member 1\).*"
        r"pass allow_nonfinite=True to get NaN scores",
    ):
        ensemble_scores(logits)


# --- an independent reference: scipy, vectorised differently -------------------------------------
logit_arrays = arrays(
    np.float64,
    st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(2, 7)),
    elements=st.floats(-50, 50, allow_nan=False),
)


@given(logit_arrays)
def test_scores_equal_scipy(logits):
    scores = ensemble_scores(logits)
    member_probs = scipy_softmax(logits, axis=-1)
    probs = member_probs.mean(axis=1)
    predictive = scipy_entropy(probs, axis=-1)  # natural log, 0 log 0 = 0
    expected = scipy_entropy(member_probs, axis=-1).mean(axis=1)
    np.testing.assert_allclose(scores["member_probs"], member_probs, atol=1e-6)
    np.testing.assert_allclose(scores["probs"], probs, atol=1e-6)
    np.testing.assert_allclose(scores["predictive_entropy"], predictive, atol=2e-5)
    np.testing.assert_allclose(scores["expected_entropy"], expected, atol=2e-5)
    np.testing.assert_allclose(
        scores["mutual_information"], np.maximum(predictive - expected, 0), atol=2e-5
    )
    np.testing.assert_allclose(scores["msp"], probs.max(-1), atol=1e-6)
    assert scores["prediction"].dtype == np.int64
    top2 = np.sort(probs, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-9  # float64 argmax; exact ties may go either way
    np.testing.assert_array_equal(scores["prediction"][clear], probs.argmax(-1)[clear])
    assert scores["member_probs"].shape == logits.shape


def test_member_probs_equal_scikit_learn_softmax():
    from sklearn.utils.extmath import softmax as sklearn_softmax

    logits = np.random.default_rng(0).normal(0, 5, size=(6, 3, 9))
    scores = ensemble_scores(logits)
    expected = sklearn_softmax(logits.reshape(-1, 9).copy()).reshape(logits.shape)
    np.testing.assert_allclose(scores["member_probs"], expected, atol=1e-6)


@given(logit_arrays)
def test_score_invariants(logits):
    scores = ensemble_scores(logits)
    _, M, C = logits.shape
    tol = 1e-5
    np.testing.assert_allclose(scores["probs"].sum(-1), 1.0, atol=tol)
    np.testing.assert_allclose(scores["member_probs"].sum(-1), 1.0, atol=tol)
    assert ((scores["probs"] >= 0) & (scores["probs"] <= 1)).all()
    log_c = np.log(C)
    for name in ("predictive_entropy", "expected_entropy", "mutual_information"):
        assert (scores[name] >= -tol).all() and (scores[name] <= log_c + tol).all(), name
    # H[mean] >= mean H (concavity): MI was not created by the clip alone
    assert (scores["predictive_entropy"] >= scores["expected_entropy"] - tol).all()
    assert (scores["msp"] >= 1.0 / C - tol).all() and (scores["msp"] <= 1 + tol).all()
    d = scores["disagreement"]
    assert ((d >= 0) & (d <= 1)).all()
    np.testing.assert_allclose(d * M, np.round(d * M), atol=1e-5)  # a count of members over M
    if M == 1:
        np.testing.assert_allclose(scores["mutual_information"], 0.0, atol=tol)


@given(logit_arrays, st.randoms(use_true_random=False), st.floats(-100, 100))
def test_scores_ignore_member_order_and_logit_shifts(logits, random, shift):
    scores = ensemble_scores(logits)
    order = list(range(logits.shape[1]))
    random.shuffle(order)
    shifted = logits[:, order] + shift * np.arange(logits.shape[1])[order][None, :, None]
    other = ensemble_scores(shifted)
    for name in ("probs", "msp", "predictive_entropy", "expected_entropy", "mutual_information"):
        np.testing.assert_allclose(other[name], scores[name], atol=1e-4, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_extreme_logits_stay_finite(dtype):
    big = 1e4 if dtype != np.float16 else 6e4  # float16 tops out at 65504
    logits = np.array(
        [
            [[big, -big, 0.0], [-big, big, 0.0]],  # confident, disagreeing members
            [[big, big, -big], [big, big, -big]],  # a tie at the top
            [[-big, -big, -big], [-big, -big, -big]],  # all equal, very negative
        ],
        dtype=dtype,
    )
    scores = ensemble_scores(logits)
    for name, value in scores.items():
        assert np.isfinite(value).all(), name
    np.testing.assert_allclose(scores["probs"][0], [0.5, 0.5, 0.0], atol=1e-6)
    assert scores["mutual_information"][0] == pytest.approx(np.log(2), abs=1e-5)
    assert scores["disagreement"][0] == pytest.approx(0.5)
    assert scores["predictive_entropy"][1] == pytest.approx(np.log(2), abs=1e-5)
    assert scores["predictive_entropy"][2] == pytest.approx(np.log(3), abs=1e-5)
    assert scores["mutual_information"][2] == pytest.approx(0.0, abs=1e-6)


def test_nonfinite_logits_pass_through_as_nan_when_allowed():
    logits = np.random.default_rng(1).normal(size=(5, 3, 4))
    logits[1, 2, 3] = np.inf
    logits[3, 0, 0] = np.nan
    scores = ensemble_scores(logits, allow_nonfinite=True)
    finite = [0, 2, 4]
    alone = ensemble_scores(logits[finite])
    for name, value in scores.items():
        if name == "prediction":
            np.testing.assert_array_equal(value[[1, 3]], -1)
        else:
            assert np.isnan(value[[1, 3]]).all(), name
        np.testing.assert_array_equal(value[finite], alone[name], err_msg=name)


def test_scalar_score_names_are_returned():
    from hydra_deploy.uncertainty import SCALAR_SCORES, SCORE_NAMES

    scores = ensemble_scores(np.zeros((2, 3, 4)))
    assert set(SCORE_NAMES) | set(SCALAR_SCORES) | {"prediction", "member_probs"} == set(scores)
    assert all(scores[name].shape == (2,) for name in SCALAR_SCORES)


def test_torch_head_equals_numpy_scores():
    hydra = fuse(tiny_vit("token"), HydraSpec.random("t", 3, 4, 8, members=3, heads_per_member=2))
    x = hydra.example_inputs(4)
    with torch.no_grad():
        logits, *uq = WithEnsembleHead(hydra)(x)
    expected = ensemble_scores(logits.numpy())
    for name, value in zip(UQ_OUTPUTS, uq, strict=True):
        np.testing.assert_allclose(value.numpy(), expected[name], atol=1e-5, err_msg=name)


def test_uq_outputs_in_the_exported_graph(tmp_path):
    hydra = fuse(tiny_vit("token"), HydraSpec.random("t", 3, 4, 8, members=3, heads_per_member=2))
    info = export_onnx(hydra, tmp_path / "uq", uq_outputs=True, batch=(1, 2, 4))
    names = [o["name"] for o in info.record["outputs"]]
    assert names == ["member_logits", *UQ_OUTPUTS] and info.uq_outputs
    assert info.exporter == "dynamo" and info.graph_passes["fold_attention_scale"] == 3
    assert set(info.validation["batches"]["4"]) == set(names)  # every output validated
    session = ort.InferenceSession(
        str(tmp_path / "uq" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    x = hydra.example_inputs(5, seed=3).numpy()
    outputs = dict(zip(names, session.run(None, {"pixel_values": x}), strict=True))
    expected = ensemble_scores(outputs["member_logits"])
    for name in UQ_OUTPUTS:
        assert outputs[name].dtype == np.float32
        np.testing.assert_allclose(outputs[name], expected[name], atol=1e-5, err_msg=name)
