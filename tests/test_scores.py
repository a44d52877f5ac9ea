"""Uncertainty scores (numpy) and the ensemble head in the exported graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import tiny_vit
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hydra_deploy.errors import HydraError
from hydra_deploy.export import export_onnx
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores


def reference(logits: np.ndarray) -> dict[str, np.ndarray]:
    """The definitions, one example and member at a time (scipy-free, float64)."""
    B = logits.shape[0]
    out = {k: [] for k in ("probs", "msp", "predictive_entropy", "expected_entropy",
                           "mutual_information", "disagreement")}  # fmt: skip
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


@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(2, 7)),
              elements=st.floats(-30, 30)))  # fmt: skip
def test_scores_match_their_definitions(logits):
    scores = ensemble_scores(logits)
    expected = reference(logits)
    for name, value in expected.items():
        np.testing.assert_allclose(scores[name], value, atol=2e-5, rtol=1e-5, err_msg=name)
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
    with pytest.raises(HydraError, match="NaN"):
        ensemble_scores(np.array([[[np.nan, 0.0]]]))


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
    names = [o["name"] for o in info["outputs"]]
    assert names == ["member_logits", *UQ_OUTPUTS] and info["uq_outputs"]
    assert info["exporter"] == "dynamo" and info["graph_passes"]["fold_attention_scale"] == 3
    assert set(info["validation"]["batches"]["4"]) == set(names)  # every output validated
    session = ort.InferenceSession(str(tmp_path / "uq" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    x = hydra.example_inputs(5, seed=3).numpy()
    outputs = dict(zip(names, session.run(None, {"pixel_values": x}), strict=True))
    expected = ensemble_scores(outputs["member_logits"])
    for name in UQ_OUTPUTS:
        assert outputs[name].dtype == np.float32
        np.testing.assert_allclose(outputs[name], expected[name], atol=1e-5, err_msg=name)
