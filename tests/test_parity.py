"""parity's one rule for argmax agreement: near-ties are counted, not judged (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

from hydra_deploy.parity import (
    TIE_MARGIN,
    TOLERANCES,
    BackendReport,
    clear_margin,
    compare_outputs,
    tolerance_for,
)


def report_of(reference: np.ndarray, got: np.ndarray, precision: str) -> BackendReport:
    tolerance = tolerance_for(precision)
    report = BackendReport("onnxruntime", "model.onnx", precision, "compared", tolerance=tolerance)
    report.members, report.scores = compare_outputs(reference, {"member_logits": got}, tolerance)
    return report


def clear_logits(batch: int = 96, members: int = 3, classes: int = 10) -> np.ndarray:
    """Logits whose top class leads the next by 3 (far beyond 2 x the fp16 bound of 0.05 x 5)."""
    rng = np.random.default_rng(0)
    logits = rng.uniform(-1, 1, (batch, members, classes))
    top = rng.integers(0, classes, (batch, members))
    np.put_along_axis(logits, top[..., None], 4.0, axis=-1)
    return logits


def test_a_flip_between_near_tied_classes_is_counted_not_judged():
    reference = clear_logits()
    reference[7, 1, :2] = [4.0, 3.99]  # a near-tie: margin 0.01 against a logit bound of 0.2
    reference[7, 1, 2:] = 0.0
    got = reference.copy()
    got[7, 1, :2] = [3.99, 4.0]  # fp16 rounding may flip it: within tolerance
    report = report_of(reference, got, "fp16")
    assert report.passed, report.failures()
    argmax = next(c for c in report.members if c.name == "argmax" and c.member == 1)
    assert (argmax.judged, argmax.near_ties, argmax.value) == (95, 1, 1.0)
    assert report.near_ties() == (1, 288) and not report.looks_untrained()
    verdict = report.verdict()
    assert verdict.startswith("within the fp16 tolerances")
    assert "argmax judged on 287 of 288 member predictions (1 near-ties" in verdict
    # the old rule, every example judged, said 95/96 = 98.96% < 99%: BEYOND
    assert np.mean(reference[:, 1].argmax(-1) == got[:, 1].argmax(-1)) < TOLERANCES["fp16"].argmax


def test_a_flip_with_a_clear_margin_fails():
    reference = clear_logits()
    got = reference.copy()
    got[3, 0] = np.roll(got[3, 0], 1)  # the top class moves: a wrong backend
    report = report_of(reference, got, "fp16")
    assert not report.passed
    assert any(c.name == "argmax" and c.member == 0 and not c.passed for c in report.members)
    assert report.verdict().startswith("BEYOND the fp16 tolerances: member 0")


def test_an_untrained_model_is_said_to_look_untrained():
    reference = np.random.default_rng(1).normal(0, 0.01, (32, 3, 1000))  # random-init logits
    got = reference + np.random.default_rng(2).normal(0, 0.004, reference.shape)
    report = report_of(reference, got, "fp16")
    assert report.passed and report.looks_untrained()
    assert report.near_ties() == (96, 96)
    assert "the model looks untrained (random weights?)" in report.verdict()
    for check in report.members + report.scores:
        if check.kind == "agreement":
            assert check.judged == 0 and check.passed
    assert report.summary()["looks_untrained"] is True


def test_clear_margin_is_two_error_bounds():
    values = np.array([[1.0, 1.0 + 2 * 0.1 + 1e-9, 0.0], [1.0, 1.1, 0.0], [5.0, 0.0, 0.0]])
    assert TIE_MARGIN == 2
    assert clear_margin(values, 0.1).tolist() == [True, False, True]
    assert clear_margin(np.zeros((2, 1)), 1.0).tolist() == [True, True]  # one class: no tie


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
def test_identical_outputs_pass_every_precision(precision):
    reference = clear_logits(batch=8)
    assert report_of(reference, reference.copy(), precision).passed


def test_the_int8_row():
    int8 = TOLERANCES["int8"]
    assert int8.argmax == 0.98 and int8.logits_relative
    assert int8.logits >= TOLERANCES["bf16"].logits and int8.probs >= TOLERANCES["bf16"].probs
