"""The uncertainty benchmarks' building blocks (benchmarks/uq_*.py): data, scoring, the protocol."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import uq_decisions
import uq_digits
import uq_int8
import uq_rows
import uq_run
import uq_task
import uq_train
import uq_wordnet
from helpers.uq import tiny_protocol_task, tiny_recipe, tiny_timm_vit

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
    task = uq_task.Task(
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
    row = uq_rows.score_row(sets, task)
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
        for i, row in enumerate(uq_task.ROWS):
            rows[row] = {
                "id": {"ece": 0.1 - 0.01 * i + offset},
                "shift": {"ece": 0.2, "nll": 1.0 + offset * (row == "single Taylor-pruned")},
                "ood_mean": {"msp": {"auroc": 0.7 + 0.01 * i + offset, "fpr95": 0.5}},
            }
        return {"rows": rows}

    per_seed = [seed_rows(0.0), seed_rows(0.02), seed_rows(-0.01)]
    agg = uq_rows.aggregate(per_seed)
    cell = agg["deep ensemble"]["ood_mean"]["msp"]["auroc"]
    i = uq_task.ROWS.index("deep ensemble")
    values = [0.7 + 0.01 * i + o for o in (0.0, 0.02, -0.01)]
    assert cell["values"] == pytest.approx(values)
    assert cell["std"] == pytest.approx(np.std(values, ddof=1))
    claims = {(c["claim"]): c for c in uq_rows.claims(per_seed)}
    gap = 0.01 * (
        uq_task.ROWS.index("Hydra (circuit)") - uq_task.ROWS.index("deep ensemble (one base)")
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
    targets = {(c["claim"]): c for c in uq_rows.claims(per_seed, uq_rows.TARGETS)}
    taylor = targets["Hydra (Taylor) beats the single model by >= 1 AUROC point"]
    assert taylor["advantage_mean"] == pytest.approx(0.02) and taylor["seeds_better"] == 3
    circuit = targets["Hydra (circuit) beats the single model by >= 1 AUROC point"]
    assert circuit["advantage_mean"] == pytest.approx(0.04)
    pruned = claims["Taylor pruning hurts calibration under shift (NLL)"]
    assert pruned["advantage_per_seed"] == pytest.approx([0.0, 0.02, -0.01])
    assert pruned["verdict"] == "holds on average (1/3 seeds)"


def test_pareto_front_and_training_steps():
    recipe = uq_task.Recipe(
        base_steps=100,
        base_lr=1e-3,
        finetune_steps=10,
        finetune_lr=1e-3,
        batch_size=8,
        warmup_steps=1,
        members=3,
    )
    steps = {row: uq_train.train_steps(row, recipe) for row in uq_task.ROWS}
    assert steps["single"] == 110 and steps["deep ensemble"] == 330
    assert steps["Hydra (Taylor)"] == steps["deep ensemble (one base)"] == 130
    assert steps["Hydra (fused deep ensemble)"] == 330 and steps["Hydra (circuit)"] == 110
    auroc = {row: 0.7 for row in uq_task.ROWS}
    auroc.update({"deep ensemble": 0.9, "Hydra (Taylor)": 0.8, "MC dropout": 0.8})
    ece = {row: 0.05 for row in uq_task.ROWS}
    latency = {row: 2.0 for row in uq_task.ROWS}
    latency.update({"single": 1.0, "deep ensemble": 3.0, "Hydra (Taylor)": 2.0})
    report = {
        "aggregate": {
            r: {"ood_mean": {"msp": {"auroc": {"mean": auroc[r]}}}, "id": {"ece": {"mean": ece[r]}}}
            for r in uq_task.ROWS
        },
        "latency": {r: {"ratio": latency[r]} for r in uq_task.ROWS},
        "parameters": {r: 1.0 for r in uq_task.ROWS},
        "train_steps": steps,
    }
    fronts = uq_rows.pareto(report)
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
    got = uq_train.member_logits(backbone, x, batch=4, text=True)
    with torch.inference_mode():
        expected = backbone(x).double().numpy()
    assert got.shape == (9, 1, expected.shape[1])
    np.testing.assert_allclose(got[:, 0], expected, atol=1e-5)


# --- the whole protocol, tiny --------------------------------------------------------------------
def test_main_writes_every_row_report_and_plot(tmp_path):
    recipe = tiny_recipe()
    make_task = functools.partial(tiny_protocol_task, recipe=recipe)
    test = make_task().test
    new_model = make_task().new_model
    out = tmp_path / "report"
    argv = ["--seeds", "2", "--out", str(out), "--cache", str(tmp_path / "cache"), "--quiet"]
    assert uq_run.main(make_task, "tiny", "A tiny benchmark.", argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == list(uq_task.ROWS)
    assert set(report["aggregate"]) == set(uq_task.ROWS)
    assert len(report["aggregate"]["Hydra (Taylor)"]["id"]["accuracy"]["values"]) == 2
    assert report["parameters"]["deep ensemble"] == 3 * report["parameters"]["single"]
    assert report["latency"]["single"]["ratio"] == 1.0
    assert report["aggregate"]["Hydra (circuit)"]["members"]["mean"] == 3
    assert len(report["claims"]) == len(uq_rows.CLAIMS)
    assert len(report["targets"]) == len(uq_rows.TARGETS)
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
    assert why["best_one_base_row"] in uq_task.ONE_BASE_HYDRA
    assert why["fused"]["latency_over_deep_ensemble"] == pytest.approx(
        report["latency_target"]["ratio"]
    )
    assert why["costs"] == uq_rows.cost_model(new_model(0), recipe)
    md = (out / "report.md").read_text()
    assert "## Why: the measurements behind each target" in md
    # the decisions: every row and seed, from the stored logits; alpha 0.1 fits 10 quantile
    # examples, smaller alphas and RAPS (5 temperature examples) are refused with the reason
    stored, labels = uq_decisions.load_logits(out / "logits.npz")
    assert sorted(stored) == [0, 1] and set(stored[0]) == set(uq_task.ROWS)
    assert stored[0]["deep ensemble"]["id"].shape == (20, 3, 3)
    np.testing.assert_array_equal(labels, test[1].numpy())
    single = report["per_seed"][1]["decisions"]["single"]
    assert single["splits"] == 4 and single["sets"]["lac"]["0.1"]["available"] is True
    assert single["sets"]["lac"]["0.05"] == {
        "available": False,
        "reason": single["sets"]["lac"]["0.05"]["reason"],
    }
    assert "too few for alpha 0.05" in single["sets"]["lac"]["0.05"]["reason"]
    assert single["sets"]["raps"]["0.1"]["available"] is False
    assert single["selective"]["refused"] == 1.0 and single["selective"]["answered"] == 0.0
    assert report["decision_settings"]["tested_part"] == 5
    cell = report["decision_aggregate"]["Hydra (Taylor)"]["sets"]["aps"]["0.1"]["coverage"]
    assert cell["values"] == [
        s["decisions"]["Hydra (Taylor)"]["sets"]["aps"]["0.1"]["coverage"]
        for s in report["per_seed"]
    ]
    assert len(report["decision_claims"]) == len(uq_decisions.decision_claims(0.05))
    # the set-size targets at alpha 0.05 are not available; the answered share is (0: refused)
    verdicts = [c["verdict"] for c in report["decision_targets"]]
    assert [v.startswith("not available") for v in verdicts] == [True, False, True, False]
    assert report["seconds_decisions"] > 0 and "risk_coverage.png" in report["figures"]
    for section in (
        "## Temperature scaling: T fitted on held-out in-distribution data",
        "## Decisions: prediction sets, answer or abstain, the OOD flag (each row + T)",
        "## Validity over the 4 random splits",
        "(no guarantee holds)",
        "## Decision claims and targets, paired per seed (each row + T)",
        "## Answer or abstain at each risk and quantile part",
        "| q=10, 5%: answered | q=10, 5%: Bonferroni answered | q=10, 5%: risk | "
        "q=10, 5%: splits > target | q=10, 5%: "
        "population > target | q=10, 10%: answered",
        "| q=8, 5%: answered",
        "- LAC at alpha 0.05: ",
    ):
        assert section in md
    # the extra quantile part: its own splits, every row, the same temperature part
    extra = report["decision_extra"]["8"]
    assert extra["quantile_part"] == 8 and extra["tested_part"] == 7
    assert set(extra["aggregate"]) == set(uq_task.ROWS)
    assert set(extra["aggregate"]["single"]["selective_at"]["0.1"]) >= {"answered", "refused"}
    # --render re-derives the tables from the stored measurements, training nothing
    (out / "report.md").unlink()
    rendered = [*argv, "--render"]
    assert uq_run.main(make_task, "tiny", "A tiny benchmark.", rendered) == 0
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
    assert uq_run.main(make_task, "tiny", "A tiny benchmark.", argv_again) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["aggregate"]["deep ensemble"]["id"] == report["aggregate"]["deep ensemble"]["id"]
    with pytest.raises(SystemExit):
        uq_run.main(make_task, "tiny", "A tiny benchmark.", argv)  # exists, no --overwrite
    # --render recomputes the decisions from logits.npz: it refuses one that is not the run's
    uq_decisions.save_logits(out / "logits.npz", {0: stored[0]}, make_task(None))
    with pytest.raises(SystemExit, match="is not the file"):
        uq_run.main(make_task, "tiny", "A tiny benchmark.", rendered)
    # a test set too small for the calibration parts is refused before any training
    recipe.calibration_quantile = 15
    with pytest.raises(SystemExit, match="cannot be split"):
        uq_run.main(make_task, "tiny", "A tiny benchmark.", [*argv_again, "--out", str(tmp_path)])


def test_seeds_in_worker_processes_equal_seeds_in_one(tmp_path):
    """--workers 2 trains each seed in its own process and rebuilds seed 0 from --cache for the
    latency table: every measurement but the timings equals the one-process run's, and the rebuild
    selects nothing again (the selections are cached with the weights)."""

    def run(name, *extra):
        out = tmp_path / name
        argv = ["--seeds", "2", "--out", str(out), "--cache", str(tmp_path / name / "cache")]
        assert (
            uq_run.main(tiny_protocol_task, "tiny", "A tiny one.", [*argv, "--quiet", *extra]) == 0
        )
        return json.loads((out / "report.json").read_text()), uq_decisions.load_logits(
            out / "logits.npz"
        )

    one, (one_logits, _) = run("one")
    two, (two_logits, _) = run("two", "--workers", "2")
    for seed in (0, 1):
        for row in uq_task.ROWS:
            for split, v in one_logits[seed][row].items():
                np.testing.assert_array_equal(two_logits[seed][row][split], v)
    for a, b in zip(one["per_seed"], two["per_seed"], strict=True):
        a.pop("seconds"), b.pop("seconds")
        assert a == b
    assert one["aggregate"] == two["aggregate"] and set(two["latency"]) == set(one["latency"])
    assert two["parameters"] == one["parameters"] and two["decision_workers"] == 2
    cached = sorted(p.name for p in (tmp_path / "two" / "cache" / "seed0").glob("*.json"))
    assert cached == [
        "circuit.json",
        "circuit_base.json",
        "circuit_ood.json",
        "fused0.json",
        "fused1.json",
        "fused2.json",
        "taylor.json",
    ]


def test_cached_selection_reselects_when_a_setting_the_weights_or_the_data_change(
    tmp_path, monkeypatch
):
    from hydra_deploy.pruning import select_members

    model, path = tiny_timm_vit(0), tmp_path / "sel.json"
    data = tiny_protocol_task().train
    options = {"heads_per_member": 1, "method": "random", "data": data}
    first = uq_train.cached_selection(path, model, 3, seed=1, **options)
    assert first == select_members(model, 3, seed=1, **options)
    calls = []
    monkeypatch.setattr(
        uq_train, "select_members", lambda *a, **k: calls.append(k) or select_members(*a, **k)
    )
    assert uq_train.cached_selection(path, model, 3, seed=1, **options) == first and not calls
    other = uq_train.cached_selection(path, model, 3, seed=2, **options)
    assert len(calls) == 1 and other == select_members(model, 3, seed=2, **options)
    uq_train.cached_selection(path, tiny_timm_vit(1), 3, seed=2, **options)  # other weights
    shifted = (data[0] + 1, data[1])
    uq_train.cached_selection(path, model, 3, seed=2, **{**options, "data": shifted})
    assert len(calls) == 3
    assert uq_train.cached_selection(None, model, 3, seed=2, **options) == other  # no cache


def test_render_refuses_a_missing_or_foreign_report(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--quiet", "--render"]
    with pytest.raises(SystemExit, match="does not exist; run the benchmark first"):
        uq_run.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(SystemExit, match="is not valid JSON"):
        uq_run.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    (tmp_path / "report.json").write_text(json.dumps({"rows": ["single"]}))
    with pytest.raises(SystemExit, match="another version of the benchmark"):
        uq_run.main(lambda args: pytest.fail("no task is made"), "tiny", "A tiny one.", argv)
    with pytest.raises(SystemExit):
        uq_run.main(lambda args: None, "tiny", "A tiny one.", [*argv, "--overwrite"])
    assert "takes neither --overwrite nor --quick" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        uq_run.main(lambda args: None, "tiny", "A tiny one.", [*argv, "--workers", "0"])
    assert "--workers must be >= 1" in capsys.readouterr().err


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

    recipe = uq_task.Recipe(
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
    costs = uq_rows.cost_model(members[0], recipe)
    heads = [
        select_members(m, 1, heads_per_member=1, method="random", seed=i).members[0]
        for i, m in enumerate(members)
    ]
    spec = uq_train.full_spec(members[0], 3).replace(members=heads, mlp_merge="grouped", meta={})
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

    recipe = uq_task.Recipe(
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
    return uq_task.Task(
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


# --- decisions -----------------------------------------------------------------------------------
def _calibrated_logits(rng, n, members=3, classes=5, scale=3.0):
    """(member logits, labels): labels drawn from softmax(z), the logits ``scale`` * z per
    member (plus a little member noise): overconfident by about ``scale``."""
    z = rng.standard_normal((n, classes)) * 1.5
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    labels = (p.cumsum(1) > rng.random((n, 1))).argmax(1)
    logits = scale * (z[:, None, :] + 0.05 * rng.standard_normal((n, members, classes)))
    return logits, labels


def test_split_parts_are_disjoint_seeded_and_checked():
    recipe = uq_task.Recipe(
        1, 1e-3, 1, 1e-3, 1, 0, calibration_temperature=7, calibration_quantile=9, splits=5
    )
    parts = uq_decisions.split_parts(30, recipe, seed=2)
    assert len(parts) == 5
    for t, q, tested in parts:
        assert (len(t), len(q), len(tested)) == (7, 9, 14)
        assert sorted(np.r_[t, q, tested]) == list(range(30))
    again = uq_decisions.split_parts(30, recipe, seed=2)
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(parts, again, strict=True))
    other = uq_decisions.split_parts(30, recipe, seed=3)
    assert not all(np.array_equal(a[2], b[2]) for a, b in zip(parts, other, strict=True))
    with pytest.raises(ValueError, match="cannot be split"):
        uq_decisions.split_parts(16, recipe, seed=0)


def test_certify_equals_fit_selective():
    from hydra_deploy.decisions import fit_selective, selective_grid
    from hydra_deploy.errors import DataError

    rng = np.random.default_rng(0)
    refused = certified = 0
    for case in range(40):
        n = int(rng.integers(20, 400))
        confidence = rng.random(n)
        accuracy = rng.uniform(0.7, 1.0)
        correct = rng.random(n) < accuracy * (0.5 + confidence)  # confident: more often right
        grid = selective_grid(rng.random(int(rng.integers(5, 200))))
        start = int(rng.integers(0, len(grid)))
        got = uq_decisions.certify(confidence, correct, grid, start)
        try:
            tau, _ = fit_selective(
                confidence, correct, grid, uq_decisions.TARGET_RISK, uq_decisions.DELTA, start=start
            )
        except DataError:
            assert got is None, case
            refused += 1
        else:
            assert got == tau, case
            certified += 1
    assert refused and certified  # both ways exercised


def test_the_reported_set_methods_are_the_librarys():
    from hydra_deploy.decisions import SET_METHODS

    assert set(uq_decisions.REPORTED_SET_METHODS) <= set(SET_METHODS)


def test_decide_row_fits_t_held_out_and_measures_every_decision():
    rng = np.random.default_rng(3)
    logits, labels = _calibrated_logits(rng, 600)
    shift, _ = _calibrated_logits(rng, 200, scale=6.0)
    ood = rng.standard_normal((150, 3, 5)) * 0.5
    sets = {"id": logits, "shift": shift, "ood:noise": ood}
    recipe = uq_task.Recipe(
        1, 1e-3, 1, 1e-3, 1, 0, calibration_temperature=200, calibration_quantile=150, splits=30
    )
    out = uq_decisions.decide_row(sets, labels, uq_decisions.split_parts(600, recipe, seed=0))
    assert out["splits"] == 30
    assert out["temperature"] == pytest.approx(3.0, rel=0.25)  # the overconfidence undone
    scaled, raw = out["scaling"]["test"]["scaled"], out["scaling"]["test"]["raw"]
    assert scaled["nll"] < raw["nll"] and scaled["ece"] < raw["ece"]
    assert set(out["scaling"]["ood"]) == {"noise"}
    assert (
        out["scaling"]["ood_mean"]["scaled"]["auroc"]
        == out["scaling"]["ood"]["noise"]["scaled"]["auroc"]
    )
    # 150 quantile examples: alpha 0.01 needs 99, so every alpha is available
    for method in uq_decisions.REPORTED_SET_METHODS:
        for alpha in uq_decisions.ALPHAS:
            cell = out["sets"][method][uq_decisions.alpha_key(alpha)]
            assert cell["available"] is True
            assert cell["coverage"] >= 1 - alpha - 0.03  # marginal, over 30 splits
            assert 0 <= cell["shift_coverage"] <= 1 and cell["ood_mean_size"]["noise"] >= 0
    lac = out["sets"]["lac"]
    assert lac["0.01"]["mean_size"] > lac["0.1"]["mean_size"]
    assert out["sets"]["aps"]["0.1"]["empty"] == 0.0  # APS sets hold the top class
    assert "lam" in out["sets"]["raps"]["0.1"] and "k_reg" in out["sets"]["raps"]["0.1"]
    sel = out["selective"]
    assert 0 <= sel["answered"] <= 1 and 0 <= sel["exceeds"] <= 1
    # the guarantee against a known population (quantile parts drawn from it with replacement):
    # over 30 splits, far from every one fails
    assert 0 <= sel["population_exceeds"] <= 0.3
    other = out["selective_at"]["0.1"]
    assert other["answered"] >= sel["answered"]  # a looser risk answers at least as much
    assert set(other) >= {"answered", "risk", "exceeds", "refused", "population_exceeds"}
    assert len(sel["curve"]) == len(uq_decisions.CURVE_COVERAGE)
    assert sel["ood_answered"]["noise"] <= sel["answered"] + 1e-9  # noise is less confident
    flag = out["ood_flag"]
    assert flag["test"] <= 0.15 and flag["ood"]["noise"] > flag["test"]
    # too few quantile examples for small alphas: not available, with the reason
    small = uq_task.Recipe(
        1, 1e-3, 1, 1e-3, 1, 0, calibration_temperature=100, calibration_quantile=30, splits=3
    )
    few = uq_decisions.decide_row(sets, labels, uq_decisions.split_parts(600, small, seed=0))
    assert few["sets"]["lac"]["0.01"]["available"] is False
    assert "needs at least 99" in few["sets"]["lac"]["0.01"]["reason"]
    assert few["sets"]["lac"]["0.05"]["available"] is True


def test_decisions_in_processes_equal_in_process_and_logits_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    logits, labels = _calibrated_logits(rng, 60, classes=3)
    every = {
        seed: {
            row: {
                "id": logits + 0.1 * i,
                "shift": logits[:20],
                "ood:a": rng.standard_normal((10, 3, 3)),
            }
            for i, row in enumerate(uq_task.ROWS)
        }
        for seed in (0, 1)
    }
    test = (torch.zeros(60), torch.as_tensor(labels))
    task = uq_task.Task("t", list("abc"), (None, None), test, (None, test[1][:20]), {}, None, None)
    uq_decisions.save_logits(tmp_path / "logits.npz", every, task)
    stored, stored_labels = uq_decisions.load_logits(tmp_path / "logits.npz")
    np.testing.assert_array_equal(stored_labels, labels)
    np.testing.assert_allclose(stored[1]["single"]["id"], logits, atol=2e-2)  # float16
    assert stored[1]["single"]["id"].dtype == np.float64
    recipe = uq_task.Recipe(
        1, 1e-3, 1, 1e-3, 1, 0, calibration_temperature=20, calibration_quantile=20, splits=3
    )
    one = uq_decisions.decisions(stored, stored_labels, recipe)
    assert one == uq_decisions.decisions(stored, stored_labels, recipe, workers=2)
    assert set(one) == {0, 1} and set(one[0]) == set(uq_task.ROWS)


def test_decision_claims_hold_only_on_every_seed():
    def seed(single, hydra, fused, de):
        def row(size, answered):
            return {
                "sets": {"lac": {"0.02": {"mean_size": size}}},
                "selective": {"answered": answered},
            }

        rows = {
            "single": row(*single),
            "Hydra (Taylor)": row(*hydra),
            "Hydra (fused deep ensemble)": row(*fused),
            "deep ensemble": row(*de),
        }
        return {"decisions": rows}

    per_seed = [
        seed((1.5, 0.6), (1.3, 0.7), (1.22, 0.79), (1.2, 0.8)),
        seed((1.5, 0.6), (1.6, 0.7), (1.25, 0.76), (1.2, 0.8)),
    ]
    targets = {
        c["row"] + " " + c["metric"]: c
        for c in uq_rows.claims(
            per_seed, uq_decisions.decision_targets(0.02), key="decisions", strict=True
        )
    }
    size = targets["Hydra (Taylor) sets.lac.0.02.mean_size"]
    assert size["advantage_per_seed"] == pytest.approx([0.2, -0.1])
    assert size["verdict"] == "does not hold (1/2 seeds)"  # holds on average, not on every seed
    assert targets["Hydra (Taylor) selective.answered"]["verdict"] == "holds (every seed)"
    fused = targets["Hydra (fused deep ensemble) sets.lac.0.02.mean_size"]
    assert fused["advantage_per_seed"] == pytest.approx([-0.02, -0.05])
    assert fused["verdict"] == "does not hold (1/2 seeds)"  # 0.05 larger on seed 1
    assert targets["Hydra (fused deep ensemble) selective.answered"]["verdict"] == (
        "does not hold (1/2 seeds)"
    )
    missing = uq_rows.claims(
        per_seed, uq_decisions.decision_targets(0.05), key="decisions", strict=True
    )
    assert missing[0]["verdict"].startswith("not available")


# --- INT8 drift (benchmarks/uq_int8.py) -------------------------------------------------------------
def test_int8_drift_of_an_unquantized_copy_is_zero(tmp_path, monkeypatch):
    """uq_int8 on the tiny task, one seed, static: with quantize_export replaced by a copy of the
    FP32 file, every metric, the logits and the refitted decisions drift by exactly 0; static is
    calibrated on the training set; the rows are rebuilt from the cache, and their FP32 ONNX
    logits are the PyTorch protocol's; the report holds every row, the target per Hydra row and
    its sections."""
    import shutil

    calls = []

    def copy(fp32, out, *, method, calibration=None, calibrate_method="minmax"):
        calls.append((method, calibration))
        shutil.copyfile(fp32, out)
        return {"method": method, "quantized_ops": {"MatMul": 0}, "kept_float": {}}

    rows = ("single", "Hydra (Taylor)", "deep ensemble")
    monkeypatch.setattr(uq_int8, "quantize_export", copy)
    monkeypatch.setitem(uq_int8.TASKS, "tiny", tiny_protocol_task)
    monkeypatch.setitem(uq_int8.ROW_GROUPS, "all", rows)
    task, out, cache = tiny_protocol_task(), tmp_path / "out", tmp_path / "cache"
    # the uq benchmark's part: train into the cache (said), store the PyTorch member logits
    models, rebuilt = uq_int8.rebuild(task, 0, cache, quiet=True)
    assert len(rebuilt["trained_here"]) == 21  # every member of every row: an empty cache
    torch_logits = uq_train.evaluate_rows(task, {r: models[r] for r in rows}, 0)
    reference = tmp_path / "logits.npz"
    uq_decisions.save_logits(reference, {0: {r: torch_logits[r] for r in rows}}, task)
    argv = ["--task", "tiny", "--seeds", "1", "--methods", "static", "--cache", str(cache)]
    argv += ["--out", str(out), "--work", str(tmp_path), "--reference", str(reference)]
    assert uq_int8.main([*argv, "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    # one file per model: the single model is the deep ensemble's member 0 (measured once);
    # static calibrates on the training inputs (all 24: fewer than CALIBRATION_EXAMPLES)
    assert [method for method, _ in calls] == ["static"] * 4
    for _, calibration in calls:
        np.testing.assert_array_equal(calibration["pixel_values"], task.train[0].numpy())
    seed = report["per_seed"][0]
    assert seed["seed"] == 0 and list(seed["rows"]) == list(rows)
    assert seed["rebuilt"]["trained_here"] == []  # everything from the cache
    for row in rows:
        entry = seed["rows"][row]
        int8 = entry["int8"]["static"]
        assert int8["metrics"]["accuracy"]["fp32"] == entry["fp32"]["scores"]["id"]["accuracy"]
        assert all(cell["delta"] == 0.0 for cell in int8["metrics"].values())
        assert int8["logits"]["max_abs"] == 0.0 and int8["logits"]["prediction_agreement"] == 1.0
        assert int8["size_ratio"] == 1.0 and int8["scores"] == entry["fp32"]["scores"]
        assert entry["decisions"]["static"] == entry["decisions"]["fp32"]
        assert entry["decisions"]["fp32"]["temperature"] > 0
        # FP32 ONNX = PyTorch: the stored float16 logits, and the scores
        assert entry["fp32_vs_uq_report"] < 1e-2
        expected = uq_rows.score_row(torch_logits[row], task)
        assert entry["fp32"]["scores"]["id"]["accuracy"] == expected["id"]["accuracy"]
        assert entry["fp32"]["scores"]["ood_mean"]["msp"]["auroc"] == pytest.approx(
            expected["ood_mean"]["msp"]["auroc"], abs=1e-6
        )
    assert report["reference"] == str(reference)
    assert seed["rows"]["deep ensemble"]["members"] == 3
    assert seed["rows"]["deep ensemble"]["model_files"] == 3
    assert "auroc_mi" in seed["rows"]["Hydra (Taylor)"]["int8"]["static"]["metrics"]
    assert "auroc_mi" not in seed["rows"]["single"]["int8"]["static"]["metrics"]
    (target,) = report["targets"]
    assert target["row"] == "Hydra (Taylor)" and target["holds"] is True
    assert target["worst_margin"] == pytest.approx(uq_int8.TARGET_POINTS)
    agg = report["aggregate"]["static"]["Hydra (Taylor)"]
    assert agg["metrics"]["auroc_msp"]["delta"]["values"] == [0.0]
    md = (out / "report.md").read_text()
    for section in (
        "## Issue 27's target: Hydra rows within 0.5 points of FP32, every seed",
        "## Drift per row: static INT8 against FP32",
        "## Per seed",
        "## Decisions refitted on the INT8 logits",
        "## What was quantized (seed 0's files)",
        "| static | Hydra (Taylor) | +0.00 | +0.00 | +0.50 | holds on every seed |",
        "- static: 1 of 1 Hydra rows hold the target on every seed.",
        "the rows are the uq report's",
    ):
        assert section in md
    with pytest.raises(SystemExit):
        uq_int8.main(argv)  # the report exists, no --overwrite


def test_int8_drift_of_a_real_dynamic_quantization(tmp_path):
    """The same path with ONNX Runtime's dynamic quantization: the INT8 file runs, its matrix
    products are on int8 and its logits move, by little."""
    task = tiny_protocol_task()
    hydra = uq_int8.as_hydra(tiny_timm_vit(0))
    assert hydra.num_members == 1
    measured = uq_int8.measure_model(
        hydra,
        tmp_path / "model",
        uq_int8.evaluation_sets(task),
        methods=["dynamic"],
        calibration=task.train[0],
        batch=16,
        text=False,
        threads=1,
    )
    assert not (tmp_path / "model").exists()  # the files are removed
    fp32, int8 = measured["fp32"], measured["dynamic"]
    assert int8["quantization"]["quantized_ops"]["MatMul"] > 0
    assert fp32["logits"]["id"].shape == int8["logits"]["id"].shape == (20, 1, 3)
    change = uq_int8.logit_change(fp32["logits"], int8["logits"])
    assert 0 < change["max_abs"] < 0.5
