"""Bad inputs to every command: the exit code, one "error:" line that names the problem and what
to do, no traceback (unless --debug), and nothing half-written left behind.

One table (``CASES``) of command x fault, each run in process (``main(argv)``); argparse usage
errors exit 2 with argparse's usage + error lines. The models are tiny: hydra-fuse / hydra-export /
hydra-bench build the 224 px ViT-Ti/16 from its name (every case fails before a forward pass or an
export), and the runtime commands run one 16 px ViT export made once for the module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers.vit import tiny_vit

from hydra_deploy.cli import bench, build, compare, eval, export, fuse, run
from hydra_deploy.errors import HydraError
from hydra_deploy.specs import HydraSpec

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
NO_TRT = pytest.mark.skipif(
    HAS_TENSORRT, reason="TensorRT is installed: this case checks the message given without it"
)
MAINS = {
    "fuse": fuse.main,
    "export": export.main,
    "build": build.main,
    "run": run.main,
    "compare": compare.main,
    "eval": eval.main,
    "bench": bench.main,
}
PRECIOUS = "precious\n"  # the content of {tmp}/existing.json, which no failing command may change


# --- the files every case reads, made once ---------------------------------------------------------
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A tiny 16 px ViT export (2 members, 5 classes, batch 1..4)."""
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse as fuse_members

    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("bad-inputs") / "export"
    export_onnx(
        fuse_members(backbone, spec), out, batch=(1, 2, 4), exporter="torchscript", validate=False
    )
    return out


def _plain_onnx(path: Path) -> None:
    """A valid ONNX model that is no Hydra export: one Relu, output 'y', no metadata."""
    import onnx
    from onnx import TensorProto, helper

    value = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 3, 16, 16])
        for n in ("x", "y")
    ]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "plain", value[:1], value[1:]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.fixture(scope="module")
def files(export_dir, tmp_path_factory) -> Path:
    """Every bad (and a few good) input file, in one folder."""
    import timm
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("bad-files")
    rng = np.random.default_rng(0)
    (d / "a_folder").mkdir()
    # spec files, for the 224 px ViT-Ti/16 (12 layers x 3 heads of 64)
    (d / "spec_malformed.json").write_text('{"format": "hydra-spec/1", members: [}')
    spec = HydraSpec.random("vit_ti16", 12, 3, 64, members=2, heads_per_member=1, seed=0)
    (d / "spec_future.json").write_text(json.dumps({**spec.to_dict(), "format": "hydra-spec/2"}))
    HydraSpec.random("vit_s16", 2, 3, 64, members=2, heads_per_member=1).to_json(
        d / "spec_layers.json"
    )
    HydraSpec.random("vit_ti16", 12, 4, 64, members=2, heads_per_member=1).to_json(
        d / "spec_heads.json"
    )
    (d / "spec_m0.json").write_text(json.dumps({**spec.to_dict(), "members": []}))
    (d / "spec_head_index.json").write_text(
        json.dumps({**spec.to_dict(), "members": [{"heads": [[0, 3]] * 12}]})
    )
    # checkpoints: another architecture (the tiny ViT), another class count, a truncated file
    tiny = tiny_vit("token").module.state_dict()
    save_file({k: v.contiguous() for k, v in tiny.items()}, d / "ck_other_arch.safetensors")
    ten = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).state_dict()
    save_file(ten, d / "ck_10_classes.safetensors")
    (d / "ck_truncated.safetensors").write_bytes(
        (d / "ck_other_arch.safetensors").read_bytes()[:999]
    )
    # calibration / fine-tuning data for the 224 px backbone (1000 classes)
    x224, y = rng.standard_normal((2, 3, 224, 224)).astype(np.float32), np.array([0, 1])
    np.savez(d / "calib_shape.npz", x=x224[:, :, :16, :16], y=y)
    np.savez(d / "calib_int.npz", x=(x224 * 100).astype(np.int64), y=y)
    np.savez(d / "calib_str.npz", x=np.full((2, 3), "pixel"), y=y)
    np.savez(d / "calib_str_labels.npz", x=x224, y=np.array(["cat", "dog"]))
    np.savez(d / "calib_empty.npz", x=x224[:0], y=y[:0])
    np.savez(d / "calib_labels.npz", x=x224, y=np.array([0, 1000]))
    np.savez(
        d / "calib_nan.npz", x=np.where(np.arange(2)[:, None, None, None] == 1, np.nan, x224), y=y
    )
    np.savez(d / "calib_no_labels.npz", x=x224)
    np.savez(d / "calib.npz", x=x224, y=y)
    np.savez(d / "ood_uint8_224.npz", x=np.zeros((2, 3, 224, 224), np.uint8))  # raw pixels
    (d / "calib_truncated.npz").write_bytes((d / "calib_labels.npz").read_bytes()[:2000])
    # run-time inputs for the 16 px export
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "x_shape.npy", x[:, :, :8, :8])
    np.save(d / "x_rank.npy", x[None])
    np.save(d / "x_uint8.npy", np.zeros((2, 3, 16, 16), np.uint8))
    np.save(d / "x_int64.npy", np.zeros((2, 3, 16, 16), np.int64))
    np.save(d / "x_str.npy", np.full((2, 3, 16, 16), "a"))
    np.save(d / "x_nan.npy", np.where(np.arange(2)[:, None, None, None] == 1, np.nan, x))
    np.save(d / "x_inf.npy", np.where(np.arange(2)[:, None, None, None] == 0, np.inf, x))
    np.save(d / "x_empty.npy", x[:0])
    (d / "x_truncated.npy").write_bytes((d / "x.npy").read_bytes()[:100])
    np.savez(d / "x_wrong_key.npz", images=x)
    np.savez(d / "x.npz", x=x)
    (d / "x_truncated.npz").write_bytes((d / "x.npz").read_bytes()[:100])
    labels = np.array([0, 1])
    np.savez(d / "id.npz", x=x, y=labels)
    np.savez(d / "id_shape.npz", x=x[:, :, :8, :8], y=labels)
    np.savez(d / "id_uint8.npz", x=np.zeros((2, 3, 16, 16), np.uint8), y=labels)
    np.savez(d / "id_nan.npz", x=np.full_like(x, np.nan), y=labels)
    np.savez(d / "id_empty.npz", x=x[:0], y=labels[:0])
    np.savez(d / "id_labels.npz", x=x, y=np.array([0, 7]))
    (d / "id_truncated.npz").write_bytes((d / "id.npz").read_bytes()[:200])
    np.savez(d / "ood.npz", x=3 * x)
    np.savez(d / "ood_str.npz", x=np.full((2, 3, 16, 16), "a"))
    # ONNX files and export folders
    onnx_bytes = (export_dir / "model.onnx").read_bytes()
    bad_models = {
        "truncated": onnx_bytes[: len(onnx_bytes) // 2],
        "random": rng.bytes(5000),
        "text": b"this is a text file, renamed\n",
    }
    for name, data in bad_models.items():
        (d / f"{name}.onnx").write_bytes(data)
        shutil.copytree(export_dir, d / f"ex_{name}")
        (d / f"ex_{name}" / "model.onnx").write_bytes(data)
    _plain_onnx(d / "plain.onnx")
    (d / "plain_dir").mkdir()
    shutil.copy(d / "plain.onnx", d / "plain_dir" / "model.onnx")
    (d / "bare").mkdir()  # the Hydra model.onnx alone, without hydra.json
    shutil.copy(export_dir / "model.onnx", d / "bare" / "model.onnx")
    info = json.loads((export_dir / "hydra.json").read_text())
    for name, text in {
        "bad_json": '{"format": "hydra-export/1",',
        "future": json.dumps({**info, "format": "hydra-export/99"}),
    }.items():
        shutil.copytree(export_dir, d / f"ex_{name}")
        (d / f"ex_{name}" / "hydra.json").write_text(text)
    shutil.copytree(export_dir, d / "ex_uq_mismatch")  # hydra.json claims UQ outputs it lacks
    (d / "ex_uq_mismatch" / "hydra.json").write_text(json.dumps({**info, "uq_outputs": True}))
    shutil.copytree(export_dir, d / "ex_bad_weights")
    (d / "ex_bad_weights" / "weights.safetensors").write_bytes(b"\x08\x00\x00")
    (d / "model.engine").write_bytes(b"not a real engine")
    # hydra-bench baselines
    (d / "base_malformed.json").write_text("{")
    (d / "base_future.json").write_text(json.dumps({"format": "hydra-bench-baseline/9"}))
    return d


# --- the matrix --------------------------------------------------------------------------------------
FUSE = ["--backbone", "vit_ti16", "--members", "2", "--heads-per-member", "1", "--batch", "1"]
EXPORT = [
    "--backbone",
    "vit_ti16",
    "--members",
    "2",
    "--heads-per-member",
    "1",
    "--out",
    "{tmp}/out",
]
CIRCUIT = ["--importance", "circuit", "--calib", "{d}/calib.npz"]
EVAL_OOD = ["--ood", "o={d}/ood.npz", "--out", "{tmp}/report"]
BENCH = [
    "--backbone",
    "vit_ti16",
    "--heads-per-member",
    "1",
    "--batch",
    "1",
    "--rounds",
    "1",
    "--backend",
    "torch",
]


def case(id_: str, command: str, argv: list[str], code: int, *fragments: str, marks=()):
    return pytest.param(command, argv, code, fragments, id=id_, marks=marks)


CASES = [
    # hydra-fuse: spec files
    case(
        "fuse-spec-missing-file",
        "fuse",
        [*FUSE, "--spec", "{d}/nope.json"],
        1,
        "spec file",
        "does not exist; check the path",
    ),
    case(
        "fuse-spec-is-a-folder",
        "fuse",
        [*FUSE, "--spec", "{d}/a_folder"],
        1,
        "is a folder, not a JSON file",
    ),
    case(
        "fuse-spec-malformed-json",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_malformed.json"],
        1,
        "invalid JSON in spec file",
        "line 1, column",
    ),
    case(
        "fuse-spec-future-format",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_future.json"],
        1,
        "unsupported spec format 'hydra-spec/2'; understood formats: 'hydra-spec/1'",
    ),
    case(
        "fuse-spec-other-layer-count",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_layers.json"],
        1,
        "num_layers=2 (backbone has 12)",
        "pass --backbone vit_s16, or write a spec",
        "--save-spec FILE",
    ),
    case(
        "fuse-spec-other-head-count",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_heads.json"],
        1,
        "num_heads=4 (backbone has 3)",
        "write a spec for this backbone with hydra-fuse",
    ),
    case(
        "fuse-spec-zero-members",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_m0.json"],
        1,
        "needs at least one member (got 0)",
    ),
    case(
        "fuse-spec-head-above-layer-heads",
        "fuse",
        [*FUSE, "--spec", "{d}/spec_head_index.json"],
        1,
        "member 0, layer 0: head 3 is out of range 0..2 (num_heads=3)",
    ),
    # hydra-fuse: member options
    case(
        "fuse-zero-members",
        "fuse",
        [*FUSE, "--members", "0"],
        1,
        "--members must be at least 1, got 0",
    ),
    case(
        "fuse-heads-per-member-above-layer-heads",
        "fuse",
        [*FUSE, "--heads-per-member", "5"],
        1,
        "heads_per_member for member 0 must be an int in 0..3 (num_heads=3), got 5",
    ),
    # hydra-fuse: checkpoints
    case(
        "fuse-checkpoint-missing",
        "fuse",
        [*FUSE, "--checkpoint", "{d}/nope.safetensors"],
        1,
        "does not exist; pass a local .safetensors/.pth file",
    ),
    case(
        "fuse-checkpoint-folder-without-weights",
        "fuse",
        [*FUSE, "--checkpoint", "{d}/a_folder"],
        1,
        "holds none of model.safetensors",
        "point checkpoint at the weights file itself",
    ),
    case(
        "fuse-checkpoint-truncated",
        "fuse",
        [*FUSE, "--checkpoint", "{d}/ck_truncated.safetensors"],
        1,
        "cannot read checkpoint",
        "is the file complete",
    ),
    case(
        "fuse-checkpoint-other-architecture",
        "fuse",
        [*FUSE, "--checkpoint", "{d}/ck_other_arch.safetensors"],
        1,
        "does not fit the model (vit_tiny_patch16_224 as built)",
        "the file has embed_dim=32, depth=3, patch_size=4, img_size=16 where the model has",
        "cls_token: file (1, 1, 32) vs model (1, 1, 192)",
        "--model-arg embed_dim=32",
    ),
    case(
        "fuse-checkpoint-other-class-count",
        "fuse",
        [*FUSE, "--checkpoint", "{d}/ck_10_classes.safetensors", "--num-classes", "5"],
        1,
        "head.weight: checkpoint (10, 192) vs model (5, 192)",
        "pass --num-classes matching the checkpoint's classifier",
    ),
    # hydra-fuse: calibration (--calib) and fine-tuning (--finetune) data
    case("fuse-calib-missing", "fuse", [*FUSE, "--calib", "{d}/nope.npz"], 1, "does not exist"),
    case(
        "fuse-calib-wrong-shape",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_shape.npz"],
        1,
        "inputs have shape [3, 16, 16], the backbone expects [3, 224, 224]",
        "preprocess them to the backbone's input size",
    ),
    case(
        "fuse-calib-wrong-dtype-int",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_int.npz"],
        1,
        "inputs must be float arrays already preprocessed (got torch.int64)",
    ),
    case(
        "fuse-calib-wrong-dtype-strings",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_str.npz"],
        1,
        "inputs must be numbers, got an array of dtype <U5",
        "save preprocessed float inputs",
    ),
    case(
        "fuse-calib-string-labels",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_str_labels.npz"],
        1,
        "labels must be numbers",
        "map class names to indices 0..C-1",
    ),
    case(
        "fuse-calib-empty",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_empty.npz"],
        1,
        "data is empty (0 examples); give at least one labelled example",
    ),
    case(
        "fuse-calib-labels-out-of-range",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_labels.npz"],
        1,
        "1 label outside 0..999 (e.g. 1000)",
        "relabel the data",
        "--num-classes",
    ),
    case(
        "fuse-calib-nan",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_nan.npz"],
        1,
        "1 of 2 inputs holds NaN or infinite values; fix or drop them",
    ),
    case(
        "fuse-calib-without-labels",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_no_labels.npz"],
        1,
        "lacks ['y']",
        "np.savez(path, x=inputs, y=labels)",
    ),
    case(
        "fuse-calib-truncated-npz",
        "fuse",
        [*FUSE, "--calib", "{d}/calib_truncated.npz"],
        1,
        "cannot read",
        "is it a complete .npz",
    ),
    case(
        "fuse-calib-folder-without-classes",
        "fuse",
        [*FUSE, "--calib", "{d}/a_folder"],
        1,
        "has no class sub-folders",
        "put each class's images in a sub-folder",
    ),
    case(
        "fuse-finetune-wrong-shape",
        "fuse",
        [*FUSE, "--finetune", "{d}/calib_shape.npz"],
        1,
        "train_data: inputs have shape [3, 16, 16]",
    ),
    case(
        "fuse-finetune-wrong-dtype",
        "fuse",
        [*FUSE, "--finetune", "{d}/calib_str.npz"],
        1,
        "train_data: inputs must be numbers",
    ),
    case(
        "fuse-finetune-empty",
        "fuse",
        [*FUSE, "--finetune", "{d}/calib_empty.npz"],
        1,
        "train_data is empty (0 examples)",
    ),
    case(
        "fuse-finetune-labels-out-of-range",
        "fuse",
        [*FUSE, "--finetune", "{d}/calib_labels.npz"],
        1,
        "train_data: 1 label outside 0..999",
    ),
    case(
        "fuse-finetune-nan",
        "fuse",
        [*FUSE, "--finetune", "{d}/calib_nan.npz"],
        1,
        "train_data: 1 of 2 inputs holds NaN or infinite values",
    ),
    # hydra-fuse: OOD data for the circuit objective (--ood), checked as --calib is
    case(
        "fuse-ood-strings",
        "fuse",
        [*FUSE, *CIRCUIT, "--ood", "{d}/calib_str.npz"],
        1,
        "ood_data: inputs must be numbers, got an array of dtype <U5",
        "save preprocessed float",
    ),
    case(
        "fuse-ood-uint8",
        "fuse",
        [*FUSE, *CIRCUIT, "--ood", "{d}/ood_uint8_224.npz"],
        1,
        "ood_data: inputs must be float arrays already preprocessed (got torch.uint8)",
        "scale and normalise images as the backbone expects",
    ),
    case(
        "fuse-ood-nan",
        "fuse",
        [*FUSE, *CIRCUIT, "--ood", "{d}/calib_nan.npz"],
        1,
        "ood_data: 1 of 2 inputs holds NaN or infinite values; fix or drop them",
    ),
    case(
        "fuse-ood-wrong-shape",
        "fuse",
        [*FUSE, *CIRCUIT, "--ood", "{d}/calib_shape.npz"],
        1,
        "ood_data inputs have shape [3, 16, 16], expected [3, 224, 224] per example",
    ),
    case(
        "fuse-ood-empty",
        "fuse",
        [*FUSE, *CIRCUIT, "--ood", "{d}/calib_empty.npz"],
        1,
        "ood_data is empty (0 examples)",
    ),
    case(
        "export-ood-uint8",
        "export",
        [*EXPORT, *CIRCUIT, "--ood", "{d}/ood_uint8_224.npz"],
        1,
        "ood_data: inputs must be float arrays already preprocessed (got torch.uint8)",
    ),
    # hydra-fuse / hydra-export: --keep-ratio is a fraction in (0, 1]
    case(
        "fuse-keep-ratio-zero",
        "fuse",
        [*FUSE, "--keep-ratio", "0"],
        1,
        "--keep-ratio must be within (0, 1]",
        "got 0.0",
    ),
    case(
        "fuse-keep-ratio-negative",
        "fuse",
        [*FUSE, "--keep-ratio", "-0.5"],
        1,
        "--keep-ratio must be within (0, 1]",
        "got -0.5",
    ),
    case(
        "fuse-keep-ratio-above-one",
        "fuse",
        [*FUSE, "--keep-ratio", "1.5"],
        1,
        "--keep-ratio must be within (0, 1] (the fraction of each layer's heads a member keeps",
    ),
    case(
        "export-keep-ratio-zero",
        "export",
        [*EXPORT, "--keep-ratio", "0", "--calib", "{d}/calib.npz"],
        1,
        "--keep-ratio must be within (0, 1]",
    ),
    case(
        "fuse-save-spec-exists",
        "fuse",
        [*FUSE, "--save-spec", "{tmp}/existing.json"],
        1,
        "existing.json' exists; pass --overwrite to replace it",
    ),
    # hydra-export: the same model options, the output folder, --from
    case(
        "export-out-exists",
        "export",
        [*EXPORT[:-1], "{tmp}/existing_dir"],
        1,
        "existing_dir' exists; pass --overwrite to replace it",
    ),
    case(
        "export-zero-members",
        "export",
        [*EXPORT, "--members", "0"],
        1,
        "--members must be at least 1, got 0",
    ),
    case(
        "export-spec-other-layer-count",
        "export",
        [*EXPORT, "--spec", "{d}/spec_layers.json"],
        1,
        "num_layers=2 (backbone has 12)",
    ),
    case(
        "export-spec-malformed-json",
        "export",
        [*EXPORT, "--spec", "{d}/spec_malformed.json"],
        1,
        "invalid JSON in spec file",
    ),
    case(
        "export-checkpoint-other-architecture",
        "export",
        [*EXPORT, "--checkpoint", "{d}/ck_other_arch.safetensors"],
        1,
        "does not fit the model",
    ),
    case(
        "export-checkpoint-other-class-count",
        "export",
        [*EXPORT, "--checkpoint", "{d}/ck_10_classes.safetensors", "--num-classes", "5"],
        1,
        "head.weight: checkpoint (10, 192) vs model (5, 192)",
    ),
    case(
        "export-calib-wrong-shape",
        "export",
        [*EXPORT, "--calib", "{d}/calib_shape.npz"],
        1,
        "the backbone expects [3, 224, 224] per example",
    ),
    case(
        "export-finetune-labels-out-of-range",
        "export",
        [*EXPORT, "--finetune", "{d}/calib_labels.npz"],
        1,
        "label outside 0..999",
    ),
    case(
        "export-from-missing-folder",
        "export",
        ["--from", "{d}/nope", "--out", "{tmp}/out"],
        1,
        "does not exist; give the folder hydra-export wrote",
    ),
    case(
        "export-from-not-an-export",
        "export",
        ["--from", "{d}/bare", "--out", "{tmp}/out"],
        1,
        "is not an export folder: hydra.json is missing; give the folder hydra-export wrote",
    ),
    case(
        "export-from-malformed-hydra-json",
        "export",
        ["--from", "{d}/ex_bad_json", "--out", "{tmp}/out"],
        1,
        "cannot read",
        "hydra.json",
        "restore it or re-export the model with hydra-export",
    ),
    case(
        "export-from-future-format",
        "export",
        ["--from", "{d}/ex_future", "--out", "{tmp}/out"],
        1,
        "has format 'hydra-export/99'",
        "this version reads 'hydra-export/1' exports",
    ),
    case(
        "export-from-corrupt-weights",
        "export",
        ["--from", "{d}/ex_bad_weights", "--out", "{tmp}/out"],
        1,
        "cannot read the export in",
    ),
    case(
        "export-from-truncated-onnx",
        "export",
        ["--from", "{d}/ex_truncated", "--out", "{tmp}/out"],
        1,
        "ONNX Runtime cannot load",
        "is the file complete?",
    ),
    case(
        "export-from-uq-outputs-mismatch",
        "export",
        ["--from", "{d}/ex_uq_mismatch", "--out", "{tmp}/out"],
        1,
        "hydra.json and model.onnx in",
        "disagree about the uncertainty outputs",
        "uq_outputs=True",
        "model.onnx has outputs ['member_logits']",
        "export the model again with hydra-export",
    ),
    case(
        "export-from-random-bytes-onnx",
        "export",
        ["--from", "{d}/ex_random", "--out", "{tmp}/out"],
        1,
        "ONNX Runtime cannot load",
        "export the model again with hydra-export",
    ),
    # hydra-build (--trtexec: the pure-Python path; without it: TensorRT is needed)
    case(
        "build-missing-folder",
        "build",
        ["{d}/nope", "--trtexec"],
        1,
        "does not exist; give an export folder made by hydra-export",
    ),
    case(
        "build-folder-without-hydra-json",
        "build",
        ["{d}/bare", "--trtexec"],
        1,
        "is not an export folder: hydra.json is missing; give the folder hydra-export wrote",
    ),
    case(
        "build-truncated-onnx",
        "build",
        ["{d}/ex_truncated", "--trtexec"],
        1,
        "is not a readable ONNX file (truncated",
        "re-export it with hydra-export",
    ),
    case(
        "build-random-bytes-onnx",
        "build",
        ["{d}/ex_random", "--trtexec"],
        1,
        "is not a readable ONNX file",
    ),
    case(
        "build-text-file-renamed-onnx",
        "build",
        ["{d}/text.onnx", "--trtexec"],
        1,
        "is not a readable ONNX file",
    ),
    case(
        "build-plain-onnx-without-hydra-metadata",
        "build",
        ["{d}/plain.onnx", "--trtexec"],
        1,
        "is not a Hydra export: it has no member_logits output",
        "build from a folder hydra-export",
    ),
    case(
        "build-malformed-hydra-json",
        "build",
        ["{d}/ex_bad_json", "--trtexec"],
        1,
        "cannot read",
        "restore it or re-export the model with hydra-export",
    ),
    case(
        "build-future-format",
        "build",
        ["{d}/ex_future", "--trtexec"],
        1,
        "has format 'hydra-export/99'",
        "this version reads 'hydra-export/1' exports",
    ),
    case(
        "build-without-tensorrt",
        "build",
        ["{export}"],
        1,
        "TensorRT is not installed",
        "pip install 'hydra-deploy[trt]'",
        "--trtexec",
        marks=NO_TRT,
    ),
    # hydra-run: the model
    case(
        "run-model-missing",
        "run",
        ["{d}/nope", "{d}/x.npy"],
        1,
        "does not exist; give an export folder (hydra-export --out), a .onnx file",
    ),
    case(
        "run-folder-without-model-onnx",
        "run",
        ["{d}/a_folder", "{d}/x.npy"],
        1,
        "is not an export folder: model.onnx is missing (make one with hydra-export",
    ),
    # ONNX Runtime's load error (runner._session_error) names the problem, not the remedy
    case(
        "run-truncated-onnx",
        "run",
        ["{d}/ex_truncated", "{d}/x.npy"],
        1,
        "ONNX Runtime cannot load",
        "Protobuf parsing failed",
    ),
    case(
        "run-random-bytes-onnx",
        "run",
        ["{d}/random.onnx", "{d}/x.npy"],
        1,
        "ONNX Runtime cannot load",
    ),
    case(
        "run-text-file-renamed-onnx",
        "run",
        ["{d}/text.onnx", "{d}/x.npy"],
        1,
        "ONNX Runtime cannot load",
    ),
    case(
        "run-plain-onnx-without-member-logits",
        "run",
        ["{d}/plain.onnx", "{d}/x.npy"],
        1,
        "has no 'member_logits' output (outputs: ['y']); is it a Hydra export?",
    ),
    case(
        "run-malformed-hydra-json",
        "run",
        ["{d}/ex_bad_json", "{d}/x.npy"],
        1,
        "cannot read",
        "restore it or re-export the model",
    ),
    case(
        "run-engine-without-tensorrt",
        "run",
        ["{d}/model.engine", "{d}/x.npy"],
        1,
        "TensorRT is not installed",
        "pip install 'hydra-deploy[trt]'",
        marks=NO_TRT,
    ),
    # hydra-run: the inputs
    case("run-input-missing", "run", ["{export}", "{d}/nope.npy"], 1, "does not exist"),
    case(
        "run-input-wrong-shape",
        "run",
        ["{export}", "{d}/x_shape.npy"],
        1,
        "must have size 16 on axis 2 and 16 on axis 3 (shape ['batch', 3, 16, 16]), got shape "
        "(2, 3, 8, 8): the model expects [N, C, H, W] = [N, 3, 16, 16]; height 8 vs 16 and width "
        "8 vs 16: resize (or crop) them to 16 x 16 (or give the image files",
    ),
    case(
        "run-input-wrong-rank", "run", ["{export}", "{d}/x_rank.npy"], 1, "must have 4 dimensions"
    ),
    case(
        "run-input-uint8",
        "run",
        ["{export}", "{d}/x_uint8.npy"],
        1,
        "must be float32, got uint8 (raw pixels? preprocess images first",
    ),
    case(
        "run-input-int64", "run", ["{export}", "{d}/x_int64.npy"], 1, "must be float32, got int64"
    ),
    case("run-input-strings", "run", ["{export}", "{d}/x_str.npy"], 1, "must be float32, got <U1"),
    case(
        "run-input-nan",
        "run",
        ["{export}", "{d}/x_nan.npy"],
        1,
        "holds NaN or infinite values in 1 of 2 examples; fix the data, or run it anyway with "
        "hydra-run --allow-nonfinite",
    ),
    case(
        "run-input-inf",
        "run",
        ["{export}", "{d}/x_inf.npy"],
        1,
        "holds NaN or infinite values in 1 of 2 examples",
    ),
    case(
        "run-input-empty-array",
        "run",
        ["{export}", "{d}/x_empty.npy"],
        1,
        "holds no examples (shape (0, 3, 16, 16)); give 1 or more examples",
    ),
    case(
        "run-input-truncated-npy",
        "run",
        ["{export}", "{d}/x_truncated.npy"],
        1,
        "cannot read the array file",
        "give a complete .npy (np.save)",
    ),
    case(
        "run-input-truncated-npz",
        "run",
        ["{export}", "{d}/x_truncated.npz"],
        1,
        "cannot read the array file",
        "File is not a zip file",
    ),
    case(
        "run-input-npz-wrong-key",
        "run",
        ["{export}", "{d}/x_wrong_key.npz"],
        1,
        "holds arrays ['images']; name the input array 'x' or 'pixel_values'",
    ),
    case(
        "run-input-folder-without-images", "run", ["{export}", "{d}/a_folder"], 1, "holds no images"
    ),
    case(
        "run-json-exists",
        "run",
        ["{export}", "{d}/x.npy", "--json", "{tmp}/existing.json"],
        1,
        "exists; pass --overwrite to replace it",
    ),
    case(
        "run-csv-exists",
        "run",
        ["{export}", "{d}/x.npy", "--csv", "{tmp}/existing.json"],
        1,
        "exists; pass --overwrite to replace it",
    ),
    case(
        "run-bad-input-writes-no-json",
        "run",
        ["{export}", "{d}/x_nan.npy", "--json", "{tmp}/out.json"],
        1,
        "NaN or infinite",
    ),
    # hydra-compare
    case(
        "compare-missing-folder",
        "compare",
        ["{d}/nope"],
        1,
        "does not exist; give the folder hydra-export wrote",
    ),
    case(
        "compare-folder-without-hydra-json",
        "compare",
        ["{d}/bare"],
        1,
        "is not an export folder: hydra.json is missing; give the folder hydra-export wrote",
    ),
    case("compare-plain-onnx-file", "compare", ["{d}/plain.onnx"], 1, "is not an export folder"),
    case(
        "compare-malformed-hydra-json",
        "compare",
        ["{d}/ex_bad_json"],
        1,
        "cannot read",
        "restore it or re-export the model",
    ),
    case(
        "compare-future-format",
        "compare",
        ["{d}/ex_future"],
        1,
        "this version reads 'hydra-export/1' exports",
    ),
    case("compare-truncated-onnx", "compare", ["{d}/ex_truncated"], 1, "ONNX Runtime cannot load"),
    case(
        "compare-inputs-missing",
        "compare",
        ["{export}", "--inputs", "{d}/nope.npy"],
        1,
        "does not exist; check the path",
    ),
    case(
        "compare-inputs-wrong-shape",
        "compare",
        ["{export}", "--inputs", "{d}/x_shape.npy"],
        1,
        "got [2, 3, 8, 8]; resize the images to the backbone's input size",
    ),
    case(
        "compare-inputs-uint8",
        "compare",
        ["{export}", "--inputs", "{d}/x_uint8.npy"],
        1,
        "are uint8, not floats (raw pixels?); give preprocessed float inputs",
    ),
    case(
        "compare-inputs-strings",
        "compare",
        ["{export}", "--inputs", "{d}/x_str.npy"],
        1,
        "are <U1, not floats",
    ),
    case(
        "compare-inputs-nan",
        "compare",
        ["{export}", "--inputs", "{d}/x_nan.npy"],
        1,
        "hold NaN or infinite values in 'pixel_values'; fix the data",
    ),
    case(
        "compare-inputs-empty",
        "compare",
        ["{export}", "--inputs", "{d}/x_empty.npy"],
        1,
        "empty batch; give at least one example",
    ),
    case(
        "compare-inputs-truncated-npz",
        "compare",
        ["{export}", "--inputs", "{d}/x_truncated.npz"],
        1,
        "cannot read the inputs",
        "give a complete .npy (np.save) or .npz",
    ),
    case(
        "compare-engine-without-tensorrt",
        "compare",
        ["{export}", "--engine", "{d}/model.engine"],
        1,
        "TensorRT is not installed",
        marks=NO_TRT,
    ),
    # hydra-eval
    case(
        "eval-model-missing",
        "eval",
        ["{d}/nope", "--id", "{d}/id.npz", *EVAL_OOD],
        1,
        "does not exist",
    ),
    case(
        "eval-truncated-onnx",
        "eval",
        ["{d}/ex_truncated", "--id", "{d}/id.npz", *EVAL_OOD],
        1,
        "ONNX Runtime cannot load",
    ),
    case(
        "eval-plain-onnx-without-member-logits",
        "eval",
        ["{d}/plain.onnx", "--id", "{d}/id.npz", *EVAL_OOD],
        1,
        "has no 'member_logits' output",
        "is it a Hydra export?",
    ),
    case(
        "eval-id-missing",
        "eval",
        ["{export}", "--id", "{d}/nope.npz", *EVAL_OOD],
        1,
        "ID data: ",
        "does not exist",
    ),
    case(
        "eval-id-wrong-shape",
        "eval",
        ["{export}", "--id", "{d}/id_shape.npz", *EVAL_OOD],
        1,
        "must have size 16 on axis 2",
    ),
    case(
        "eval-id-uint8",
        "eval",
        ["{export}", "--id", "{d}/id_uint8.npz", *EVAL_OOD],
        1,
        "got uint8 (raw pixels?",
    ),
    case(
        "eval-id-nan",
        "eval",
        ["{export}", "--id", "{d}/id_nan.npz", *EVAL_OOD],
        1,
        "NaN or infinite values",
    ),
    case(
        "eval-id-empty",
        "eval",
        ["{export}", "--id", "{d}/id_empty.npz", *EVAL_OOD],
        1,
        "is empty: it holds no examples",
    ),
    case(
        "eval-id-labels-out-of-range",
        "eval",
        ["{export}", "--id", "{d}/id_labels.npz", *EVAL_OOD],
        1,
        "labels must lie in [0, 4] (the model has 5 classes)",
    ),
    case(
        "eval-id-truncated-npz",
        "eval",
        ["{export}", "--id", "{d}/id_truncated.npz", *EVAL_OOD],
        1,
        "ID data: cannot read",
        "give a complete .npz",
    ),
    case(
        "eval-id-without-labels",
        "eval",
        ["{export}", "--id", "{d}/x.npy", *EVAL_OOD],
        1,
        "without labels; in-distribution data is a .npz with x and y",
    ),
    case(
        "eval-ood-strings",
        "eval",
        ["{export}", "--id", "{d}/id.npz", "--ood", "o={d}/ood_str.npz", "--out", "{tmp}/report"],
        1,
        "must be float32, got <U1",
    ),
    case(
        "eval-ood-empty",
        "eval",
        [
            "{export}",
            "--id",
            "{d}/id.npz",
            "--ood",
            "o={d}/calib_empty.npz",
            "--out",
            "{tmp}/report",
        ],
        1,
        "OOD set 'o'",
        "is empty",
    ),
    case(
        "eval-bins-too-many",
        "eval",
        ["{export}", "--id", "{d}/id.npz", *EVAL_OOD, "--bins", "1000000000000"],
        1,
        "--bins must be in 1..10000",
        "got 1000000000000",
    ),
    case(
        "eval-out-exists",
        "eval",
        ["{export}", "--id", "{d}/id.npz", "--ood", "o={d}/ood.npz", "--out", "{tmp}/existing_dir"],
        1,
        "exists; pass --overwrite to replace it",
    ),
    # hydra-bench (every case fails before anything is measured)
    case(
        "bench-zero-members",
        "bench",
        [*BENCH, "--members", "0"],
        1,
        "members (--members) must be an integer >= 1, got 0",
    ),
    case(
        "bench-heads-per-member-above-layer-heads",
        "bench",
        [*BENCH, "--heads-per-member", "4"],
        1,
        "more than vit_ti16's 3 heads per layer; use 1..3",
    ),
    case(
        "bench-out-exists",
        "bench",
        [*BENCH, "--out", "{tmp}/existing.json"],
        1,
        "exists; pass --overwrite to replace it",
    ),
    case(
        "bench-baseline-missing",
        "bench",
        [*BENCH, "--check", "{d}/nope.json"],
        1,
        "does not exist; write one with hydra-bench ... --write-baseline PATH",
    ),
    case(
        "bench-baseline-malformed-json",
        "bench",
        [*BENCH, "--check", "{d}/base_malformed.json"],
        1,
        "is not a JSON file",
        "rewrite it with hydra-bench",
    ),
    case(
        "bench-baseline-future-format",
        "bench",
        [*BENCH, "--check", "{d}/base_future.json"],
        1,
        "is not a hydra-bench baseline (format 'hydra-bench-baseline/9'",
    ),
    # argparse usage errors: exit 2, usage line(s) then "<prog>: error: ..."
    case(
        "fuse-usage-members-not-an-int",
        "fuse",
        ["--backbone", "vit_ti16", "--members", "three"],
        2,
        "argument --members/-m: invalid int value: 'three'",
    ),
    case(
        "fuse-usage-no-backbone", "fuse", [], 2, "the following arguments are required: --backbone"
    ),
    case(
        "export-usage-unknown-exporter",
        "export",
        ["--backbone", "vit_ti16", "--exporter", "onnx2"],
        2,
        "argument --exporter: invalid choice: 'onnx2'",
    ),
    case(
        "build-usage-unknown-precision",
        "build",
        ["{export}", "--precision", "int8"],
        2,
        "argument --precision: invalid choice: 'int8'",
    ),
    case("run-usage-no-model", "run", [], 2, "the following arguments are required: MODEL"),
    case(
        "run-usage-json-and-csv",
        "run",
        ["{export}", "--json", "a.json", "--csv", "b.csv"],
        2,
        "argument --csv: not allowed with argument --json",
    ),
    case(
        "compare-usage-batch-not-an-int",
        "compare",
        ["{export}", "--batch", "many"],
        2,
        "argument --batch: invalid int value: 'many'",
    ),
    case(
        "eval-usage-no-id",
        "eval",
        ["{export}", "--ood", "o=x.npz", "--out", "r"],
        2,
        "the following arguments are required: --id",
    ),
    case(
        "bench-usage-no-backbone",
        "bench",
        [],
        2,
        "the following arguments are required: --backbone",
    ),
]


@pytest.fixture
def places(export_dir, files, tmp_path) -> dict[str, Path]:
    """Where the placeholders point; {tmp} holds an existing file and folder no case may touch."""
    (tmp_path / "existing.json").write_text(PRECIOUS)
    (tmp_path / "existing_dir").mkdir()
    (tmp_path / "existing_dir" / "keep.txt").write_text(PRECIOUS)
    return {"export": export_dir, "d": files, "tmp": tmp_path}


def invoke(capsys, command: str, argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` of a command, in process: (exit code, stdout, stderr)."""
    try:
        code = MAINS[command](argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def expand(argv: list[str], places: dict[str, Path]) -> list[str]:
    return [a.format(**places) for a in argv]


def assert_nothing_written(tmp: Path) -> None:
    """No output, temporary or half-written, beside the untouched existing ones."""
    assert sorted(p.name for p in tmp.iterdir()) == ["existing.json", "existing_dir"]
    assert (tmp / "existing.json").read_text() == PRECIOUS
    assert [p.name for p in (tmp / "existing_dir").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(("command", "argv", "code", "fragments"), CASES)
def test_bad_input(capsys, places, command, argv, code, fragments):
    got, out, err = invoke(capsys, command, expand(argv, places))
    assert got == code, f"exit {got}, expected {code}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    if code == 1:  # a HydraError: one line, "error: <problem>; <what to do>"
        assert len(lines) == 1, err
        assert lines[0].startswith("error: "), err
        assert out == "", out
        line = lines[0]
    else:  # argparse: its usage lines, then "<prog>: error: <what is wrong>"
        prog = f"hydra-{'build' if command == 'build' else command}"
        assert lines[0].startswith(f"usage: {prog}"), err
        assert lines[-1].startswith(f"{prog}: error: "), err
        line = lines[-1]
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert_nothing_written(places["tmp"])


# --- --debug shows the traceback -------------------------------------------------------------------
DEBUG_CASES = [
    "fuse-spec-other-layer-count",
    "fuse-calib-wrong-dtype-strings",
    "export-from-truncated-onnx",
    "run-input-empty-array",
    "compare-inputs-uint8",
    "eval-id-truncated-npz",
    "build-plain-onnx-without-hydra-metadata",
]


@pytest.mark.parametrize("case_id", DEBUG_CASES)
def test_debug_raises_the_error_with_its_traceback(capsys, places, case_id):
    (command, argv, _, fragments) = next(c.values for c in CASES if c.id == case_id)
    with pytest.raises(HydraError) as info:
        MAINS[command]([*expand(argv, places), "--debug"])
    assert fragments[0] in str(info.value)
    assert info.traceback and capsys.readouterr().err.count("error: ") == 0  # raised, not printed


@pytest.mark.parametrize(
    ("module", "argv", "error_class"),
    [
        ("hydra_deploy.cli.run", ["{export}", "{d}/x_nan.npy"], "RunnerError"),
        ("hydra_deploy.cli.build", ["{d}/plain.onnx", "--trtexec"], "EngineError"),
    ],
)
def test_console_shows_a_traceback_only_with_debug(places, module, argv, error_class):
    """The real command line (a subprocess, real logging and stderr): one line, or with --debug
    Python's traceback ending in the project's error class."""
    argv = expand(argv, places)
    command = [sys.executable, "-m", module, *argv]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode == 1, plain.stderr
    assert "Traceback" not in plain.stderr + plain.stdout
    assert len(plain.stderr.strip().splitlines()) == 1 and plain.stderr.startswith("error: ")
    debug = subprocess.run(
        [*command, "--debug"], capture_output=True, text=True, timeout=120, check=False
    )
    assert debug.returncode == 1
    assert "Traceback (most recent call last):" in debug.stderr
    assert f"hydra_deploy.errors.{error_class}: " in debug.stderr


# --- unreadable files (chmod 000) --------------------------------------------------------------------
UNREADABLE = [
    ("fuse", [*FUSE, "--spec", "{file}"], "spec.json", "cannot read spec file"),
    (
        "fuse",
        [*FUSE, "--checkpoint", "{file}"],
        "ck_other_arch.safetensors",
        "check the file's permissions",
    ),
    ("fuse", [*FUSE, "--calib", "{file}"], "calib_labels.npz", "check the file's permissions"),
    (
        "export",
        ["--from", "{copy}", "--out", "{tmp}/out"],
        "model.onnx",
        "check the file's permissions",
    ),
    ("build", ["{copy}", "--trtexec"], "model.onnx", "Permission denied"),
    ("run", ["{export}", "{file}"], "x.npy", "check the file's permissions"),
    ("run", ["{copy}", "{d}/x.npy"], "hydra.json", "Permission denied"),
    ("compare", ["{export}", "--inputs", "{file}"], "x.npy", "check the file's permissions"),
    ("eval", ["{export}", "--id", "{file}", *EVAL_OOD], "id.npz", "check the file's permissions"),
]


@pytest.mark.parametrize(
    ("command", "argv", "name", "fragment"),
    UNREADABLE,
    ids=[f"{c}-unreadable-{n}" for c, _, n, _ in UNREADABLE],
)
def test_unreadable_file(capsys, places, command, argv, name, fragment):
    """chmod 000 on a file a command reads. Root (as in CI containers) reads it anyway, so there
    the case is skipped; the "folder where a file is expected" cases above take the same paths."""
    work = places["tmp"] / "unreadable"
    work.mkdir()
    if name in ("model.onnx", "hydra.json"):  # a file of an export folder: a copy of the folder
        target = work / "export" / name
        shutil.copytree(places["export"], work / "export")
    elif name == "spec.json":
        target = work / name
        HydraSpec.random("vit_ti16", 12, 3, 64, members=2, heads_per_member=1).to_json(target)
    else:
        target = work / name
        shutil.copy(places["d"] / name, target)
    target.chmod(0)
    try:
        target.open("rb").close()
    except PermissionError:
        pass
    else:
        target.chmod(0o644)
        why = (
            f"chmod 000 does not stop reads here (running as uid {os.getuid()}, "
            "root or with CAP_DAC_OVERRIDE); unreadable files cannot be made"
        )
        pytest.skip(reason=why)
    try:
        code, out, err = invoke(
            capsys, command, expand(argv, {**places, "file": target, "copy": work / "export"})
        )
    finally:
        target.chmod(0o644)
    assert code == 1, err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


# --- a plain ONNX file (no hydra.json): what each command does with it -----------------------------
def test_a_bare_hydra_onnx_file_runs_and_builds_but_compare_needs_the_folder(capsys, places):
    """The Hydra model.onnx without hydra.json carries its spec in the ONNX metadata: hydra-run runs
    it on arrays and hydra-build writes its trtexec line; hydra-compare needs hydra.json and the
    saved weights (refused above: compare-folder-without-hydra-json), and a plain ONNX model that
    is no Hydra export is refused by all three (the *-plain-onnx-* cases)."""
    bare = places["d"] / "bare" / "model.onnx"
    code, out, err = invoke(capsys, "run", [str(bare), str(places["d"] / "x.npy"), "--json", "-"])
    assert code == 0, err
    report = json.loads(out)
    assert report["count"] == 2 and {r["prediction"] for r in report["results"]} <= set(range(5))
    code, out, err = invoke(capsys, "build", [str(bare), "--trtexec", "--trt", "10"])
    assert code == 0, err
    assert out.startswith("trtexec --onnx=") and str(bare) in out


# --- an engine built elsewhere ------------------------------------------------------------------------
def test_engine_built_by_another_tensorrt_or_gpu_says_rebuild_here(capsys, places, monkeypatch):
    """TensorRT refuses to deserialize an engine of another TensorRT version or GPU (it returns
    None). No pure-Python check reads the sidecar's versions first, so this stands in a fake
    TensorRT whose runtime refuses the file and checks the message the runner gives."""
    engine_path = places["tmp"] / "model.fp16.other-sm87.trt8.6.engine"
    engine_path.write_bytes(b"an engine from elsewhere")
    engine_path.with_suffix(".json").write_text(
        json.dumps(
            {"tensorrt_version": "8.6.1", "gpu": {"name": "Orin", "compute_capability": "8.7"}}
        )
    )
    trt = types.ModuleType("tensorrt")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level=None: None})
    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda data: None)
    polygraphy_trt = types.ModuleType("polygraphy.backend.trt")
    polygraphy_trt.TrtRunner = object
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", polygraphy_trt)
    code, out, err = invoke(capsys, "run", [str(engine_path), str(places["d"] / "x.npy")])
    assert code == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TensorRT cannot load the engine")
    assert "engines only run on the TensorRT version and GPU they were built with" in lines[0]
    assert "rebuild it here with hydra-build EXPORT_DIR" in lines[0]
    for path in (engine_path, engine_path.with_suffix(".json")):
        path.unlink()


# --- the library's loaders, where the CLI does not reach ---------------------------------------------
def test_text_ood_npz_loads_and_bad_arrays_are_refused(tmp_path):
    """load_inputs on a .npz for a text backbone (--ood of a BERT) used to fail with
    AttributeError; strings are refused with a DataError."""
    from helpers.bert import tiny_bert

    from hydra_deploy.errors import DataError
    from hydra_deploy.pruning import load_inputs

    backbone = tiny_bert()
    ids = np.random.default_rng(0).integers(5, 90, (3, 6))
    np.savez(tmp_path / "ood.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    assert tuple(load_inputs(tmp_path / "ood.npz", backbone).shape) == (3, 2, 6)
    np.savez(tmp_path / "stacked.npz", x=np.stack([ids, np.ones_like(ids)], axis=1))
    assert tuple(load_inputs(tmp_path / "stacked.npz", backbone).shape) == (3, 2, 6)
    np.savez(tmp_path / "strings.npz", x=np.full((3, 2, 6), "a"))
    with pytest.raises(DataError, match="inputs must be numbers"):
        load_inputs(tmp_path / "strings.npz", backbone)
