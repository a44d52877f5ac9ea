"""Issue 36, item 6: a message says its advice in one spelling, the caller's: inside a command
the flag (``--allow-nonfinite``), from Python the parameter (``allow_nonfinite=True``), never
both side by side."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hydra_deploy.engines.precision_rules import choose_precision
from hydra_deploy.engines.runner_base import TensorSpec, _check_one
from hydra_deploy.errors import HydraError, command_spelling
from hydra_deploy.options import PARAMETER_FLAGS
from hydra_deploy.uncertainty import ensemble_scores

SPEC = TensorSpec("pixel_values", ("batch", 3, 16, 16), "float32")
NAN_INPUT = np.full((2, 3, 16, 16), np.nan, np.float32)
NAN_LOGITS = np.full((1, 2, 3), np.nan)


def _message(call) -> str:
    with pytest.raises(HydraError) as caught:
        call()
    return str(caught.value)


CASES = [
    # (what raises, the Python advice, the command advice)
    (
        lambda: _check_one(SPEC, NAN_INPUT, False),
        "pass allow_nonfinite=True to run it anyway",
        "run it anyway with hydra-run --allow-nonfinite",
    ),
    (
        lambda: ensemble_scores(NAN_LOGITS),
        "pass allow_nonfinite=True",
        "hydra-run --allow-nonfinite",
    ),
    (
        lambda: choose_precision("fp16", "fp16", "11.0", sm=90, strongly_typed=False),
        "(strongly_typed=False)",
        "(--weakly-typed)",
    ),
    (
        lambda: choose_precision("fp16", "fp16", "8.6", sm=90, strongly_typed=True),
        "leave strongly_typed unset",
        "drop --strongly-typed",
    ),
    (
        lambda: choose_precision("fp16", "fp32", "10.12", sm=90),
        "with strongly_typed=False)",
        "with --weakly-typed)",
    ),
    (
        lambda: choose_precision("fp32", "int8", "8.6", sm=87),
        "build it with precision int8",
        "build it with --precision int8",
    ),
    (
        lambda: choose_precision("bf16", "fp32", "10.3", sm=75),
        "use precision fp16",
        "use --precision fp16",
    ),
]

#: a library parameter written as Python (name=value)
_PYTHON = re.compile(r"\b[a-z]+_[a-z_]+=(True|False|None|\d)")


@pytest.mark.parametrize("call, python, command", CASES)
def test_one_spelling_each(call, python, command):
    from_python = _message(call)
    assert python in from_python, from_python
    assert command not in from_python, from_python
    with command_spelling(PARAMETER_FLAGS):
        from_command = _message(call)
    assert command in from_command, from_command
    assert python not in from_command and not _PYTHON.search(from_command), from_command
    assert "strongly_typed" not in from_command and "allow_nonfinite" not in from_command


# --- plurals: a count of 1 takes the singular ---------------------------------------------------
def test_a_count_of_one_is_singular():
    from hydra_deploy.uncertainty.metrics import ece

    one_nan = np.full((1, 2, 3), np.nan)
    assert "in 1 of 1 example (first" in _message(lambda: ensemble_scores(one_nan))
    vector = TensorSpec("x", ("batch",), "float32")
    assert "must have 1 dimension ['batch']" in _message(
        lambda: _check_one(vector, np.zeros((2, 2), np.float32), False)
    )
    bad_row = np.array([[0.5, 0.6], [0.5, 0.5]])
    message = _message(lambda: ece(bad_row, np.array([0, 1])))
    assert "1 row does not" in message, message
    for text in (message, _message(lambda: ensemble_scores(one_nan))):
        assert not re.search(r"\b1 (examples|rows|classes|values)\b|\(s\)", text), text
