"""Issue 36, item 6: the advice for an image array that does not fit names every axis that
differs (channels, height, width) with its fix, and no axis that matches."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.engines.runner_base import TensorSpec, _check_one, image_axes_advice
from hydra_deploy.errors import RunnerError, command_spelling

channels = st.sampled_from([1, 3, 4])  # grey, RGB, RGBA data
model_channels = st.sampled_from([1, 3])  # what an image model takes
sides = st.sampled_from([8, 16, 24])


def _named(message: str) -> dict[str, tuple[int, int]]:
    """The axes the advice names: {axis: (given, wanted)}."""
    return {
        axis: (int(given), int(wanted))
        for axis, given, wanted in re.findall(r"\b(channels|height|width) (\d+) vs (\d+)", message)
    }


@settings(max_examples=200, deadline=None)
@given(model_channels, sides, sides, channels, sides, sides)
def test_every_differing_axis_is_named_and_no_matching_one(want_c, want_h, want_w, c, h, w):
    spec = TensorSpec("pixel_values", ("batch", want_c, want_h, want_w), "float32")
    wanted = {"channels": want_c, "height": want_h, "width": want_w}
    given_ = {"channels": c, "height": h, "width": w}
    differ = {axis: (given_[axis], wanted[axis]) for axis in wanted if given_[axis] != wanted[axis]}
    if not differ:
        _check_one(spec, np.zeros((2, c, h, w), np.float32), False)  # it fits: no error
        assert image_axes_advice((want_c, want_h, want_w), (c, h, w)) == ""
        return
    with pytest.raises(RunnerError) as caught:
        _check_one(spec, np.zeros((2, c, h, w), np.float32), False)
    message = str(caught.value)
    assert _named(message) == differ, message
    if "channels" in differ:
        assert "channels-last" not in message  # channels first, as given
    if "height" in differ or "width" in differ:
        assert f"resize (or crop) them to {want_h} x {want_w}" in message
    # the lead names each differing axis by its index too
    for axis, name in enumerate(("channels", "height", "width"), start=1):
        assert (f" on axis {axis}" in message) == (name in differ), message


@settings(max_examples=100, deadline=None)
@given(model_channels, sides, sides, channels, sides)
def test_channels_last_arrays_are_read_as_such(want_c, want_h, want_w, c, side):
    """[N, H, W, C] with C a channel count and H not one: transpose first, then the axes that
    still differ after it."""
    spec = TensorSpec("pixel_values", ("batch", want_c, want_h, want_w), "float32")
    with pytest.raises(RunnerError) as caught:
        _check_one(spec, np.zeros((2, side, side, c), np.float32), False)
    message = str(caught.value)
    assert "channels-last [N, H, W, C]: transpose it, x.transpose(0, 3, 1, 2)" in message
    wanted = {"channels": want_c, "height": want_h, "width": want_w}
    given_ = {"channels": c, "height": side, "width": side}
    assert _named(message) == {a: (given_[a], wanted[a]) for a in wanted if given_[a] != wanted[a]}


def test_the_issue_case_three_by_224_to_one_by_16():
    """A 3 x 224 x 224 image given to a 1 x 16 x 16 model: channels, height and width, each with
    its fix; inside a command the image files are the way out, from Python the library call."""
    spec = TensorSpec("pixel_values", ("batch", 1, 16, 16), "float32")
    for value in (np.zeros((1, 3, 224, 224), np.float32), np.zeros((3, 224, 224), np.float32)):
        with command_spelling({}), pytest.raises(RunnerError) as caught:
            _check_one(spec, value, False)
        message = str(caught.value)
        assert "channels 3 vs 1: average them to one, x.mean(axis=1, keepdims=True)" in message
        assert "height 224 vs 16 and width 224 vs 16: resize (or crop) them to 16 x 16" in message
        assert "give the image files: hydra-run and hydra-eval prepare them" in message
        assert "preprocess_images" not in message
    with pytest.raises(RunnerError) as caught:
        _check_one(spec, np.zeros((1, 3, 224, 224), np.float32), False)
    assert "preprocess_images(files, runner.preprocessing)" in str(caught.value)
    assert "hydra-run" not in str(caught.value)


@pytest.mark.parametrize(
    "shape, reading",
    [
        ((3, 224, 224), "one [C, H, W] image: add the batch axis (x[None])"),
        ((224, 224, 3), "one channels-last [H, W, C] image: x.transpose(2, 0, 1)[None]"),
        ((5, 8, 8), "[N, H, W] images without the channel axis: add it (x[:, None])"),
    ],
)
def test_three_axis_arrays_are_read_then_advised(shape, reading):
    spec = TensorSpec("pixel_values", ("batch", 1, 16, 16), "float32")
    with pytest.raises(RunnerError, match="must have 4 dimensions") as caught:
        _check_one(spec, np.zeros(shape, np.float32), False)
    assert f"this looks like {reading}" in str(caught.value)
    assert "height" in str(caught.value) and "width" in str(caught.value)
