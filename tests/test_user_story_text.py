"""The text-model user story of issue 17, through the commands only.

A BERT classifier fine-tuned with plain transformers code and saved with ``save_pretrained``
(tokenizer beside it) whose ``config.id2label`` is not in alphabetical order goes through
``hydra-export --calib ... --finetune ...``, ``hydra-run --text`` and ``hydra-eval`` on a test file
that lacks one class. The export must carry the tokenizer and the class names; hydra-run must name
the classes; hydra-eval's accuracy, NLL and ECE must equal the fused model's in plain PyTorch with
the labels mapped through the checkpoint's own ``id2label``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.text_data import ID2LABEL, KEYWORDS, VOCAB, sentences, write_tsv

from hydra_deploy.cli.eval import main as eval_main
from hydra_deploy.cli.export import main as export_main
from hydra_deploy.cli.run import main as run_main
from hydra_deploy.export import load_export
from hydra_deploy.uncertainty.metrics import ece


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny BERT trained for a few steps with plain PyTorch, saved as transformers saves it."""
    folder = tmp_path_factory.mktemp("story") / "wordnet-bert"
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        id2label=ID2LABEL,
        label2id={v: k for k, v in ID2LABEL.items()},
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    train = sentences(96, seed=0, classes=list(KEYWORDS))
    batch = tokenizer([t for _, t in train], padding=True, return_tensors="pt")
    y = torch.tensor([config.label2id[label] for label, _ in train])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(40):
        idx = torch.arange(step * 16, step * 16 + 16) % len(train)
        loss = F.cross_entropy(model(**{k: v[idx] for k, v in batch.items()}).logits, y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_text_user_story(checkpoint, tmp_path, capsys):
    os.environ["HF_HUB_OFFLINE"] = "1"
    train = sentences(64, seed=1, classes=list(KEYWORDS))
    test = sentences(30, seed=2, classes=["act", "animal", "food"])  # no "plant" (class 0)
    write_tsv(tmp_path / "train.tsv", train)
    write_tsv(tmp_path / "test.tsv", test)
    (tmp_path / "ood.txt").write_text("zebra quantum\nthe of and\nglorp\n", encoding="utf-8")
    out = tmp_path / "export"

    code = export_main(
        [
            "--backbone",
            f"hf:{checkpoint}",
            "--calib",
            str(tmp_path / "train.tsv"),
            "--finetune",
            str(tmp_path / "train.tsv"),
            "--finetune-steps",
            "30",
            "--lr",
            "1e-3",
            "--finetune-batch-size",
            "16",
            "--members",
            "2",
            "--heads-per-member",
            "2",
            "--max-batch",
            "8",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr().err
    info = json.loads((out / "hydra.json").read_text())
    assert (out / "tokenizer" / "tokenizer.json").is_file()  # issue 17: --finetune dropped it
    assert info["tokenizer"]["dir"] == "tokenizer"
    assert info["class_names"] == [ID2LABEL[i] for i in range(4)]
    assert info["validation"]["passed"]

    capsys.readouterr()
    code = run_main(
        [str(out), "--text", "a big dog", "--text", "some soup", "--top-k", "2", "--json", "-"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads(captured.out)["results"]
    for result in results:
        assert result["label"] == ID2LABEL[result["prediction"]]
        assert [e["label"] for e in result["top_k"]] == [
            ID2LABEL[e["class"]] for e in result["top_k"]
        ]
    assert [r["label"] for r in results] == ["animal", "food"]  # the model learnt its keywords

    code = eval_main(
        [
            str(out),
            "--id",
            str(tmp_path / "test.tsv"),
            "--ood",
            f"unknown={tmp_path / 'ood.txt'}",
            "--out",
            str(tmp_path / "report"),
            "--json",
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["class_names"] == info["class_names"] and report["counts"]["id"] == 30

    # the same fused model in PyTorch, labels through the checkpoint's own id2label
    hydra = load_export(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    config = transformers.AutoConfig.from_pretrained(str(checkpoint))
    label2id = {name: int(i) for i, name in config.id2label.items()}
    labels = np.array([label2id[label] for label, _ in test])
    batch = tokenizer([t for _, t in test], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hydra(*(batch[name] for name in hydra.input_names))
    probs = logits.double().softmax(-1).mean(1).numpy()
    accuracy = float((probs.argmax(1) == labels).mean())
    nll = float(-np.log(probs[np.arange(len(labels)), labels]).mean())
    got = report["id"]["classification"]
    assert accuracy > 0.5  # non-trivial: most test lines are right (and the labels matter)
    assert got["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert got["nll"] == pytest.approx(nll, abs=1e-6)
    assert got["ece"] == pytest.approx(ece(probs, labels, 15), abs=1e-6)
