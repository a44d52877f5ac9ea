"""Which arrays of a .npz feed the model: one rule (hydra_deploy.engines.inputs.pick_inputs) for
hydra-run, hydra-eval and hydra-compare, and the same answer from each."""

from __future__ import annotations

import numpy as np
import pytest

from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.sources import read_arrays
from hydra_deploy.errors import HydraError, RunnerError
from hydra_deploy.evaluation.compare import compare_export
from hydra_deploy.evaluation.evaluate import load_eval_data

TEXT = ("input_ids", "attention_mask", "token_type_ids")
A, B = np.zeros((2, 3)), np.ones((2, 3))
IDS, MASK, TYPES = np.full((2, 4), 7), np.ones((2, 4), int), np.zeros((2, 4), int)


@pytest.mark.parametrize(
    ("arrays", "names", "expected"),
    [
        ({"pixel_values": A, "x": B}, ("pixel_values",), A),  # the input's own name wins
        ({"x": B, "y": A}, ("pixel_values",), B),
        ({"x": B}, (), B),
        (
            {"input_ids": IDS, "attention_mask": MASK},
            TEXT,
            {"input_ids": IDS, "attention_mask": MASK},
        ),
        (
            {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": TYPES, "x": A},
            TEXT,
            {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": TYPES},
        ),
    ],
)
def test_the_rule(arrays, names, expected):
    got = pick_inputs(arrays, names, "f.npz")
    if isinstance(expected, dict):
        assert set(got) == set(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("arrays", "names", "message"),
    [
        (
            {"images": A},
            ("pixel_values",),
            "f.npz holds arrays ['images']; name the input array 'x' or 'pixel_values' (the model's input)",
        ),
        ({"images": A}, (), "f.npz holds arrays ['images']; name the input array 'x'"),
        (
            {"input_ids": IDS, "x": A},
            TEXT,
            "f.npz holds arrays ['input_ids', 'x']; the model takes ['input_ids', 'attention_mask', 'token_type_ids']: name the arrays input_ids, attention_mask (and optionally token_type_ids)",
        ),
    ],
)
def test_what_the_rule_refuses(arrays, names, message):
    with pytest.raises(RunnerError) as caught:
        pick_inputs(arrays, names, "f.npz")
    assert str(caught.value) == message


def test_every_command_gives_the_same_answer(tiny_export, tmp_path):
    path = tmp_path / "wrong.npz"
    np.savez(path, images=np.zeros((2, 3, 16, 16), np.float32))
    answers = []
    with load_runner(tiny_export, providers=["cpu"]) as runner:
        with pytest.raises(HydraError) as run:
            read_arrays(path, runner)  # hydra-run
        answers.append(str(run.value))
        with pytest.raises(HydraError) as evaluate:
            load_eval_data(path, runner, name="ood:wrong", labelled=False)  # hydra-eval
        answers.append(str(evaluate.value))
    with pytest.raises(HydraError) as compare:
        compare_export(tiny_export, inputs=path)  # hydra-compare
    answers.append(str(compare.value))
    rule = "holds arrays ['images']; name the input array 'x' or 'pixel_values' (the model's input)"
    assert all(answer.endswith(rule) for answer in answers), answers
    np.savez(path, x=np.zeros((2, 3, 16, 16), np.float32))  # the same file, named right
    with load_runner(tiny_export, providers=["cpu"]) as runner:
        assert read_arrays(path, runner).shape == (2, 3, 16, 16)
        assert load_eval_data(path, runner, name="ood", labelled=False) is not None
    assert compare_export(tiny_export, inputs=path).passed


def test_score_batch_is_the_ensemble_scores_of_the_runners_logits(tiny_export):
    from hydra_deploy.engines.scoring import run_member_logits, score_batch
    from hydra_deploy.uncertainty import SCORE_NAMES, ensemble_scores

    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    with load_runner(tiny_export, providers=["cpu"]) as runner:
        logits = runner(x)["member_logits"]
        scores = score_batch(runner, x, batch_size=2)  # split into batches of 2, same numbers
        np.testing.assert_array_equal(run_member_logits(runner, x), logits)
    expected = ensemble_scores(logits)
    np.testing.assert_allclose(scores["member_logits"], logits, rtol=0, atol=1e-6)
    for name in (*SCORE_NAMES, "prediction"):
        np.testing.assert_allclose(scores[name], expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_a_model_without_member_logits_gets_one_message():
    from hydra_deploy.engines.scoring import run_member_logits

    class Plain:
        path = "plain.onnx"

        def __call__(self, inputs, batch_size=None):
            return {"y": np.zeros((1, 2))}

    with pytest.raises(RunnerError) as caught:
        run_member_logits(Plain(), np.zeros((1, 2)))
    assert str(caught.value) == (
        "plain.onnx has no 'member_logits' output (outputs: ['y']); is it a Hydra export?"
    )
