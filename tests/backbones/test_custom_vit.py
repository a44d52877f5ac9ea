"""Custom-size timm ViTs (issue 17): hub folders read as timm reads them, constructor arguments from
the CLI, checkpoint mismatches explained from the file's own shapes, preprocessing taken from the
folder or given, recorded and used everywhere, and input-shape hints that say what is wrong."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging

import numpy as np
import pytest
import timm
import torch
from helpers.vit import scramble
from PIL import Image
from safetensors.torch import save_file

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import (
    BackboneError,
    CheckpointError,
    HydraError,
    RunnerError,
    command_spelling,
)
from hydra_deploy.options import PARAMETER_FLAGS

ARGS = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, in_chans=1)
PRETRAINED_CFG = {
    "mean": [0.5],
    "std": [0.5],
    "interpolation": "bilinear",
    "crop_pct": 1.0,
    "crop_mode": "center",
    "input_size": [1, 16, 16],
}
USER_CONFIG = {
    "input_size": (1, 16, 16),
    "interpolation": "bilinear",
    "mean": (0.5,),
    "std": (0.5,),
    "crop_pct": 1.0,
    "crop_mode": "center",
}


@pytest.fixture(autouse=True)
def _keep_log_level():
    """The commands run here in-process set the hydra_deploy logger's level (--quiet: ERROR);
    later tests capture its warnings, so the level is put back."""
    logger = logging.getLogger("hydra_deploy")
    level = logger.level
    yield
    logger.setLevel(level)


def _model(**overrides):
    torch.manual_seed(0)
    args = {**ARGS, **overrides}
    return scramble(timm.create_model("vit_tiny_patch16_224", num_classes=3, **args).eval(), 0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A custom ViT saved in timm's hub layout, and the same weights as a bare file."""
    root = tmp_path_factory.mktemp("custom")
    model = _model()
    folder = root / "digits-vit"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    config = {
        "architecture": "vit_tiny_patch16_224",
        "num_classes": 3,
        "model_args": ARGS,
        "pretrained_cfg": PRETRAINED_CFG,
    }
    (folder / "config.json").write_text(json.dumps(config))
    bare = root / "bare" / "weights.safetensors"
    bare.parent.mkdir()
    bare.write_bytes((folder / "model.safetensors").read_bytes())
    return model, folder, bare


def _same_weights(adapter, model) -> None:
    own = adapter.module.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(own[key], value, rtol=0, atol=0, msg=key)


def test_hub_folder_builds_its_model_args_and_preprocessing(trained, caplog):
    model, folder, _ = trained
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        adapter = load_backbone(folder)
    assert (adapter.embed_dim, adapter.num_layers, adapter.num_heads) == (32, 2, 4)
    assert (adapter.in_chans, adapter.img_size, adapter.num_classes) == (1, (16, 16), 3)
    _same_weights(adapter, model)
    assert adapter.data_config() == USER_CONFIG
    assert not caplog.records  # the folder records its preprocessing: nothing to warn about
    # constructor keyword arguments win over model_args (timm's order): a narrower model no longer fits
    with pytest.raises(
        CheckpointError, match="the file has embed_dim=32 where the model has embed_dim=64"
    ):
        load_backbone(folder, embed_dim=64)


def test_timm_save_for_hf_folder_is_read(tmp_path):
    pytest.importorskip("huggingface_hub", reason="timm's save_for_hf needs huggingface_hub")
    from timm.models import save_for_hf

    model = _model()
    model.pretrained_cfg = {
        **model.pretrained_cfg,
        "mean": (0.5,),
        "std": (0.5,),
        "interpolation": "bilinear",
        "crop_pct": 1.0,
    }
    save_for_hf(model, tmp_path / "hub", safe_serialization=True)
    adapter = load_backbone(tmp_path / "hub")
    _same_weights(adapter, model)
    assert adapter.data_config() == USER_CONFIG


def test_model_args_from_the_cli(trained):
    from hydra_deploy.cli.fuse import main

    _, _, bare = trained
    argv = [
        "--backbone",
        "vit_tiny_patch16_224",
        "--checkpoint",
        str(bare),
        "-m",
        "2",
        "-k",
        "2",
        "--json",
        "--quiet",
    ]
    pairs = [f"--model-arg={k}={json.dumps(v)}" for k, v in ARGS.items()]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv + pairs)
    assert code == 0, err.getvalue()
    report = json.loads(out.getvalue())
    assert report["input_shape"] == [2, 1, 16, 16] and report["output_shape"] == [2, 2, 3]

    from hydra_deploy.cli.model_options import INTERPOLATIONS, parse_model_args
    from hydra_deploy.engines import preprocess
    from hydra_deploy.export_folder import INTERPOLATIONS as OWNED

    # one tuple (the export folder's preprocessing contract, stdlib only: parsing flags imports
    # no numpy code), the one the image preprocessing implements
    assert INTERPOLATIONS is OWNED is preprocess.INTERPOLATIONS

    assert parse_model_args(
        ["img_size=[16, 16]", "qkv_bias=false", "global_pool=avg", "mlp_ratio=2"]
    ) == {"img_size": [16, 16], "qkv_bias": False, "global_pool": "avg", "mlp_ratio": 2}
    for bad, message in (
        ("depth", "not KEY=VALUE"),
        ("num_classes=3", "--num-classes"),
        ("depth=2", "given twice"),
    ):
        with pytest.raises(HydraError, match=message):
            parse_model_args(["depth=4", bad] if bad == "depth=2" else [bad])


def test_mismatch_names_the_files_shapes_and_the_arguments(trained):
    _, _, bare = trained
    with pytest.raises(CheckpointError) as caught:
        load_backbone("vit_tiny_patch16_224", checkpoint=bare)
    message = str(caught.value)
    assert "\n" not in message
    assert (
        "the file has embed_dim=32, depth=2, in_chans=1, patch_size=4, img_size=16 where the "
        "model has embed_dim=192, depth=12, in_chans=3, patch_size=16, img_size=224"
    ) in message
    assert "pos_embed: file (1, 17, 32) vs model (1, 197, 192)" in message  # not resampled to 197
    assert "load_backbone(..., embed_dim=32, depth=2" in message and "--model-arg" not in message
    assert "num_heads as trained: the weights do not show it" in message
    with command_spelling(PARAMETER_FLAGS), pytest.raises(CheckpointError) as caught:
        load_backbone("vit_tiny_patch16_224", checkpoint=bare)  # inside a command: its flags
    assert "--model-arg embed_dim=32 --model-arg depth=2" in str(caught.value)
    assert "load_backbone" not in str(caught.value)
    # the same width at another input size loaded before, silently resampled to 224 pixels
    other = bare.with_name("img32.safetensors")
    save_file(timm.create_model("vit_tiny_patch16_224", img_size=32).state_dict(), str(other))
    with pytest.raises(
        CheckpointError,
        match=r"the file has img_size=32 where the model has img_size=224 \(pos_embed: file \(1, 5, 192\)",
    ):
        load_backbone("vit_tiny_patch16_224", checkpoint=other)
    wide = bare.with_name("mlp2.safetensors")
    save_file(_model(mlp_ratio=2.0).state_dict(), str(wide))
    with pytest.raises(
        CheckpointError, match=r"the file has mlp_ratio=2\.0 where the model has mlp_ratio=4\.0"
    ):
        load_backbone("vit_tiny_patch16_224", checkpoint=wide, **ARGS)


def test_default_preprocessing_is_warned_on_every_path_in_the_same_words(trained, caplog, tmp_path):
    """A checkpoint loaded into a module, a fused export and its re-export (--from): one warning
    each, the same words; the CLI spells the advice as its flags (issue 26, item 6)."""
    from hydra_deploy.errors import command_spelling
    from hydra_deploy.export import export_onnx, load_export
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    _, _, bare = trained

    def warnings_of(call):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
            result = call()
        return result, [r.getMessage() for r in caplog.records if "records no" in r.getMessage()]

    module = timm.create_model("vit_tiny_patch16_224", num_classes=3, **ARGS)
    adapter, warned = warnings_of(lambda: load_backbone(module, checkpoint=bare))
    words = "records no mean/std/interpolation/crop_pct; using timm's default for the architecture"
    assert len(warned) == 1 and words in warned[0] and "preprocessing={...}" in warned[0]
    assert adapter.preprocessing_defaulted == ("mean", "std", "interpolation", "crop_pct")
    spec = HydraSpec.random(adapter.name, 2, 4, 8, members=2, heads_per_member=2, seed=0)
    export_onnx(fuse(adapter, spec), tmp_path / "export", validate=False)
    _, warned_again = warnings_of(lambda: load_export(tmp_path / "export", check=False))
    assert (
        len(warned_again) == 1
        and warned_again[0].split("records no")[1] == warned[0].split("records no")[1]
    )
    with command_spelling({}):  # inside a command: its flags, no Python spelling
        _, warned = warnings_of(lambda: load_export(tmp_path / "export", check=False))
    assert "pass --mean, --std" in warned[0] and "preprocessing={" not in warned[0]
    given = {"mean": 0.5, "std": 0.5, "interpolation": "bilinear", "crop_pct": 1.0}
    module = timm.create_model("vit_tiny_patch16_224", num_classes=3, **ARGS)
    adapter, warned = warnings_of(
        lambda: load_backbone(module, checkpoint=bare, preprocessing=given)
    )
    assert warned == [] and adapter.preprocessing_defaulted == ()


def test_advice_is_spelled_for_whoever_listens(caplog):
    """Python callers read keyword arguments, command users read flags."""
    from hydra_deploy.errors import command_spelling, said

    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        load_backbone("vit_tiny_patch16_224", **ARGS)
        with command_spelling({}):
            load_backbone("vit_tiny_patch16_224", **ARGS)
    python, command = (r.getMessage() for r in caplog.records)
    assert "pass checkpoint=<file> for trained weights" in python
    assert "pass --checkpoint=<file> for trained weights" in command
    assert said("no `calib` data") == "no calib data"
    with command_spelling({"calib": "--calib-data"}):
        assert said("no `calib` data") == "no --calib-data data"


def test_preprocessing_given_wins_and_a_missing_one_is_warned(trained, caplog):
    _, folder, bare = trained
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        adapter = load_backbone("vit_tiny_patch16_224", checkpoint=bare, **ARGS)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "records no mean/std/interpolation/crop_pct" in warned[0]
    assert "--mean" in warned[0] and "\n" not in warned[0]
    assert adapter.data_config()["interpolation"] == "bicubic"  # timm's default for the name
    caplog.clear()
    given = {"mean": 0.5, "std": [0.5], "interpolation": "bilinear", "crop_pct": 1.0}
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        adapter = load_backbone(
            "vit_tiny_patch16_224", checkpoint=bare, preprocessing=given, **ARGS
        )
    assert not caplog.records and adapter.data_config() == USER_CONFIG
    # over the folder's own, and kept by copies of the module (fine-tuned members)
    adapter = load_backbone(folder, preprocessing={"mean": [0.25], "crop_mode": "squash"})
    copied = load_backbone(copy.deepcopy(adapter.module))
    assert copied.data_config() == {**USER_CONFIG, "mean": (0.25,), "crop_mode": "squash"}
    for bad, message in (
        ({"size": 3}, r"unknown entries \['size'\]"),
        ({"mean": [0.5, 0.5]}, "2 values, the model has 1 input channel"),
        ({"interpolation": "cubic"}, "interpolation 'cubic' is not one of"),
        ({"crop_pct": 0}, "crop_pct must be a positive number"),
        ({"std": [0]}, "std must be positive"),
    ):
        with pytest.raises(BackboneError, match=message):
            load_backbone(folder, preprocessing=bad)
    with pytest.raises(BackboneError, match="preprocessing= applies to timm ViT backbones"):
        load_backbone("hf:/nonexistent", preprocessing={"mean": 0.5})


def test_export_records_it_and_a_reexport_keeps_it(trained, tmp_path):
    from hydra_deploy.cli.export import main
    from hydra_deploy.export import load_export

    _, folder, _ = trained
    common = ["--max-batch", "2", "--opt-batch", "2", "--no-validate", "--quiet"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                "--backbone",
                str(folder),
                "-m",
                "2",
                "-k",
                "2",
                "--crop-pct",
                "0.5",
                "--out",
                str(tmp_path / "a"),
                *common,
            ]
        )
        assert code == 0, err.getvalue()
        recorded = json.loads((tmp_path / "a" / "hydra.json").read_text())["preprocessing"]
        assert recorded == {**json.loads(json.dumps(USER_CONFIG)), "crop_pct": 0.5}
        assert load_export(tmp_path / "a").preprocessing == recorded  # not the rebuilt default
        code = main(
            [
                "--from",
                str(tmp_path / "a"),
                "--crop-pct",
                "1",
                "--out",
                str(tmp_path / "b"),
                *common,
            ]
        )
        assert code == 0, err.getvalue()
    fixed = json.loads((tmp_path / "b" / "hydra.json").read_text())["preprocessing"]
    assert fixed == json.loads(json.dumps(USER_CONFIG))


def test_image_folder_loader_uses_the_recorded_preprocessing(trained, tmp_path):
    from hydra_deploy.engines.preprocess import preprocess_images
    from hydra_deploy.pruning.data import load_data

    _, folder, _ = trained
    backbone = load_backbone(folder)
    rng = np.random.default_rng(0)
    files = []
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            path = tmp_path / cls / f"{i}.png"
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(path)
            files.append(path)
    data = load_data(tmp_path, backbone=backbone)
    x = torch.cat([batch for batch, _ in data.loader(8)]).numpy()
    np.testing.assert_allclose(x, preprocess_images(files, backbone.data_config()), atol=1e-6)
    user = np.stack(
        [
            (
                np.asarray(Image.open(f).resize((16, 16), Image.Resampling.BILINEAR), np.float32)[
                    None
                ]
                / 255
                - 0.5
            )
            / 0.5
            for f in files
        ]
    )
    np.testing.assert_allclose(x, user, atol=1e-6)


def test_shape_hints_say_what_the_model_expects():
    from hydra_deploy.engines.runner import TensorSpec, _check_one

    spec = TensorSpec("pixel_values", ("batch", 1, 16, 16), "float32")
    cases = [
        (
            np.zeros((5, 8, 8), np.float32),
            r"expects \[N, C, H, W\] = \[N, 1, 16, 16\]; this looks like \[N, H, W\] images without "
            r"the channel axis: add it \(x\[:, None\]\); then height 8 vs 16 and width 8 vs 16: "
            r"resize \(or crop\) them to 16 x 16",
        ),
        (np.zeros((1, 16, 16), np.float32), r"\(add the batch axis: x\[None\]\)"),
        (np.zeros((5, 1, 8, 8), np.float32), r"height 8 vs 16 and width 8 vs 16: resize"),
        (np.zeros((5, 16, 16, 1), np.float32), r"channels-last \[N, H, W, C\]: transpose it"),
    ]
    for value, message in cases:
        with pytest.raises(RunnerError, match=message) as caught:
            _check_one(spec, value, False)
        assert ("add the batch axis" in str(caught.value)) == (value.shape == (1, 16, 16))
