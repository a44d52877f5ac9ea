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
        name="t", classes=list("abcd"), train=(None, None), test=(None, test_y),
        shift=(None, test_y), ood={"a": None, "b": None}, new_model=None, recipe=None,
    )  # fmt: skip
    sets = {"id": logits(30, 3.0), "shift": logits(30, 1.0), "ood:a": logits(20, 1.0),
            "ood:b": logits(25, 0.5)}  # fmt: skip
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
            rows[row] = {"id": {"ece": 0.1 - 0.01 * i + offset},
                         "shift": {"ece": 0.2, "nll": 1.0 + offset * (row == "single Taylor-pruned")},
                         "ood_mean": {"msp": {"auroc": 0.7 + 0.01 * i + offset,
                                              "fpr95": 0.5}}}  # fmt: skip
        return {"rows": rows}

    per_seed = [seed_rows(0.0), seed_rows(0.02), seed_rows(-0.01)]
    agg = uq_common.aggregate(per_seed)
    cell = agg["deep ensemble"]["ood_mean"]["msp"]["auroc"]
    i = uq_common.ROWS.index("deep ensemble")
    values = [0.7 + 0.01 * i + o for o in (0.0, 0.02, -0.01)]
    assert cell["values"] == pytest.approx(values)
    assert cell["std"] == pytest.approx(np.std(values, ddof=1))
    claims = {(c["claim"]): c for c in uq_common.claims(per_seed)}
    # circuit (index 4) has a lower AUROC than the ensemble (index 6) on every seed
    beat = claims["Hydra (circuit) detects OOD better than the deep ensemble"]
    assert beat["advantage_mean"] == pytest.approx(-0.02) and beat["seeds_better"] == 0
    assert beat["verdict"].startswith("does not hold")
    calib = claims["Hydra (circuit) is better calibrated than the deep ensemble"]
    assert calib["advantage_mean"] == pytest.approx(-0.02)  # ECE: lower is better
    ties = claims["Hydra (circuit) has a lower FPR95 than the deep ensemble"]
    assert ties["seeds_better"] == 0 and ties["advantage_mean"] == 0
    pruned = claims["Taylor pruning hurts calibration under shift (NLL)"]
    assert pruned["advantage_per_seed"] == pytest.approx([0.0, 0.02, -0.01])
    assert pruned["verdict"] == "holds on average (1/3 seeds)"


def test_text_batches_trimmed_and_sorted_give_the_full_length_logits():
    from test_bert import tiny_bert

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


# --- the whole protocol, tiny --------------------------------------------------------------------
def test_main_writes_every_row_report_and_plot(tmp_path):
    import timm

    rng = torch.Generator().manual_seed(0)

    def new_model(seed):
        torch.manual_seed(seed)
        return load_backbone(timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=4, in_chans=1,
            embed_dim=16, depth=2, num_heads=4, mlp_ratio=1.0, num_classes=3, proj_drop_rate=0.1,
        ))  # fmt: skip

    def data(n):
        return torch.randn(n, 1, 8, 8, generator=rng), torch.randint(0, 3, (n,), generator=rng)

    recipe = uq_common.Recipe(
        base_steps=3, base_lr=1e-3, finetune_steps=2, finetune_lr=1e-3, batch_size=8,
        warmup_steps=1, heads_per_member=2, mc_samples=3, taylor_examples=16,
        circuit_examples=16, eval_batch=16, latency_batch=4, latency_rounds=2,
    )  # fmt: skip
    train, test, noise = data(24), data(20), 3 * torch.randn(10, 1, 8, 8, generator=rng)
    description = {"title": "tiny", "summary": "a tiny run", "shift": "none",
                   "ood": {"noise": "noise"}, "details": {"data": "random"}}  # fmt: skip

    def make_task(args):
        return uq_common.Task(
            name="tiny", classes=list("abc"), train=train, test=test, shift=test,
            ood={"noise": noise}, new_model=new_model,
            recipe=recipe, description=description,
        )  # fmt: skip

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
    md = (out / "report.md").read_text()
    assert "| Hydra (circuit, fine-tuned) |" in md and "## The paper's claims, tested" in md
    for png in report["figures"]:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the weights are cached: a rerun trains nothing and gives the same numbers
    argv_again = [*argv, "--overwrite"]
    assert uq_common.main(make_task, "tiny", "A tiny benchmark.", argv_again) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["aggregate"]["deep ensemble"]["id"] == report["aggregate"]["deep ensemble"]["id"]
    with pytest.raises(SystemExit):
        uq_common.main(make_task, "tiny", "A tiny benchmark.", argv)  # exists, no --overwrite
