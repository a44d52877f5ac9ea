"""Issue 36, item 5: every count a calibration message states is what the user gave, with the
split named: "10 calibration examples (5 for the temperature, 5 for the thresholds) are too few
for prediction sets: alpha 0.1 needs at least 9 for the thresholds, so at least 18 in all"."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.decisions import (
    describe_split,
    fit_decisions,
    min_calibration_size,
    split_rows,
    temperature_warning,
)
from hydra_deploy.errors import DataError, command_spelling
from hydra_deploy.options import PARAMETER_FLAGS

SHA = "0" * 64
SPLIT = re.compile(
    r"^(\d+) calibration examples? \((\d+) for the temperature, (\d+) for the thresholds\)"
)
NEEDS = re.compile(
    r"needs at least (\d+) for the (thresholds|temperature), so at least (\d+) in all"
)


def _data(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, count)
    logits = rng.normal(size=(count, 2, 4)).astype(np.float32)
    logits[np.arange(count), :, labels] += 2.0  # a model that is right most of the time
    return logits, labels


def _fit(count: int, **kwargs):
    logits, labels = _data(count)
    return fit_decisions(logits, labels, onnx_sha256=SHA, data_sha256=SHA, **kwargs)


def _part_size(total: int, holdout: float, part: str) -> int:
    quantile = round(total * holdout)
    return quantile if part == "thresholds" else total - quantile


RULES = {
    # (the fit's keywords for a level alpha, the part it needs, the name of the level)
    "sets": (lambda a: {"alpha": a, "ood_alpha": None}, "thresholds", "alpha"),
    "ood": (lambda a: {"alpha": None, "ood_alpha": a}, "thresholds", "ood_alpha"),
    "raps": (lambda a: {"alpha": a, "sets": "raps", "ood_alpha": None}, "temperature", "alpha"),
}


@settings(max_examples=150, deadline=None)
@given(
    count=st.integers(2, 80),
    holdout=st.sampled_from([0.3, 0.5, 0.7]),
    alpha=st.sampled_from([0.05, 0.1, 0.2, 0.25]),
    rule=st.sampled_from(sorted(RULES)),
)
def test_a_too_few_message_counts_what_was_given(count, holdout, alpha, rule):
    keywords, part, level = RULES[rule]
    t_rows, q_rows = split_rows(count, holdout)  # the split the fit makes (seed 0)
    needed = min_calibration_size(alpha)
    if part == "temperature" and len(t_rows) >= needed:
        part = "thresholds"  # RAPS's parameters fitted: then its sets need the thresholds' part
    in_part = len(q_rows) if part == "thresholds" else len(t_rows)
    try:
        _fit(count, holdout=holdout, **keywords(alpha))
    except DataError as err:
        message = str(err)
        if "cannot be split" in message:
            assert message.startswith(f"{count} calibration example")
            return
        split = SPLIT.match(message)
        assert split, message
        assert [int(n) for n in split.groups()] == [count, len(t_rows), len(q_rows)]
        needs = NEEDS.search(message)
        assert needs, message
        assert (int(needs[1]), needs[2]) == (needed, part)
        total = int(needs[3])
        assert _part_size(total, holdout, part) >= needed  # that many are enough ...
        assert _part_size(total - 1, holdout, part) < needed  # ... and the fewest that are
        assert in_part < needed
        assert f"{level} {alpha:g} needs" in message
        return
    assert in_part >= needed  # fitted: the part held enough


def test_the_issue_numbers():
    """10 given at alpha 0.1: 5 and 5, 9 needed for the thresholds, 18 in all; a command says
    --alpha."""
    with pytest.raises(DataError) as caught:
        _fit(10, ood_alpha=None)
    assert str(caught.value) == (
        "10 calibration examples (5 for the temperature, 5 for the thresholds) are too few for "
        "prediction sets: alpha 0.1 needs at least 9 for the thresholds, so at least 18 in all; "
        "give more labelled data, or a larger alpha"
    )
    with command_spelling(PARAMETER_FLAGS), pytest.raises(DataError) as caught:
        _fit(10, alpha=None, ood_alpha=0.05)
    assert "--ood-alpha 0.05 needs at least 19 for the thresholds, so at least 38 in all" in str(
        caught.value
    )
    assert "a larger --ood-alpha" in str(caught.value)
    assert describe_split(200, 200) == (
        "400 calibration examples (200 for the temperature, 200 for the thresholds)"
    )
    assert (
        describe_split(1, 1)
        == "2 calibration examples (1 for the temperature, 1 for the thresholds)"
    )


def test_the_risk_refusal_names_the_split():
    with pytest.raises(DataError) as caught:
        _fit(30, alpha=None, ood_alpha=None, risk=0.0001)
    message = str(caught.value)
    assert "on 30 calibration examples (15 for the temperature, 15 for the thresholds)" in message
    assert "ask for a larger risk, a larger delta" in message
    with command_spelling(PARAMETER_FLAGS), pytest.raises(DataError) as caught:
        _fit(30, alpha=None, ood_alpha=None, risk=0.0001)
    assert "ask for a larger --risk, a larger --delta" in str(caught.value)


def test_class_conditional_names_the_class_and_the_split():
    logits, labels = _data(60)
    labels[labels == 3] = 0
    labels[:2] = 3  # class 3 is rare
    with pytest.raises(DataError) as caught:
        fit_decisions(
            logits,
            labels,
            onnx_sha256=SHA,
            data_sha256=SHA,
            class_conditional=True,
            class_names=list("abcd"),
        )
    message = str(caught.value)
    held = np.bincount(labels[split_rows(60, 0.5)[1]], minlength=4)
    first = int(np.flatnonzero(held < 9)[0])
    assert message.startswith(
        "60 calibration examples (30 for the temperature, 30 for the thresholds) are too few for "
        f"class-conditional sets: class {first} ({'abcd'[first]})"
    )
    assert f"has {held[first]} of the 30 for the thresholds" in message
    assert "alpha 0.1 needs at least 9 of each class there" in message


def test_the_temperature_warning_counts_both():
    logits, labels = _data(10)
    logits = logits * 0.0  # flat: T at its upper bound
    warning = temperature_warning(20.0, logits[:5], labels[:5], of=10)
    assert warning and "the temperature part (5 of the 10 given;" in warning
    one = temperature_warning(20.0, logits[:1], labels[:1])
    assert one and "the temperature part (1 example;" in one
