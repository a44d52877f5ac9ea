"""A calibrated tiny export: the one builder every test of decisions (hydra-calibrate's record)
uses, so that each consumer is tested on the same kind of record.

The labelled data are the model's own predictions on random images with a share of them replaced
by random classes: the ensemble is then right on about ``keep + (1 - keep) / classes`` of them, and a
selective risk of 0.2 is certified at delta 0.1 on ``CALIBRATION_SIZE`` examples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = ["ant", "bee", "cat", "dog", "eel"]
#: examples of labelled data a calibration uses (half fit T, half the quantiles)
CALIBRATION_SIZE = 1000


def tiny_export(out: Path, *, members: int = 3, seed: int = 1, class_names=CLASSES) -> Path:
    """A tiny ViT Hydra export (16x16 images, 5 classes, batch profile 1/2/4), as
    tests/cli/test_cli_run.py's ``export_dir`` fixture makes it."""
    from helpers.vit import tiny_vit
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=members, heads_per_member=2, seed=seed)
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), class_names=class_names, validate=False)
    return out


def images(count: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """``count`` random 3x16x16 float32 images (``scale``: their standard deviation)."""
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal((count, 3, 16, 16))).astype(np.float32)


def labelled_like_model(
    runner, x: np.ndarray, *, keep: float = 0.85, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``y`` the runner's ensemble prediction on ``x``, a random ``1 - keep`` share of
    it replaced by random classes."""
    from hydra_deploy.uncertainty import ensemble_scores

    logits = runner(x)["member_logits"]
    predicted = ensemble_scores(logits)["prediction"].astype(np.int64)
    rng = np.random.default_rng(seed)
    classes = logits.shape[2]
    noisy = rng.random(len(x)) >= keep
    y = np.where(noisy, rng.integers(0, classes, len(x)), predicted)
    return x, y


def calibrate_export(
    folder: Path,
    *,
    count: int = CALIBRATION_SIZE,
    seed: int = 0,
    in_graph: bool = False,
    **options,
):
    """Fit decisions on ``count`` labelled images (:func:`labelled_like_model`) through the
    export's own runner and store them in ``folder``'s hydra.json (``in_graph``: also as
    model.onnx outputs). ``options`` go to ``calibrate`` (default ``risk=0.2``: every rule).
    Returns the :class:`~hydra_deploy.evaluation.calibrate.Calibration`."""
    from hydra_deploy.engines import load_runner
    from hydra_deploy.evaluation.calibrate import calibrate, store_decisions

    options.setdefault("risk", 0.2)
    with load_runner(folder, decisions=False) as runner:
        data = labelled_like_model(runner, images(count, seed=seed + 100), seed=seed)
        calibration = calibrate(runner, data, **options)
    store_decisions(folder, calibration.record, in_graph=in_graph)
    return calibration


def calibrated_export(out: Path, **options):
    """A tiny export (:func:`tiny_export`) with decisions fitted and stored; returns (folder,
    calibration)."""
    folder = tiny_export(out)
    return folder, calibrate_export(folder, **options)
