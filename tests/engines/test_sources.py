"""engines/sources.py: one reader of INPUT arguments and one batcher, shared by hydra-run,
hydra-score-dataset and hydra-eval."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hydra_deploy.distributed.ray_score import collect_items
from hydra_deploy.engines import load_runner
from hydra_deploy.engines.sources import (
    ARRAY,
    IMAGES,
    TEXT,
    iter_batches,
    prepare,
    read_source,
    score_inputs,
)
from hydra_deploy.errors import RunnerError
from hydra_deploy.evaluation.evaluate import load_eval_data, member_logits
from hydra_deploy.families import get_family
from hydra_deploy.uncertainty import ensemble_scores

VIT, BERT = get_family("vit"), get_family("bert")


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    (folder / "deeper").mkdir(parents=True)
    paths = []
    for index in range(count):
        path = folder / ("deeper" if index % 2 else "") / f"{index}.png"
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return sorted(paths)


class FakeTextRunner:
    """A text model's runner as the batcher sees it: counts the tokenizers it is asked for."""

    family = "bert"

    def __init__(self) -> None:
        self.encoders = 0

    def text_encoder(self):
        self.encoders += 1
        return lambda texts: {"input_ids": np.asarray([[len(t)] for t in texts], np.int64)}


def test_an_image_folder_reads_the_same_for_every_command(tiny_export, tmp_path):
    images = write_images(tmp_path / "images", 5)
    source = read_source(tmp_path / "images", VIT)
    assert source.kind == IMAGES and source.items == images
    assert source.names == [str(p) for p in images]
    labels, sources = collect_items("vit", [tmp_path / "images"])  # hydra-score-dataset
    assert labels == source.names and sources == [str(p.absolute()) for p in images]
    with load_runner(tiny_export, providers=["cpu"]) as runner:
        rows = score_inputs(runner, [tmp_path / "images"], batch_size=2)  # hydra-run
        data = load_eval_data(tmp_path / "images", runner, name="ood", labelled=False)
        assert data.images == images  # hydra-eval, an unlabelled folder
        logits = member_logits(runner, data, batch_size=2)
        whole = np.concatenate(
            [runner(batch)["member_logits"] for _, batch in iter_batches(runner, IMAGES, images, 4)]
        )
    assert [r["input"] for r in rows] == source.names
    np.testing.assert_allclose(logits, whole, rtol=0, atol=1e-5)
    expected = ensemble_scores(whole)
    assert [r["prediction"] for r in rows] == expected["prediction"].tolist()
    np.testing.assert_allclose([r["msp"] for r in rows], expected["msp"], rtol=0, atol=1e-6)


def test_text_lines_read_the_same_for_every_command(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("a cat\n\n  a dog  \nthe end\n", encoding="utf-8")
    source = read_source(path, BERT)
    assert source.kind == TEXT and source.items == ["a cat", "a dog", "the end"]
    assert source.names == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert collect_items("bert", [path]) == (source.names, source.items)


def test_batches_cover_every_row_once_and_tokenize_with_one_encoder():
    runner = FakeTextRunner()
    texts = [f"text {i}" * (i + 1) for i in range(7)]
    batches = list(iter_batches(runner, TEXT, texts, 3))
    assert [rows for rows, _ in batches] == [slice(0, 3), slice(3, 6), slice(6, 7)]
    ids = np.concatenate([inputs["input_ids"] for _, inputs in batches])
    assert ids[:, 0].tolist() == [len(t) for t in texts]
    assert runner.encoders == 1  # the tokenizer is loaded once, not per batch
    arrays = {"input_ids": np.arange(10).reshape(5, 2), "attention_mask": np.ones((5, 2))}
    chunks = [inputs for _, inputs in iter_batches(runner, ARRAY, arrays, 2)]
    assert [len(c["input_ids"]) for c in chunks] == [2, 2, 1]
    np.testing.assert_array_equal(
        np.concatenate([c["input_ids"] for c in chunks]), arrays["input_ids"]
    )
    assert prepare(runner, ARRAY, arrays) is arrays  # arrays go in as they are


@pytest.mark.parametrize(
    ("name", "family", "kwargs", "message"),
    [
        ("gone.png", VIT, {}, "input '{d}/gone.png' does not exist"),
        (
            "folder",
            BERT,
            {},
            "{d}/folder: images need a vision model; MODEL is a bert model (give .txt files)",
        ),
        (
            "folder",
            BERT,
            {"model": "EXPORT_DIR", "arrays_elsewhere": "use hydra-run"},
            "{d}/folder: images need a vision model; EXPORT_DIR is a bert model (give .txt files)",
        ),
        ("x.npy", VIT, {"arrays_elsewhere": "use hydra-run"}, "{d}/x.npy: use hydra-run"),
        (
            "t.txt",
            VIT,
            {},
            "{d}/t.txt looks like text: text inputs are for text models; MODEL is "
            "a vit model: give image files or folders",
        ),
        (
            "t.csv",
            BERT,
            {},
            "{d}/t.csv looks like text: text models read .txt files (one input per line) and "
            ".tsv files (label<TAB>text, or label<TAB>text<TAB>second text)",
        ),
        # a .tsv is read (issue 26: one reader of user data), by hydra_deploy.userdata's rules
        ("t.tsv", BERT, {}, "{d}/t.tsv line 1 has no tab; write label<TAB>text on each line"),
        (
            "w.bin",
            BERT,
            {},
            "cannot tell what '{d}/w.bin' is: give .txt files (one input per line)",
        ),
    ],
)
def test_what_the_reader_refuses(tmp_path, name, family, kwargs, message):
    write_images(tmp_path / "folder", 1)
    for file in ("x.npy", "t.txt", "t.csv", "t.tsv", "w.bin"):
        (tmp_path / file).write_text("1\n")
    with pytest.raises(RunnerError) as caught:
        read_source(tmp_path / name, family, **kwargs)
    assert str(caught.value) == message.format(d=tmp_path)
