"""Tests of the hydra-fuse command (in process, on the 224 px ViT-Tiny with random weights)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from hydra_deploy.cli.fuse import EXAMPLES, main
from hydra_deploy.specs import HydraSpec

BACKBONE = "vit_ti16"  # 12 layers x 3 heads of 64, width 192, 1000 classes, 197 tokens
LAYERS, HEADS, HEAD_DIM, CLASSES = 12, 3, 64, 1000
SCRIPT = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "hydra-fuse"


def invoke(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr captured: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def vit_ti_macs() -> int:
    """ViT-Ti/16 MACs per image by hand: patch embedding, 12 layers, classifier."""
    N, D, H, hd, hidden = 197, 192, 3, 64, 768
    layer = 3 * N * D * D + 2 * H * N * N * hd + N * D * D + 2 * N * D * hidden
    return 196 * 3 * 16 * 16 * D + LAYERS * layer + D * CLASSES


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the params / MACs table, by model name."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] in ("single", "hydra", "deep_ensemble") and len(cells) == 5:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> tuple[int, str, str, Path]:
    """One default run (random spec, M=3) that also saves its spec."""
    spec_path = tmp_path_factory.mktemp("plain") / "spec.json"
    code, out, err = invoke("--backbone", BACKBONE, "--batch", "1", "--save-spec", str(spec_path))
    return code, out, err, spec_path


@pytest.fixture(scope="module")
def given_spec(tmp_path_factory) -> tuple[HydraSpec, Path]:
    spec = HydraSpec.random(
        BACKBONE, LAYERS, HEADS, HEAD_DIM, members=2, heads_per_member=2, shared_layers=3, seed=5
    )
    path = tmp_path_factory.mktemp("given") / "given.json"
    spec.to_json(path)
    return spec, path


@pytest.fixture(scope="module")
def json_run(given_spec) -> tuple[int, str, str]:
    """A --json run of a given 2-member spec file."""
    return invoke("--backbone", BACKBONE, "--batch", "1", "--spec", str(given_spec[1]), "--json")


def test_default_run_prints_members_shape_and_macs(plain_run):
    code, out, err, _ = plain_run
    assert code == 0, err
    # the member table: a header over layers, one row per member
    assert (
        f"HydraSpec '{BACKBONE}': {LAYERS} layers x {HEADS} heads (head_dim {HEAD_DIM}), 3 members"
        in out
    )
    header = next(line for line in out.splitlines() if line.startswith("member "))
    assert header.split() == ["member", *[f"L{i}" for i in range(LAYERS)], "total", "%"]
    for m in range(3):  # default heads per member: 3 heads // 3 members = 1 in every layer
        row = next(line for line in out.splitlines() if line.startswith(f"m{m} "))
        assert row.split() == [f"m{m}", *["1"] * LAYERS, "12", "33.3%"]
    assert f"HydraModel (vit, {BACKBONE}): 3 members, {CLASSES} classes" in out
    # the forward pass
    assert "input (1, 3, 224, 224) -> member_logits (1, 3, 1000)" in out
    assert "[batch, members, classes]" in out
    # the params / MACs table
    assert "GMACs/example" in out
    rows = table_rows(out)
    assert set(rows) == {"single", "hydra", "deep_ensemble"}
    assert rows["single"] == ["5.72", "1.00", f"{vit_ti_macs() / 1e9:.3f}", "1.00"]
    assert rows["single"][2] == "1.254"
    assert rows["deep_ensemble"][0] == "17.15" and rows["deep_ensemble"][1] == "3.00"
    assert rows["deep_ensemble"][2:] == [f"{3 * vit_ti_macs() / 1e9:.3f}", "3.00"]
    hydra_x = float(rows["hydra"][3])
    assert 1.0 < hydra_x < 3.0  # cheaper than the deep ensemble, dearer than one model


def test_save_spec_writes_the_printed_spec(plain_run):
    code, out, _, spec_path = plain_run
    assert code == 0
    assert f"spec written to {spec_path}" in out
    saved = HydraSpec.from_json(spec_path)
    assert saved.summary() in out  # the spec printed is the spec saved
    assert (saved.backbone, saved.num_layers, saved.num_heads, saved.head_dim) == (
        BACKBONE,
        LAYERS,
        HEADS,
        HEAD_DIM,
    )
    assert saved.num_members == 3 and saved.importance == "random" and saved.seed == 0
    # the same command line draws the same spec (seeded)
    assert saved == HydraSpec.random(
        BACKBONE, LAYERS, HEADS, HEAD_DIM, members=3, heads_per_member=1, seed=0
    )


def test_json_output(json_run, given_spec):
    code, out, err = json_run
    assert code == 0, err
    report = json.loads(out)  # stdout is nothing but the JSON document
    assert {"spec", "parameters", "macs_per_example", "output_shape"} <= set(report)
    spec = given_spec[0]
    assert HydraSpec.from_dict(report["spec"]) == spec
    assert report["output_shape"] == [1, spec.num_members, CLASSES] == [1, 2, 1000]
    assert report["input_shape"] == [1, 3, 224, 224]
    assert report["backbone"] == BACKBONE and report["weights"] == "random"
    params, macs = report["parameters"], report["macs_per_example"]
    assert set(params) == set(macs) == {"hydra", "single", "deep_ensemble"}
    assert params["single"] == 5_717_416
    assert params["deep_ensemble"] == 2 * params["single"]
    assert macs["single"] == vit_ti_macs()
    assert macs["deep_ensemble"] == 2 * macs["single"]
    assert macs["single"] < macs["hydra"] < macs["deep_ensemble"]


def test_save_spec_refuses_to_overwrite(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text("precious\n")
    code, out, err = invoke("--backbone", BACKBONE, "--batch", "1", "--save-spec", str(path))
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "--overwrite" in lines[0] and str(path) in lines[0]
    assert path.read_text() == "precious\n"
    assert out == ""


def test_spec_for_another_backbone_fails_cleanly(tmp_path):
    path = tmp_path / "two_layers.json"
    HydraSpec.random(BACKBONE, 2, HEADS, HEAD_DIM, members=2, heads_per_member=1).to_json(path)
    code, out, err = invoke("--backbone", BACKBONE, "--batch", "1", "--spec", str(path))
    assert code == 1
    assert "error:" in err
    assert "num_layers=2 (backbone has 12)" in err
    assert "Traceback" not in err + out


def test_unreadable_spec_file_fails_cleanly(tmp_path):
    missing = tmp_path / "missing.json"
    code, _, err = invoke("--backbone", BACKBONE, "--batch", "1", "--spec", str(missing))
    assert code == 1
    assert err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


def test_unknown_backbone_is_one_line_error():
    code, out, err = invoke("--backbone", "vit_b17", "--batch", "1")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: unknown backbone 'vit_b17'")
    assert "vit_b16" in lines[0]
    assert out == ""


def test_bad_batch_is_an_error():
    code, _, err = invoke("--backbone", BACKBONE, "--batch", "0")
    assert code == 1
    assert err.strip() == "error: --batch must be at least 1, got 0"


def test_quiet_prints_nothing(capsys):
    code = main(["--backbone", BACKBONE, "--batch", "1", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out == ""


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hydra-fuse")
    assert "examples:" in out
    for line in EXAMPLES.strip().splitlines():
        assert line.strip() in out
    for option in ("--backbone", "--spec", "--save-spec", "--overwrite", "--json", "--quiet"):
        assert option in out


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])  # --backbone is required
    assert info.value.code == 2
    assert "--backbone" in capsys.readouterr().err


def test_console_script_help():
    if not SCRIPT.is_file():
        pytest.skip(reason=f"console script {SCRIPT} is not on disk (pip install -e . creates it)")
    result = subprocess.run(
        [str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hydra-fuse")
    assert "examples:" in result.stdout
    assert "hydra-fuse --backbone vit_b16 --members 3 --heads-per-member 4" in result.stdout


# --- heads chosen on data, members fine-tuned ---------------------------------------------------------
@pytest.fixture(scope="module")
def npz_data(tmp_path_factory) -> Path:
    """Four preprocessed 224 px inputs with labels, as a user's .npz."""
    import numpy as np

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "train.npz"
    np.savez(
        path,
        x=rng.standard_normal((4, 3, 224, 224)).astype("float32"),
        y=rng.integers(0, CLASSES, 4),
    )
    return path


def test_taylor_selection_and_finetuning_from_the_cli(npz_data, tmp_path):
    spec_path, members_dir = tmp_path / "spec.json", tmp_path / "members"
    argv = (
        "--backbone",
        BACKBONE,
        "--calib",
        str(npz_data),
        "--finetune",
        str(npz_data),
        "--members",
        "2",
        "--heads-per-member",
        "1",
        "--finetune-steps",
        "2",
        "--finetune-batch-size",
        "2",
        "--finetune-dir",
        str(members_dir),
        "--batch",
        "1",
        "--save-spec",
        str(spec_path),
        "--json",
    )
    code, out, err = invoke(*argv)
    assert code == 0, err
    report = json.loads(out)
    assert report["spec"]["importance"] == "taylor"
    assert [entry["steps"] for entry in report["finetune"]] == [2, 2]
    assert report["merge"]["embeddings"] == "per-member"  # fine-tuned: weights differ everywhere
    assert report["output_shape"] == [1, 2, CLASSES]
    assert HydraSpec.from_json(spec_path).to_dict() == report["spec"]
    assert sorted(p.name for p in members_dir.iterdir()) == [
        "member_0.json",
        "member_0.safetensors",
        "member_1.json",
        "member_1.safetensors",
    ]
    # a second run resumes the saved members instead of training again
    code, out, err = invoke(*argv[:-3], "--json")
    assert code == 0, err
    assert all(entry["resumed"] for entry in json.loads(out)["finetune"])


def test_selection_options_are_checked(npz_data):
    code, _, err = invoke("--backbone", BACKBONE, "--importance", "circuit", "--batch", "1")
    assert code == 1 and "--importance circuit needs --calib" in err
    code, _, err = invoke("--backbone", BACKBONE, "--calib", str(npz_data), "--shared-layers", "2")
    assert code == 1 and "--importance random only" in err
    code, _, err = invoke("--backbone", BACKBONE, "--finetune-steps", "1")
    assert code == 1 and "need --finetune DATA" in err


def test_one_member_is_the_plain_model(caplog):
    """--members 1 is the single-model baseline: every head kept, said so, "1 member"."""
    import logging

    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        code, out, err = invoke("--backbone", BACKBONE, "--members", "1", "--batch", "1")
    assert code == 0, err
    assert "drawn at random" not in caplog.text
    assert "the plain model" in caplog.text and "all 3 heads" in caplog.text
    assert "1 member," in out and "1 members" not in out
    code, out, err = invoke("--backbone", BACKBONE, "--members", "1", "--batch", "1", "--json")
    spec = HydraSpec.from_dict(json.loads(out)["spec"])
    assert spec.importance == "manual"
    assert all(h == tuple(range(HEADS)) for h in spec.members[0].heads)


def test_build_hydra_returns_the_spec_as_fused():
    """The spec build_hydra returns (and hydra-export logs and saves) says how it was fused."""
    from hydra_deploy.cli import model_options as build
    from hydra_deploy.cli.fuse import build_parser

    args = build_parser().parse_args(["--backbone", BACKBONE, "--mlp-merge", "grouped"])
    _, spec, _, hydra = build.build_hydra(args, progress=False)
    assert spec.mlp_merge == hydra.spec.mlp_merge == "grouped"
    assert "mlp_merge=grouped" in spec.summary()


# --- a BERT backbone (issue 17) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> Path:
    """A tiny BertForSequenceClassification (3 layers x 4 heads, 5 classes) saved by transformers."""
    from helpers.bert import tiny_bert

    folder = tmp_path_factory.mktemp("bert") / "classifier"
    tiny_bert("segments").module.save_pretrained(folder)
    return folder


def test_fuses_a_bert_backbone(bert_folder):
    """hydra-fuse's forward check passed the text inputs (a dict) as one positional argument."""
    code, out, err = invoke(
        "--backbone", f"hf:{bert_folder}", "--members", "2", "--batch", "3", "--json", "--quiet"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["input_shape"] == [3, 64]  # [batch, seq]: the tiny model's 64 positions
    assert report["output_shape"] == [3, 2, 5]
    assert report["spec"]["num_layers"] == 3 and len(report["spec"]["members"]) == 2
    code, out, err = invoke("--backbone", f"hf:{bert_folder}", "--members", "2")
    assert code == 0, err
    assert "forward: input (2, 64) -> member_logits (2, 2, 5)" in out


def test_num_classes_other_than_a_bert_checkpoints_needs_new_head(bert_folder):
    code, out, err = invoke("--backbone", f"hf:{bert_folder}", "--num-classes", "3", "--json")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and out == "" and len(errors) == 1 and "Traceback" not in err
    assert "classifier of 5 classes, not --num-classes 3" in errors[0] and "--new-head" in errors[0]
    assert "num_classes" not in errors[0] and "new_classifier" not in errors[0]
    code, out, err = invoke(
        "--backbone",
        f"hf:{bert_folder}",
        "--num-classes",
        "3",
        "--new-head",
        "--members",
        "2",
        "--json",
        "--quiet",
    )
    assert code == 0, err
    assert json.loads(out)["output_shape"] == [2, 2, 3]
    code, _, err = invoke("--backbone", f"hf:{bert_folder}", "--new-head")
    assert code == 1 and "--new-head needs --num-classes N" in err and "--num-classes" in err
    code, _, err = invoke("--backbone", BACKBONE, "--num-classes", "3", "--new-head")
    assert code == 1 and "applies to BERT classifiers" in err


def test_shared_parts_and_warmup_from_the_cli(npz_data):
    """--shared-parts frozen keeps one copy of the embeddings and classifier (issue 17, finding
    11) and the parameters line says what is per member; --warmup-steps reaches fine-tuning."""
    code, out, err = invoke(
        "--backbone",
        BACKBONE,
        "--finetune",
        str(npz_data),
        "--members",
        "2",
        "--heads-per-member",
        "1",
        "--finetune-steps",
        "2",
        "--finetune-batch-size",
        "2",
        "--warmup-steps",
        "1",
        "--shared-parts",
        "frozen",
        "--batch",
        "1",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["merge"]["embeddings"] == report["merge"]["classifier"] == "shared"
    assert {e["shared_parts"] for e in report["finetune"]} == {"frozen"}
    code, out, err = invoke(
        "--backbone",
        BACKBONE,
        "--finetune",
        str(npz_data),
        "--members",
        "2",
        "--heads-per-member",
        "1",
        "--finetune-steps",
        "2",
        "--finetune-batch-size",
        "2",
        "--batch",
        "1",
    )
    assert code == 0, err
    assert "x the single model's" in out and "per member: embeddings" in out
    for flag in (("--warmup-steps", "1"), ("--shared-parts", "averaged")):
        code, _, err = invoke("--backbone", BACKBONE, *flag)
        assert code == 1 and "need --finetune DATA" in err


# --- a user's deep ensemble fused into one network (issue 19, item 6) --------------------------
TINY_ARGS = (
    "--backbone",
    "vit_tiny_patch16_224",
    "--model-arg",
    "img_size=16",
    "--model-arg",
    "patch_size=4",
    "--model-arg",
    "embed_dim=32",
    "--model-arg",
    "depth=2",
    "--model-arg",
    "num_heads=4",
)


@pytest.fixture(scope="module")
def ensemble_checkpoints(tmp_path_factory) -> list[Path]:
    """Three independently initialised tiny ViTs (3 classes) and one with 4 classes."""
    import timm
    import torch
    from helpers.vit import scramble
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("ensemble")
    paths = []
    for seed, classes in ((0, 3), (1, 3), (2, 3), (3, 4)):
        torch.manual_seed(seed)
        model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=16,
            patch_size=4,
            embed_dim=32,
            depth=2,
            num_heads=4,
            num_classes=classes,
        )
        path = folder / f"member{seed}.safetensors"
        save_file({k: v.contiguous() for k, v in scramble(model, seed).state_dict().items()}, path)
        paths.append(path)
    return paths


def test_several_checkpoints_fuse_as_members(ensemble_checkpoints):
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.cli import model_options as build
    from hydra_deploy.cli.fuse import build_parser

    three = [str(p) for p in ensemble_checkpoints[:3]]
    args = build_parser().parse_args(
        [*TINY_ARGS, "--checkpoint", *three, "--heads-per-member", "2"]
    )
    _, spec, _, hydra = build.build_hydra(args, progress=False)
    assert spec.num_members == 3 and spec.mlp_merge == "grouped"
    assert spec.meta["checkpoints"] == three
    assert hydra.merge["embeddings"] == "per-member" and hydra.merge["classifier"] == "per-member"
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = hydra(x)
        for m, path in enumerate(three):  # member m is checkpoint m with its own heads kept
            alone = load_backbone(
                args.backbone,
                checkpoint=path,
                img_size=16,
                patch_size=4,
                embed_dim=32,
                depth=2,
                num_heads=4,
            )
            torch.testing.assert_close(
                fused[:, m], alone(x, spec.head_mask(m)), atol=1e-5, rtol=1e-5
            )
    code, out, err = invoke(*TINY_ARGS, "--checkpoint", *three, "--batch", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["output_shape"] == [2, 3, 3]


def test_several_checkpoints_bad_combinations(ensemble_checkpoints):
    three = [str(p) for p in ensemble_checkpoints[:3]]
    cases = [
        (("--members", "2"), "--members 2 disagrees with the 3 checkpoints"),
        (("--mlp-merge", "average"), "use --mlp-merge grouped"),
        (("--spec", "spec.json"), "--spec with several --checkpoint files"),
    ]
    for extra, message in cases:
        code, out, err = invoke(*TINY_ARGS, "--checkpoint", *three, *extra)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 1 and out == "" and len(errors) == 1 and message in errors[0], (extra, err)
    mixed = [three[0], str(ensemble_checkpoints[3])]  # 3 classes and 4 classes
    code, _, err = invoke(*TINY_ARGS, "--checkpoint", *mixed)
    assert code == 1 and "is not the architecture of" in err and "num_classes 4 (vs 3)" in err


def test_cli_choices_repeat_the_librarys():
    """The CLI repeats a few choice lists so that parsing needs no torch; they must stay equal."""
    from hydra_deploy.cli.fuse import build_parser
    from hydra_deploy.pruning.finetune import SHARED_PARTS
    from hydra_deploy.pruning.importance import CONDITIONINGS

    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["shared_parts"].choices) == SHARED_PARTS
    assert tuple(actions["conditioning"].choices) == CONDITIONINGS
