"""The uncertainty benchmarks' building blocks (benchmarks/uq_*.py): data, scoring, the protocol."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import uq_common
import uq_digits
import uq_wordnet

from hydra_deploy.backbones import load_backbone
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import ece

NOUN_LINES = """\
  1 This software and database is being provided to you, the LICENSEE, by
  2 Princeton University under the following license. | not a gloss
00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known; "an example"
00002137 05 n 02 dog 0 cat 0 000 | a member of the genus Canis; "the dog barked"
00002452 06 n 01 thing 0 000 | an entity
00002684 06 n 01 object 0 000 | a tangible and visible entity;
"""


# --- data ------------------------------------------------------------------------------------------
def test_gloss_parsing_drops_examples_and_the_license(tmp_path, monkeypatch):
    assert uq_wordnet.gloss_of(NOUN_LINES.splitlines()[2]) == "that which is perceived or known"
    (tmp_path / "data.noun").write_text(NOUN_LINES)
    monkeypatch.setattr(uq_wordnet, "WORDNET", tmp_path)
    assert uq_wordnet.read_glosses("data.noun") == [
        (3, "that which is perceived or known"),
        (5, "a member of the genus Canis"),
        (6, "a tangible and visible entity"),  # "an entity" has fewer than 3 words
    ]
    with pytest.raises(SystemExit, match="apt-get install wordnet-base"):
        uq_wordnet.read_glosses("data.verb")


def test_typos_are_seeded_small_edits():
    text = "a domesticated carnivorous mammal that typically has a long snout"
    same = uq_wordnet.typos(text, np.random.default_rng(3))
    assert same == uq_wordnet.typos(text, np.random.default_rng(3))
    assert uq_wordnet.typos(text, np.random.default_rng(3), rate=0.0) == text
    edited = uq_wordnet.typos(text, np.random.default_rng(3), rate=1.0)
    words, new = text.split(" "), edited.split(" ")
    assert len(new) == len(words)
    assert sum(a != b for a, b in zip(words, new, strict=True)) >= 6  # of 8 words with 3+ letters
    for a, b in zip(words, new, strict=True):
        assert len(b) in (len(a), len(a) - 1)
        if len(a) < 3:
            assert a == b


def test_python_doc_sentences_are_prose():
    sentences = uq_wordnet.python_doc_sentences()
    assert len(sentences) > 1000
    assert all(5 <= len(s.split()) <= 40 for s in sentences)
    assert len(set(sentences)) == len(sentences)


def test_letters_and_photos_look_like_digits_data():
    from sklearn.datasets import load_digits

    letters = uq_digits.render_letters(20, seed=1)
    assert letters.shape == (20, 8, 8)
    assert np.array_equal(letters, np.round(letters)) and letters.min() >= 0 and letters.max() <= 16
    assert (letters.sum(axis=(1, 2)) > 100).all()  # ink in every image
    assert np.array_equal(letters, uq_digits.render_letters(20, seed=1))
    photos = uq_digits.photo_patches(10, seed=2)
    assert photos.shape == (10, 8, 8) and photos.min() == 0 and photos.max() == 16
    x = uq_digits.to_model_input(load_digits().images[:5])
    assert x.shape == (5, 1, 16, 16) and x.min() >= -1 and x.max() <= 1
    shifted = uq_digits.shifted(x, seed=3)
    assert shifted.shape == x.shape and torch.equal(shifted, uq_digits.shifted(x, seed=3))
    assert (shifted - x).abs().mean() > 0.1


# --- scoring ---------------------------------------------------------------------------------------
def _task(rng, members=3):
    def logits(n, scale):
        return rng.standard_normal((n, members, 4)) * scale

    test_y = torch.as_tensor(rng.integers(0, 4, 30))
    task = uq_common.Task(
        name="t",
        classes=list("abcd"),
        train=(None, None),
        test=(None, test_y),
        shift=(None, test_y),
        ood={"a": None, "b": None},
        new_model=None,
        recipe=None,
    )
    sets = {
        "id": logits(30, 3.0),
        "shift": logits(30, 1.0),
        "ood:a": logits(20, 1.0),
        "ood:b": logits(25, 0.5),
    }
    return task, sets


@pytest.mark.parametrize("members", [1, 3])
def test_score_row_equals_scikit_learn(members):
    rng = np.random.default_rng(members)
    task, sets = _task(rng, members)
    row = uq_common.score_row(sets, task)
    ident = ensemble_scores(sets["id"])
    assert row["id"]["accuracy"] == pytest.approx(
        (ident["prediction"] == task.test[1].numpy()).mean()
    )
    assert row["id"]["ece"] == pytest.approx(
        ece(ident["probs"].astype(np.float64), task.test[1].numpy())
    )
    aurocs = []
    for name in ("a", "b"):
        ood = ensemble_scores(sets[f"ood:{name}"])
        labels = np.r_[np.zeros(30), np.ones(len(ood["msp"]))]
        expected = roc_auc_score(labels, -np.r_[ident["msp"], ood["msp"]].astype(np.float64))
        assert row["ood"][name]["msp"]["auroc"] == pytest.approx(expected)
        aurocs.append(expected)
        assert ("mutual_information" in row["ood"][name]) == (members > 1)
    assert row["ood_mean"]["msp"]["auroc"] == pytest.approx(np.mean(aurocs))


def test_aggregate_and_claims_are_paired_over_seeds():
    def seed_rows(offset):
        rows = {}
        for i, row in enumerate(uq_common.ROWS):
            rows[row] = {
                "id": {"ece": 0.1 - 0.01 * i + offset},
                "shift": {"ece": 0.2, "nll": 1.0 + offset * (row == "single Taylor-pruned")},
                "ood_mean": {"msp": {"auroc": 0.7 + 0.01 * i + offset, "fpr95": 0.5}},
            }
        return {"rows": rows}

    per_seed = [seed_rows(0.0), seed_rows(0.02), seed_rows(-0.01)]
    agg = uq_common.aggregate(per_seed)
    cell = agg["deep ensemble"]["ood_mean"]["msp"]["auroc"]
    i = uq_common.ROWS.index("deep ensemble")
    values = [0.7 + 0.01 * i + o for o in (0.0, 0.02, -0.01)]
    assert cell["values"] == pytest.approx(values)
    assert cell["std"] == pytest.approx(np.std(values, ddof=1))
    claims = {(c["claim"]): c for c in uq_common.claims(per_seed)}
    gap = 0.01 * (
        uq_common.ROWS.index("Hydra (circuit)") - uq_common.ROWS.index("deep ensemble (one base)")
    )
    # circuit has a lower AUROC than the one-base ensemble (further down ROWS) on every seed
    beat = claims["Hydra (circuit) detects OOD better than the deep ensemble of one base"]
    assert beat["advantage_mean"] == pytest.approx(gap) and beat["seeds_better"] == 0
    assert beat["verdict"].startswith("does not hold")
    calib = claims["Hydra (circuit) is better calibrated than the deep ensemble of one base"]
    assert calib["advantage_mean"] == pytest.approx(gap)  # ECE: lower is better
    ties = claims["Hydra (circuit) has a lower FPR95 than the deep ensemble of one base"]
    assert ties["seeds_better"] == 0 and ties["advantage_mean"] == 0
    # margins: 1 AUROC point over the single model (index 0)
    targets = {(c["claim"]): c for c in uq_common.claims(per_seed, uq_common.TARGETS)}
    taylor = targets["Hydra (Taylor) beats the single model by >= 1 AUROC point"]
    assert taylor["advantage_mean"] == pytest.approx(0.02) and taylor["seeds_better"] == 3
    circuit = targets["Hydra (circuit) beats the single model by >= 1 AUROC point"]
    assert circuit["advantage_mean"] == pytest.approx(0.04)
    pruned = claims["Taylor pruning hurts calibration under shift (NLL)"]
    assert pruned["advantage_per_seed"] == pytest.approx([0.0, 0.02, -0.01])
    assert pruned["verdict"] == "holds on average (1/3 seeds)"


def test_pareto_front_and_training_steps():
    recipe = uq_common.Recipe(
        base_steps=100,
        base_lr=1e-3,
        finetune_steps=10,
        finetune_lr=1e-3,
        batch_size=8,
        warmup_steps=1,
        members=3,
    )
    steps = {row: uq_common.train_steps(row, recipe) for row in uq_common.ROWS}
    assert steps["single"] == 110 and steps["deep ensemble"] == 330
    assert steps["Hydra (Taylor)"] == steps["deep ensemble (one base)"] == 130
    assert steps["Hydra (fused deep ensemble)"] == 330 and steps["Hydra (circuit)"] == 110
    auroc = {row: 0.7 for row in uq_common.ROWS}
    auroc.update({"deep ensemble": 0.9, "Hydra (Taylor)": 0.8, "MC dropout": 0.8})
    ece = {row: 0.05 for row in uq_common.ROWS}
    latency = {row: 2.0 for row in uq_common.ROWS}
    latency.update({"single": 1.0, "deep ensemble": 3.0, "Hydra (Taylor)": 2.0})
    report = {
        "aggregate": {
            r: {"ood_mean": {"msp": {"auroc": {"mean": auroc[r]}}}, "id": {"ece": {"mean": ece[r]}}}
            for r in uq_common.ROWS
        },
        "latency": {r: {"ratio": latency[r]} for r in uq_common.ROWS},
        "parameters": {r: 1.0 for r in uq_common.ROWS},
        "train_steps": steps,
    }
    fronts = uq_common.pareto(report)
    # the cheapest at 0.7, Hydra (Taylor) at 0.8 for 2 x, the ensemble at 0.9 for 3 x; MC dropout
    # (0.8 at 2 x, a tie with Hydra) is on the front too: no row beats it on both
    assert fronts["auroc_msp vs latency_ratio"] == [
        "single",
        "Hydra (Taylor)",
        "MC dropout",
        "deep ensemble",
    ]
    assert set(fronts["ece vs latency_ratio"]) == {"single"}


def test_scrambled_digits_keep_the_values_and_lose_the_shape():
    images = np.arange(3 * 64, dtype=float).reshape(3, 8, 8)
    out = uq_digits.scrambled(images, 5, seed=0)
    assert out.shape == (5, 8, 8)
    assert np.array_equal(out, uq_digits.scrambled(images, 5, seed=0))
    for image in out:
        source = images[int(image.min()) // 64]  # values 64 i .. 64 i + 63 come from image i
        assert sorted(image.ravel()) == sorted(source.ravel()) and not np.array_equal(image, source)
        tiles = {
            tuple(image[r : r + 2, c : c + 2].ravel()) for r in (0, 2, 4, 6) for c in (0, 2, 4, 6)
        }
        assert tiles == {
            tuple(source[r : r + 2, c : c + 2].ravel()) for r in (0, 2, 4, 6) for c in (0, 2, 4, 6)
        }


def test_text_batches_trimmed_and_sorted_give_the_full_length_logits():
    from helpers.bert import tiny_bert

    backbone = tiny_bert()
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(5, 90, (9, 12)))
    mask = torch.ones_like(ids)
    for i, length in enumerate([3, 12, 5, 7, 2, 12, 9, 4, 6]):
        mask[i, length:] = 0
    x = torch.stack([ids, mask], dim=1)
    got = uq_common.member_logits(backbone, x, batch=4, text=True)
    with torch.inference_mode():
        expected = backbone(x).double().numpy()
    assert got.shape == (9, 1, expected.shape[1])
    np.testing.assert_allclose(got[:, 0], expected, atol=1e-5)


def tiny_timm_vit(seed: int, **kwargs):
    """A tiny timm ViT (8x8 grey input, 3 classes), seeded: the protocol's model in these tests."""
    import timm

    torch.manual_seed(seed)
    return load_backbone(
        timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=8,
            patch_size=4,
            in_chans=1,
            embed_dim=16,
            depth=2,
            num_heads=4,
            mlp_ratio=1.0,
            num_classes=3,
            **kwargs,
        )
    )


# --- the whole protocol, tiny --------------------------------------------------------------------
def test_main_writes_every_row_report_and_plot(tmp_path):

    rng = torch.Generator().manual_seed(0)

    def new_model(seed):
        return tiny_timm_vit(seed, proj_drop_rate=0.1)

    def data(n):
        return torch.randn(n, 1, 8, 8, generator=rng), torch.randint(0, 3, (n,), generator=rng)

    recipe = uq_common.Recipe(
        base_steps=3,
        base_lr=1e-3,
        finetune_steps=2,
        finetune_lr=1e-3,
        batch_size=8,
        warmup_steps=1,
        heads_per_member=2,
        mc_samples=3,
        taylor_examples=16,
        circuit_examples=16,
        eval_batch=16,
        latency_batch=4,
        latency_rounds=2,
    )
    train, test, noise = data(24), data(20), 3 * torch.randn(10, 1, 8, 8, generator=rng)
    description = {
        "title": "tiny",
        "summary": "a tiny run",
        "shift": "none",
        "ood": {"noise": "noise"},
        "details": {"data": "random"},
    }

    def make_task(args):
        return uq_common.Task(
            name="tiny",
            classes=list("abc"),
            train=train,
            test=test,
            shift=test,
            ood={"noise": noise},
            new_model=new_model,
            recipe=recipe,
            description=description,
            ood_validation=("blobs", torch.randn(12, 1, 8, 8, generator=rng).abs() * 2),
        )

    out = tmp_path / "report"
    argv = ["--seeds", "2", "--out", str(out), "--cache", str(tmp_path / "cache"), "--quiet"]
    assert uq_common.main(make_task, "tiny", "A tiny benchmark.", argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == list(uq_common.ROWS)
    assert set(report["aggregate"]) == set(uq_common.ROWS)
    assert len(report["aggregate"]["Hydra (Taylor)"]["id"]["accuracy"]["values"]) == 2
    assert report["parameters"]["deep ensemble"] == 3 * report["parameters"]["single"]
    assert report["latency"]["single"]["ratio"] == 1.0
    assert report["aggregate"]["Hydra (circuit)"]["members"]["mean"] == 3
    assert len(report["claims"]) == len(uq_common.CLAIMS)
    assert len(report["targets"]) == len(uq_common.TARGETS)
    assert report["parameters"]["deep ensemble (one base)"] == report["parameters"]["deep ensemble"]
    assert report["aggregate"]["Hydra (shared trunk)"]["members"]["mean"] == 3
    fused = report["per_seed"][0]["rows"]["Hydra (fused deep ensemble)"]
    assert len(fused["members_accuracy"]) == 3 and 0 <= fused["disagreement"] <= 1
    assert "disagreement" not in report["per_seed"][0]["rows"]["single"]
    assert report["per_seed"][0]["specs"]["circuit (OOD validation)"]["importance"] == "circuit"
    assert set(report["pareto"]) == {
        f"{m} vs {c}"
        for m in ("auroc_msp", "ece")
        for c in ("latency_ratio", "parameters", "train_steps")
    }
    assert isinstance(report["latency_target"]["holds"], bool)
    why = report["diagnosis"]
    ceiling = why["one_base_ceiling"]
    assert ceiling["values"] == pytest.approx(
        [
            s["rows"]["deep ensemble (one base)"]["ood_mean"]["msp"]["auroc"]
            - s["rows"]["single"]["ood_mean"]["msp"]["auroc"]
            for s in report["per_seed"]
        ]
    )
    assert ceiling["seeds_above_1_point"] == sum(v > 0.01 for v in ceiling["values"])
    assert why["best_one_base_row"] in uq_common.ONE_BASE_HYDRA
    assert why["fused"]["latency_over_deep_ensemble"] == pytest.approx(
        report["latency_target"]["ratio"]
    )
    assert why["costs"] == uq_common.cost_model(new_model(0), recipe)
    md = (out / "report.md").read_text()
    assert "## Why: the measurements behind each target" in md
    # --render re-derives the tables from the stored measurements, training nothing
    (out / "report.md").unlink()
    rendered = [*argv, "--render"]
    assert uq_common.main(make_task, "tiny", "A tiny benchmark.", rendered) == 0
    again = json.loads((out / "report.json").read_text())
    assert again.pop("rendered") and again == report
    rendered_md = (out / "report.md").read_text()
    assert "re-rendered from its measurements with `--render`" in rendered_md
    assert rendered_md.splitlines()[3:] == md.splitlines()[3:]  # all but the "Produced by" line
    assert "| Hydra (circuit, fine-tuned) |" in md and "## The paper's claims, tested" in md
    assert "## Targets" in md and "## Pareto fronts" in md and "pareto.png" in report["figures"]
    for png in report["figures"]:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the weights are cached: a rerun trains nothing and gives the same numbers
    argv_again = [*argv, "--overwrite"]
    assert uq_common.main(make_task, "tiny", "A tiny benchmark.", argv_again) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["aggregate"]["deep ensemble"]["id"] == report["aggregate"]["deep ensemble"]["id"]
    with pytest.raises(SystemExit):
        uq_common.main(make_task, "tiny", "A tiny benchmark.", argv)  # exists, no --overwrite


def test_render_refuses_a_missing_or_foreign_report(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--quiet", "--render"]
    with pytest.raises(SystemExit, match="does not exist; run the benchmark first"):
        uq_common.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(SystemExit, match="is not valid JSON"):
        uq_common.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    (tmp_path / "report.json").write_text(json.dumps({"rows": ["single"]}))
    with pytest.raises(SystemExit, match="another version of the benchmark"):
        uq_common.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    with pytest.raises(SystemExit):
        uq_common.main(lambda args: None, "tiny", "A tiny one.", [*argv, "--overwrite"])
    assert "takes neither --overwrite nor --quick" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_cost_model_equals_the_fused_models_own_count(family):
    """The analytic fused-deep-ensemble ratio equals the MACs of a model fused from M different
    members (per-member MLPs), and follows rest + (1 - rest) k / H."""
    from hydra_deploy.fusion import fuse
    from hydra_deploy.pruning import select_members

    if family == "vit":
        make = tiny_timm_vit
    else:
        from helpers.bert import tiny_bert

        def make(seed):
            torch.manual_seed(seed)
            return tiny_bert()

    recipe = uq_common.Recipe(
        base_steps=1,
        base_lr=1e-3,
        finetune_steps=1,
        finetune_lr=1e-3,
        batch_size=4,
        warmup_steps=0,
        members=3,
        heads_per_member=1,
    )
    members = [make(seed) for seed in range(3)]
    costs = uq_common.cost_model(members[0], recipe)
    heads = [
        select_members(m, 1, heads_per_member=1, method="random", seed=i).members[0]
        for i, m in enumerate(members)
    ]
    spec = uq_common.full_spec(members[0], 3).replace(members=heads, mlp_merge="grouped", meta={})
    fused = fuse(members, spec, mlp_merge="grouped")
    assert costs["fused_deep_ensemble_over_deep_ensemble"] == pytest.approx(
        fused.macs["hydra"] / fused.macs["deep_ensemble"]
    )
    rest, H = costs["non_attention_share"], costs["heads"]
    assert costs["fused_deep_ensemble_over_deep_ensemble"] == pytest.approx(rest + (1 - rest) / H)
    k = costs["max_heads_for_0.8x"]
    assert k == 0 or rest + (1 - rest) * k / H <= 0.8 < rest + (1 - rest) * (k + 1) / H


def _tiny_task(seed: int = 0):
    """A tiny ViT task (8x8, 3 classes) with an OOD validation family, for the scripts' runs."""

    rng = torch.Generator().manual_seed(seed)

    new_model = tiny_timm_vit

    def data(n):
        return torch.randn(n, 1, 8, 8, generator=rng), torch.randint(0, 3, (n,), generator=rng)

    recipe = uq_common.Recipe(
        base_steps=3,
        base_lr=1e-3,
        finetune_steps=2,
        finetune_lr=1e-3,
        batch_size=8,
        warmup_steps=1,
        heads_per_member=1,
        taylor_examples=16,
        circuit_examples=16,
        eval_batch=16,
    )
    test = data(12)
    return uq_common.Task(
        name="tiny",
        classes=list("abc"),
        train=data(30),
        test=test,
        shift=test,
        ood={"noise": 3 * torch.randn(8, 1, 8, 8, generator=rng)},
        new_model=new_model,
        recipe=recipe,
        description={},
        ood_validation=("blobs", torch.randn(10, 1, 8, 8, generator=rng).abs() * 2),
    )


def test_sweep_ranks_on_validation_only(tmp_path):
    import uq_sweep

    out = tmp_path / "sweep"
    argv = [
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "cache"),
        "--quiet",
        "--only",
        "grouped MLP",
        "circuit, OOD objective, HeadMap conditioning",
    ]
    assert uq_sweep.main(argv, task_factory=lambda args: _tiny_task()) == 0
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert {
        "base recipe",
        "grouped MLP",
        "circuit, OOD objective, HeadMap conditioning",
        "single (2 recovery steps)",
        "deep ensemble (one base, 2 steps)",
    } <= set(rows)
    assert rows["grouped MLP"]["train_steps"] == 3 + 3 * 2 and rows["grouped MLP"]["members"] == 3
    # the ranking follows the validation AUROC, among rows within 1 point of the single's accuracy
    single = rows["single (2 recovery steps)"]["val"]["accuracy"]
    eligible = [
        n
        for n, r in rows.items()
        if not r["baseline"] and r["val"]["accuracy"] >= single - uq_sweep.ACCURACY_SLACK
    ]
    assert report["ranking"] == sorted(eligible, key=lambda n: -rows[n]["val_ood"]["auroc"])
    assert report["recommended"] == (report["ranking"][0] if report["ranking"] else None)
    assert "Ranking on validation" in (out / "report.md").read_text()
    with pytest.raises(SystemExit):  # exists, no --overwrite
        uq_sweep.main(argv, task_factory=lambda args: _tiny_task())


def test_curve_trains_each_budget_and_scores_on_validation(tmp_path):
    import uq_curve

    out = tmp_path / "curve"
    argv = ["--budgets", "2", "4", "--out", str(out), "--cache", str(tmp_path / "c"), "--quiet"]
    assert uq_curve.main(argv, task_factory=lambda args: _tiny_task()) == 0
    report = json.loads((out / "report.json").read_text())
    assert [p["steps"] for p in report["points"]] == [2, 4]
    assert all(0 <= p["accuracy"] <= 1 and p["nll"] > 0 for p in report["points"])
    assert report["validation"].startswith("last 20% of the training set (6 examples)")
