"""hydra-eval: the report equals the metrics computed directly; plots, markdown, one-line errors."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
from helpers.vit import tiny_vit
from PIL import Image

from hydra_deploy.cli.eval import build_parser, main
from hydra_deploy.engines import load_runner
from hydra_deploy.evaluation.evaluate import evaluate
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import (
    classification_metrics,
    ensemble_scores,
    ood_metrics,
    ood_score,
    reliability_bins,
)

PNG = b"\x89PNG\r\n\x1a\n"
SCORES = ("msp", "predictive_entropy", "mutual_information")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("eval") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 4, 8), exporter="torchscript", validate=False)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((21, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 5, 21)
    np.savez(folder / "id.npz", x=x, y=y)
    np.savez(folder / "noise.npz", x=(3 * rng.standard_normal((13, 3, 16, 16))).astype(np.float32))
    np.savez(
        folder / "flat.npz",
        x=np.full((9, 3, 16, 16), 0.5, np.float32) + rng.random((9, 1, 1, 1), np.float32),
    )
    np.savez(folder / "empty.npz", x=np.zeros((0, 3, 16, 16), np.float32))
    np.savez(folder / "bad_labels.npz", x=x, y=np.where(y == 0, 7, y))
    return folder


def invoke(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_report_equals_direct_metrics(export_dir, data, tmp_path):
    out = tmp_path / "report"
    code, stdout, stderr = invoke(
        str(export_dir),
        "--id",
        str(data / "id.npz"),
        "--ood",
        f"noise={data / 'noise.npz'}",
        "--ood",
        f"flat={data / 'flat.npz'}",
        "--out",
        str(out),
        "--batch-size",
        "4",
        "--bins",
        "10",
        "--json",
    )
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert json.loads(stdout) == report
    assert report["counts"] == {"id": 21, "ood": {"noise": 13, "flat": 9}}
    assert report["precision"] == "fp32" and report["members"] == 3 and report["classes"] == 5
    assert report["id"]["ece_bins"] == 10 and report["scores"] == list(SCORES)

    with np.load(data / "id.npz") as f:
        x, y = f["x"], f["y"]
    with load_runner(export_dir) as runner:
        ident = ensemble_scores(runner(x, batch_size=8)["member_logits"])
        oods = {
            n: ensemble_scores(runner(np.load(data / f"{n}.npz")["x"])["member_logits"])
            for n in ("noise", "flat")
        }
    expected = classification_metrics(ident["probs"], y, bins=10)
    for key, value in expected.items():
        assert report["id"]["classification"][key] == pytest.approx(value, abs=1e-6), key
    table = reliability_bins(ident["probs"], y, bins=10)
    assert report["id"]["reliability"]["count"] == table["count"].tolist()
    for name, got in oods.items():
        for score in SCORES:
            direct = ood_metrics(ood_score(ident, score), ood_score(got, score))
            for key, value in direct.items():
                assert report["ood"][name]["scores"][score][key] == pytest.approx(value, abs=1e-6)
    conf = -ood_score(ident, "mutual_information")
    direct = classification_metrics(ident["probs"], y, bins=10, confidence=conf)
    assert report["id"]["selective"]["mutual_information"]["aurc"] == pytest.approx(direct["aurc"])

    for png in ["reliability.png", *(f"hist_{s}.png" for s in SCORES)]:
        assert (out / png).read_bytes()[:8] == PNG, png
        assert Image.open(out / png).size[0] > 100
    md = (out / "report.md").read_text()
    assert "| OOD set | score | AUROC | AUPR | FPR95 |" in md
    auroc = report["ood"]["noise"]["scores"]["msp"]["auroc"]
    assert f"| noise | msp | {auroc:.4f} |" in md
    assert sorted(p.name for p in out.parent.iterdir()) == ["report"]  # no temporary left

    code, _, err = invoke(
        str(export_dir),
        "--id",
        str(data / "id.npz"),
        "--ood",
        f"noise={data / 'noise.npz'}",
        "--out",
        str(out),
    )
    assert code == 1 and "--overwrite" in err and len(err.strip().splitlines()) == 1
    code, _, err = invoke(
        str(export_dir),
        "--id",
        str(data / "id.npz"),
        "--quiet",
        "--overwrite",
        "--ood",
        f"noise={data / 'noise.npz'}",
        "--out",
        str(out),
    )
    assert code == 0 and err == ""
    assert list(json.loads((out / "report.json").read_text())["ood"]) == ["noise"]


def test_library_and_image_folder(export_dir, tmp_path):
    rng = np.random.default_rng(1)
    for cls in ("ant", "bee", "cat", "dog", "eel"):  # every class: the export names none
        (tmp_path / "id" / cls).mkdir(parents=True)
        for i in range(3):
            pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "id" / cls / f"{i}.png")
    with load_runner(export_dir) as runner:
        report = evaluate(
            runner,
            tmp_path / "id",
            {"noise": rng.standard_normal((5, 3, 16, 16)).astype(np.float32)},
        )
    assert report["counts"] == {"id": 15, "ood": {"noise": 5}}
    assert report["id"]["ece_bins"] == 15
    assert set(report["ood"]["noise"]["scores"]) == set(SCORES)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--ood": "noise"}, "malformed"),
        ({"--ood": "=x.npz"}, "malformed"),
        ({"--ood": "e=empty.npz"}, "empty"),
        ({"--ood": "gone=missing.npz"}, "does not exist"),
        ({"--id": "missing.npz"}, "does not exist"),
        ({"--id": "noise.npz"}, "labels"),
        ({"--id": "bad_labels.npz"}, "labels must lie in [0, 4]"),
    ],
)
def test_errors_are_one_line(export_dir, data, tmp_path, change, message):
    args = {"--id": "id.npz", "--ood": "noise=noise.npz"}
    args.update(change)
    ood = args["--ood"]
    if "=" in ood and ood.split("=", 1)[0]:
        ood = f"{ood.split('=', 1)[0]}={data / ood.split('=', 1)[1]}"
    code, _, err = invoke(
        str(export_dir),
        "--id",
        str(data / args["--id"]),
        "--ood",
        ood,
        "--out",
        str(tmp_path / "rep"),
    )
    assert code == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "rep").exists()


def test_data_errors_say_what_to_do(export_dir, data, tmp_path):
    """Each names the file (not a batch of it) and says how to fix it, in one line."""
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "gray.npz", x=rng.random((40, 1, 16, 16), np.float32), y=np.zeros(40, int))
    (tmp_path / "notes.txt").write_text("a line of text\n")
    cases = [
        (["--ood", f"gone={tmp_path / 'missing.npz'}"], "does not exist; check the path: give"),
        (["--id", str(data / "noise.npz")], "np.savez(path, x=x, y=labels)"),
        (["--ood", f"txt={tmp_path / 'notes.txt'}"], "which takes images; give an image folder"),
        (["--id", str(tmp_path / "gray.npz")], "gray.npz, 40 examples): input"),
        (["--id", str(tmp_path / "gray.npz")], "np.repeat(x, 3, axis=1)"),
    ]
    for change, message in cases:
        argv = {"--id": str(data / "id.npz"), "--ood": f"noise={data / 'noise.npz'}"}
        argv[change[0]] = change[1]
        code, _, err = invoke(
            str(export_dir), *(x for kv in argv.items() for x in kv), "--out", str(tmp_path / "rep")
        )
        assert code == 1 and message in err, (message, err)
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "rep").exists()


def test_parser_help_lists_the_options():
    text = build_parser().format_help()
    for option in ("--id", "--ood", "--out", "--batch-size", "--bins", "--overwrite", "--json"):
        assert option in text


def test_a_pytorch_hydra_model_evaluates_like_its_export(export_dir, data):
    """evaluate() takes the fused PyTorch model itself; its report equals the ONNX export's."""
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    model = fuse(backbone, spec)
    ood = {"noise": data / "noise.npz"}
    from_torch = evaluate(model, data / "id.npz", ood, batch_size=8)
    from_onnx = evaluate(export_dir, data / "id.npz", ood, batch_size=8)
    for key, value in from_onnx["id"]["classification"].items():
        assert from_torch["id"]["classification"][key] == pytest.approx(value, abs=1e-5), key
    for score in SCORES:
        for key, value in from_onnx["ood"]["noise"]["scores"][score].items():
            assert from_torch["ood"]["noise"]["scores"][score][key] == pytest.approx(
                value, abs=1e-5
            )


def test_a_pytorch_text_model_takes_token_arrays(tmp_path):
    """A fused BERT runs from input_ids/attention_mask arrays; a text file is refused plainly."""
    from helpers.bert import tiny_bert

    from hydra_deploy.errors import HydraError
    from hydra_deploy.evaluation.evaluate import TorchRunner

    backbone = tiny_bert()
    L, H = backbone.num_layers, backbone.num_heads
    spec = HydraSpec.random(
        backbone.name, L, H, backbone.head_dim, members=2, heads_per_member=1, seed=0
    )
    model = fuse(backbone, spec)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 90, (6, 7))
    mask = np.ones_like(ids)
    mask[:3, 5:] = 0
    report = evaluate(
        model,
        ({"input_ids": ids, "attention_mask": mask}, rng.integers(0, 2, 6)),
        {"rand": {"input_ids": ids[:, ::-1].copy(), "attention_mask": mask}},
    )
    assert report["counts"] == {"id": 6, "ood": {"rand": 6}}
    import torch

    with torch.inference_mode():
        direct = model(torch.as_tensor(ids), torch.as_tensor(mask)).numpy()
    runner = TorchRunner(model)
    np.testing.assert_allclose(
        runner({"input_ids": ids, "attention_mask": mask})["member_logits"], direct, atol=1e-6
    )
    (tmp_path / "id.tsv").write_text("0\ta text\n")
    with pytest.raises(HydraError, match="no tokenizer"):
        evaluate(model, tmp_path / "id.tsv")
    with pytest.raises(HydraError, match="not a fused Hydra model"):
        TorchRunner(torch.nn.Linear(2, 2))


def test_one_member_reports_mutual_information_as_not_applicable(data, tmp_path, caplog):
    """M = 1 (the plain model exported as a baseline): mutual information and disagreement are 0
    for every example, so their AUROC/FPR95/AURC are not applicable, not a meaningless 0.5."""
    import os
    import stat

    backbone = tiny_vit("token")
    spec = HydraSpec.full(backbone.name, 3, 4, 8, members=1)
    single = tmp_path / "single"
    export_onnx(
        fuse(backbone, spec), single, batch=(1, 4, 8), exporter="torchscript", validate=False
    )
    out = tmp_path / "report"
    umask = os.umask(0o022)
    try:
        code, _, stderr = invoke(
            str(single),
            "--id",
            str(data / "id.npz"),
            "--ood",
            f"noise={data / 'noise.npz'}",
            "--out",
            str(out),
        )
    finally:
        os.umask(umask)
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["members"] == 1 and list(report["not_applicable"]) == ["mutual_information"]
    mi = report["ood"]["noise"]["scores"]["mutual_information"]
    assert mi["auroc"] is None and mi["fpr95"] is None and "not applicable" in mi["note"]
    assert report["id"]["selective"]["mutual_information"]["aurc"] is None
    assert report["ood"]["noise"]["scores"]["msp"]["auroc"] is not None
    assert "mutual_information AUROC" not in caplog.text and "msp AUROC" in caplog.text
    assert "not applicable" in (out / "report.md").read_text()
    assert not (out / "hist_mutual_information.png").exists() and (out / "hist_msp.png").exists()
    # the report folder is an ordinary folder (mkdtemp's drwx------ was kept before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "report.json").stat().st_mode) == 0o644


# --- issue 17: labels map through the model's class names ------------------------------------------
class NamedModel:
    """Just what load_eval_data reads of a runner: family, class names, the output's shape."""

    def __init__(self, family, class_names, classes=None):
        from hydra_deploy.engines.runner import TensorSpec

        self.family, self.class_names = family, class_names
        count = len(class_names) if class_names else classes
        self.outputs = (TensorSpec("member_logits", ("batch", 2, count), "float32"),)


def test_tsv_labels_map_through_the_class_names(tmp_path):
    """Issue 17: names were mapped by sorting the names of the file (a file lacking a class
    scored 0.008 instead of 0.90); they go through the model's class names now."""
    from hydra_deploy.errors import DataError
    from hydra_deploy.evaluation.evaluate import load_eval_data

    model = NamedModel("bert", ["verb", "noun", "adj"])  # not alphabetical
    (tmp_path / "id.tsv").write_text("noun\ta dog\n\nadj\tred\nnoun\ta cat\n")  # no 'verb'
    data = load_eval_data(tmp_path / "id.tsv", model, name="ID data", labelled=True)
    assert data.labels.tolist() == [1, 2, 1] and data.texts == ["a dog", "red", "a cat"]
    (tmp_path / "ids.tsv").write_text("2\tred\n0\tto run\n")  # integer labels stay indices
    assert load_eval_data(
        tmp_path / "ids.tsv", model, name="ID", labelled=True
    ).labels.tolist() == [2, 0]
    (tmp_path / "unknown.tsv").write_text("noun\ta dog\n\ncognition\tto think\n")
    with pytest.raises(
        DataError,
        match=r"line 3: label 'cognition' is not one of the model's classes: verb, noun, adj",
    ):
        load_eval_data(tmp_path / "unknown.tsv", model, name="ID data", labelled=True)
    (tmp_path / "header.tsv").write_text("label\ttext\nnoun\ta dog\n")
    with pytest.raises(DataError, match=r"line 1: label 'label' .*a header line\? remove it"):
        load_eval_data(tmp_path / "header.tsv", model, name="ID data", labelled=True)
    # OOD sets may carry any labels
    assert load_eval_data(tmp_path / "unknown.tsv", model, name="OOD", labelled=False).count == 2
    unnamed = NamedModel("bert", None, classes=3)
    with pytest.raises(
        DataError,
        match=r"names 2 classes \(adj, noun\) but the model has 3 classes and records no class names",
    ):
        load_eval_data(tmp_path / "id.tsv", unnamed, name="ID data", labelled=True)
    (tmp_path / "all.tsv").write_text("noun\ta dog\nadj\tred\nverb\tto run\n")
    data = load_eval_data(tmp_path / "all.tsv", unnamed, name="ID data", labelled=True)
    assert data.labels.tolist() == [1, 0, 2]  # sorted names, every class present (warned)


def test_image_folder_classes_map_through_the_class_names(tmp_path):
    from hydra_deploy.errors import DataError
    from hydra_deploy.evaluation.evaluate import load_eval_data

    for cls in ("ant", "cat"):
        (tmp_path / "id" / cls).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "id" / cls / "0.png")
    named = NamedModel("vit", ["dog", "cat", "bee", "ant"])
    data = load_eval_data(tmp_path / "id", named, name="ID data", labelled=True)
    assert data.labels.tolist() == [3, 1]  # ant, cat by the model's names
    with pytest.raises(
        DataError,
        match=r"sub-folder 'cat': label 'cat' is not one of the model's classes: dog, bee, ant; use those names$",
    ):
        load_eval_data(
            tmp_path / "id", NamedModel("vit", ["dog", "bee", "ant"]), name="ID", labelled=True
        )
    with pytest.raises(DataError, match=r"names 2 classes .* the model has 5 classes"):
        load_eval_data(
            tmp_path / "id", NamedModel("vit", None, classes=5), name="ID", labelled=True
        )


def test_a_pytorch_text_model_reports_its_class_names():
    import transformers
    from helpers.bert import bert_config

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.evaluation.evaluate import TorchRunner

    names = {0: "verb", 1: "noun", 2: "adj"}
    model = transformers.BertForSequenceClassification(
        bert_config(num_hidden_layers=1, num_labels=3, id2label=names)
    )
    backbone = load_backbone(model.eval())
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 1, 4, 8, members=2, heads_per_member=2))
    assert TorchRunner(hydra).class_names == ["verb", "noun", "adj"]
    ids = np.random.default_rng(0).integers(5, 90, (4, 6))
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    report = evaluate(hydra, (inputs, np.array([0, 1, 2, 1])))
    assert report["class_names"] == ["verb", "noun", "adj"]


# --- a calibrated export (hydra-calibrate): the decisions section ----------------------------------
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(a calibrated tiny export, a folder with id.npz (labels mostly the model's) and noise.npz)."""
    from helpers.decisions import calibrated_export, images, labelled_like_model

    root = tmp_path_factory.mktemp("calibrated")
    folder, _ = calibrated_export(root / "export")
    with load_runner(folder, decisions=False) as runner:
        x, y = labelled_like_model(runner, images(200, seed=7), seed=3)
    np.savez(root / "id.npz", x=x, y=y)
    np.savez(root / "noise.npz", x=images(60, seed=8, scale=4.0))
    return folder, root


def test_a_calibrated_export_reports_its_decisions_against_their_targets(calibrated, tmp_path):
    from hydra_deploy.decisions import decision_metrics

    folder, data = calibrated
    out = tmp_path / "report"
    ood = f"noise={data / 'noise.npz'}"
    common = ["--id", str(data / "id.npz"), "--ood", ood, "--bins", "10"]
    code, stdout, err = invoke(str(folder), *common, "--out", str(out), "--json")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert json.loads(stdout) == report
    section = report["decisions"]
    with load_runner(folder) as runner:
        record = runner.decisions
        with np.load(data / "id.npz") as f:
            x, y = f["x"], f["y"]
        id_logits = runner(x)["member_logits"]
        noise_logits = runner(np.load(data / "noise.npz")["x"])["member_logits"]
    direct = decision_metrics(id_logits, y, record, bins=10)
    for key, value in direct.items():
        assert section["id"][key] == pytest.approx(value, abs=1e-6), key
    for key, value in decision_metrics(noise_logits, None, record).items():
        assert section["ood"]["noise"][key] == pytest.approx(value, abs=1e-6), key
    assert section["temperature"] == record.temperature
    checks = section["id"]["checks"]
    assert checks["coverage"]["target"] == pytest.approx(1 - record.sets.alpha)
    assert checks["selective_risk"]["target"] == record.selective.target_risk == 0.2
    assert checks["flag_rate"]["target"] == record.ood.alpha
    for check in checks.values():
        assert check["meets"] is (
            check["value"] >= check["target"] - 1e-12
            if check is checks["coverage"]
            else check["value"] <= check["target"] + 1e-12
        )
    assert section["rules"]["selective"]["tau"] == record.selective.tau
    # the raw numbers are untouched: ECE before T equals the ID section's
    assert section["id"]["ece_raw"] == pytest.approx(report["id"]["classification"]["ece"])

    md = (out / "report.md").read_text()
    assert "## Decisions (hydra-calibrate)" in md and "| metric | value | target | met |" in md
    coverage = checks["coverage"]["value"]
    met = "yes" if checks["coverage"]["meets"] else "no"
    assert f"| LAC set coverage | {100 * coverage:.1f}% | >= 90.0% | {met} |" in md
    assert f"| selective risk | {100 * checks['selective_risk']['value']:.1f}% | <= 20.0%" in md
    assert "| ID flagged as OOD (msp) |" in md and "<= 5.0% |" in md
    flagged = section["ood"]["noise"]["flag_rate"]
    assert f"| noise | {100 * flagged:.1f}% |" in md
    for png in ("risk_coverage.png", "set_sizes.png"):
        assert (out / png).read_bytes()[:8] == PNG, png
        assert Image.open(out / png).size[0] > 100

    raw = tmp_path / "raw"
    code, _, err = invoke(str(folder), *common, "--out", str(raw), "--raw")
    assert code == 0, err
    raw_report = json.loads((raw / "report.json").read_text())
    assert "decisions" not in raw_report and "Decisions" not in (raw / "report.md").read_text()
    assert not (raw / "risk_coverage.png").exists() and not (raw / "set_sizes.png").exists()
    assert raw_report["id"]["classification"] == report["id"]["classification"]
    assert "decisions" not in evaluate(folder, data / "id.npz", decisions=False)


def test_risk_coverage_points_answer_the_most_confident_first():
    from hydra_deploy.uncertainty.plots import risk_coverage_points

    confidence = np.array([0.9, 0.5, 0.9, 0.7, 0.5, 0.2])
    correct = np.array([True, False, False, True, True, False])
    coverage, risk = risk_coverage_points(confidence, correct)
    expected = []
    for threshold in sorted(set(confidence.tolist()), reverse=True):
        answered = confidence >= threshold
        expected.append((answered.mean(), 1 - correct[answered].mean()))
    np.testing.assert_allclose(np.c_[coverage, risk], np.array(expected))


def test_a_file_of_another_kind_is_refused_with_the_kinds_that_are_read(tmp_path):
    """Issue 36: a .csv got 'give a .npz (x and y), an image folder' (no .tsv, trailing off)."""
    from hydra_deploy.errors import HydraError
    from hydra_deploy.evaluation.evaluate import load_eval_data

    (tmp_path / "data.csv").write_text("label,text\nnoun,a dog\n")
    text, image = NamedModel("bert", ["verb", "noun"]), NamedModel("vit", ["a", "b"])
    with pytest.raises(HydraError) as refused:
        load_eval_data(tmp_path / "data.csv", text, name="--data", labelled=True)
    assert str(refused.value).endswith(
        "(a .csv file, not read as data): give a .tsv (label<TAB>text, one example per line) or "
        ".txt text file, or a .npz of token ids and labels y; a .csv: save it tab-separated as .tsv"
    )
    with pytest.raises(HydraError) as refused:
        load_eval_data(tmp_path / "data.csv", image, name="--id", labelled=False)
    assert str(refused.value).endswith(
        "(a .csv file, not read as data): give an image folder (one sub-folder per class) or a "
        ".npz of image arrays x"
    )
