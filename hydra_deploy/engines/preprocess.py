"""Image preprocessing with numpy and Pillow only, equal to timm's evaluation transform.

``preprocess_image(path, config)`` reproduces ``timm.data.create_transform(**config)`` (the eval
transform) for the ``preprocessing`` entry of ``hydra.json`` (timm's data config: ``input_size``,
``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``) without torch:

- ``center`` (default): resize the shorter side to ``floor(size / crop_pct)`` (non-square sizes:
  keep the aspect ratio so both sides cover ``floor(size / crop_pct)``), then center-crop
- ``squash``: resize both sides to ``floor(size / crop_pct)``, then center-crop
- ``border``: resize the longer side to fit, pad with the mean colour, then center-crop

then scale to [0, 1] and normalize with ``mean`` / ``std``, in float32, channels first. Images are
converted to RGB (or to L for one-channel models) first, as timm's datasets do. Pillow is imported
only when an image is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import INTERPOLATIONS
from hydra_deploy.optional import require
from hydra_deploy.userdata import IMAGE_SUFFIXES, find_images  # noqa: F401  (importable here)

DEFAULT_CROP_PCT = 0.875  # timm's default when crop_pct is None


def _pil():
    return require(
        "PIL.Image",
        purpose="reading images",
        error=RunnerError,
        extra_hint="or pass preprocessed .npy/.npz arrays instead of image files",
    )


def check_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """Validate a timm data config; returns it with defaults filled in."""
    if not config:
        raise RunnerError(
            "the model has no preprocessing config (hydra.json 'preprocessing'), so images cannot "
            "be prepared for it; pass preprocessed .npy/.npz arrays, or run the export folder "
            "instead of a bare .onnx/engine file"
        )
    try:
        channels, height, width = (int(v) for v in config["input_size"])
        mean = tuple(float(v) for v in config["mean"])
        std = tuple(float(v) for v in config["std"])
    except (KeyError, TypeError, ValueError) as err:
        raise RunnerError(
            f"the preprocessing config {config} lacks input_size (C, H, W), mean or std: {err}; "
            "re-export the model with hydra-export"
        ) from err
    interpolation = config.get("interpolation") or "bilinear"
    crop_mode = config.get("crop_mode") or "center"
    crop_pct = float(config.get("crop_pct") or DEFAULT_CROP_PCT)
    if interpolation not in INTERPOLATIONS:
        raise RunnerError(
            f"interpolation {interpolation!r} is not supported; use one of {INTERPOLATIONS}"
        )
    if crop_mode not in ("center", "squash", "border"):
        raise RunnerError(f"crop_mode {crop_mode!r} is not one of 'center', 'squash', 'border'")
    if channels not in (1, 3) or len(mean) != channels or len(std) != channels:
        raise RunnerError(
            f"preprocessing needs 1 or 3 channels with one mean and std each, got input_size "
            f"{config['input_size']}, mean {mean}, std {std}"
        )
    return {
        "input_size": (channels, height, width),
        "interpolation": interpolation,
        "mean": mean,
        "std": std,
        "crop_pct": crop_pct,
        "crop_mode": crop_mode,
    }


def _resize(image, size_hw: tuple[int, int], interpolation: str):
    resample = getattr(_pil().Resampling, interpolation.upper())
    if (image.height, image.width) == tuple(size_hw):
        return image
    return image.resize((size_hw[1], size_hw[0]), resample=resample)


def _center_crop_or_pad(image, size_hw: tuple[int, int], fill: int | tuple[int, ...]):
    """torchvision's center_crop / timm's center_crop_or_pad (pads first when too small)."""
    crop_h, crop_w = size_hw
    if crop_w > image.width or crop_h > image.height:
        left = (crop_w - image.width) // 2 if crop_w > image.width else 0
        top = (crop_h - image.height) // 2 if crop_h > image.height else 0
        right = (crop_w - image.width + 1) // 2 if crop_w > image.width else 0
        bottom = (crop_h - image.height + 1) // 2 if crop_h > image.height else 0
        padded = _pil().new(
            image.mode, (image.width + left + right, image.height + top + bottom), fill
        )
        padded.paste(image, (left, top))
        image = padded
        if (image.height, image.width) == (crop_h, crop_w):
            return image
    top = round((image.height - crop_h) / 2.0)  # Python's round, as torchvision
    left = round((image.width - crop_w) / 2.0)
    return image.crop((left, top, left + crop_w, top + crop_h))


def transform_image(image, config: dict[str, Any]) -> np.ndarray:
    """A PIL image -> float32 [C, H, W], as timm's eval transform for ``config``."""
    cfg = check_config(config)
    channels, height, width = cfg["input_size"]
    crop_pct, interpolation = cfg["crop_pct"], cfg["interpolation"]
    image = image.convert("RGB" if channels == 3 else "L")
    scale = (math.floor(height / crop_pct), math.floor(width / crop_pct))
    if cfg["crop_mode"] == "squash":
        image = _resize(image, scale, interpolation)
        fill: Any = 0
    elif cfg["crop_mode"] == "border":
        ratio = max(image.height / scale[0], image.width / scale[1])  # the longer side fits
        image = _resize(
            image, (round(image.height / ratio), round(image.width / ratio)), interpolation
        )
        fill = tuple(round(255 * m) for m in cfg["mean"])
        fill = fill if channels == 3 else fill[0]
    else:
        if scale[0] == scale[1]:  # torchvision Resize(int): the shorter side becomes `scale`
            short, long = sorted((image.width, image.height))
            new_long = int(scale[0] * long / short)
            size = (new_long, scale[0]) if image.width <= image.height else (scale[0], new_long)
        else:  # timm ResizeKeepRatio(longest=0): the shorter-ratio side fits
            ratio = min(image.height / scale[0], image.width / scale[1])
            size = (round(image.height / ratio), round(image.width / ratio))
        image = _resize(image, size, interpolation)
        fill = 0
    image = _center_crop_or_pad(image, (height, width), fill)
    pixels = np.asarray(image, dtype=np.uint8).astype(np.float32)
    pixels = pixels.reshape(height, width, channels).transpose(2, 0, 1) / np.float32(255)
    mean = np.asarray(cfg["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(cfg["std"], dtype=np.float32)[:, None, None]
    return np.ascontiguousarray((pixels - mean) / std, dtype=np.float32)


class UnreadableImageError(RunnerError):
    """An image file that cannot be decoded (truncated, not an image): ``path`` and ``reason``."""

    def __init__(self, message: str, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path, self.reason = path, reason

    def __reduce__(self):  # pickled whole (Ray sends it from an actor to the driver)
        return type(self), (str(self), self.path, self.reason)


def preprocess_image(path: str | os.PathLike, config: dict[str, Any]) -> np.ndarray:
    """Read an image file and return it preprocessed: float32 [C, H, W]; a file that cannot be
    decoded raises :class:`UnreadableImageError`."""
    image_module = _pil()
    try:
        with image_module.open(path) as image:
            image.load()
            return transform_image(image, config)
    except (OSError, image_module.UnidentifiedImageError) as err:
        raise UnreadableImageError(
            f"cannot read the image {str(path)!r}: {err}", str(path), str(err)
        ) from err


def preprocess_images(paths: Sequence[str | os.PathLike], config: dict[str, Any]) -> np.ndarray:
    """Several image files -> one float32 batch [N, C, H, W]."""
    check_config(config)
    if not paths:
        raise RunnerError("no images given")
    return np.stack([preprocess_image(p, config) for p in paths])
