"""The one reader of user data (hydra_deploy.userdata): its formats and errors, and a
three-column ``.tsv`` of sentence pairs read alike by every consumer: fine-tuning and head selection
(``load_data`` / ``load_inputs``), ``hydra-eval``, ``hydra-calibrate``, ``hydra-run`` and the Ray
scorer of ``hydra-score-dataset`` (issue 26, item 4)."""

from __future__ import annotations

import contextlib
import hashlib
import io

import numpy as np
import pytest
import transformers
from helpers.bert import tiny_bert
from helpers.members import random_spec

from hydra_deploy.errors import DataError, HydraError, RunnerError
from hydra_deploy.userdata import (
    class_folders,
    find_images,
    labelled_images,
    read_text_file,
    text_items,
)

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 100)]


# --- the reader on its own ----------------------------------------------------------------------


def test_a_tsv_of_pairs_and_of_single_texts(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("1\tw7 w8\tw9\n\n  \nyes \t w10 \tw11 w12\n", encoding="utf-8")
    table = read_text_file(path)
    assert (table.texts, table.pairs, table.labels) == (
        ["w7 w8", "w10"],
        ["w9", "w11 w12"],
        ["1", "yes"],
    )
    assert table.lines == [1, 4] and len(table) == 2
    assert table.items == [("w7 w8", "w9"), ("w10", "w11 w12")]
    single = tmp_path / "single.tsv"
    single.write_text("0\tw7\n1\tw8\n")
    table = read_text_file(single)
    assert table.pairs is None and table.items == ["w7", "w8"] and table.labels == ["0", "1"]
    text = tmp_path / "lines.txt"
    text.write_text(" first line \n\nsecond\tline\n")  # a .txt keeps its tabs inside the text
    table = read_text_file(text)
    assert (table.texts, table.pairs, table.labels) == (["first line", "second\tline"], None, None)
    assert read_text_file(single, tsv=False).texts == ["0\tw7", "1\tw8"]
    assert text_items(["a"], None) == ["a"] and text_items(["a"], ["b"]) == [("a", "b")]


def test_the_labels_of_a_tsv_map_through_the_one_rule(tmp_path):
    path = tmp_path / "names.tsv"
    path.write_text("noun\ta dog\n\nadj\tred\n")
    assert read_text_file(path).label_indices(["verb", "noun", "adj"], 3, name="ID") == (
        [1, 2],
        ["verb", "noun", "adj"],
    )
    with pytest.raises(DataError, match=r"line 3: label 'adj' is not one of the model's classes"):
        read_text_file(path).label_indices(["verb", "noun"], 2, name="ID")
    (tmp_path / "t.txt").write_text("a dog\n")
    with pytest.raises(DataError, match=r"t.txt holds no labels; labelled text is a .tsv file"):
        read_text_file(tmp_path / "t.txt").label_indices(None, 2, name="ID data")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "0\tw5\nw6 without a label\n",
            "ID: {p} line 2 has no tab; write label<TAB>text on each line",
        ),
        (
            "0\tw5\n1\tw6\tw7\n",
            "ID: {p} mixes lines with one text and with a text pair (two tabs); use one form "
            "on every line",
        ),
        ("\n \n", "ID: {p} holds no text lines (every line is empty)"),
    ],
)
def test_what_the_reader_refuses(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(RunnerError) as caught:
        read_text_file(path, name="ID", error=RunnerError)
    assert str(caught.value) == message.format(p=path)
    with pytest.raises(DataError, match="cannot read text from"):
        read_text_file(tmp_path / "missing.tsv")


def test_image_folders(tmp_path):
    for cls, count in (("cat", 2), ("ant", 1)):
        (tmp_path / "root" / cls).mkdir(parents=True)
        for i in range(count):
            (tmp_path / "root" / cls / f"{i}.png").write_bytes(b"")
    (tmp_path / "root" / "cat" / "notes.md").write_text("not an image")
    images, owners, classes = labelled_images(tmp_path / "root", name="ID")
    assert classes == ["ant", "cat"] and owners == ["ant", "cat", "cat"]
    assert [p.relative_to(tmp_path / "root").as_posix() for p in images] == [
        "ant/0.png",
        "cat/0.png",
        "cat/1.png",
    ]
    assert find_images([tmp_path / "root"]) == sorted(images)
    (tmp_path / "flat").mkdir()
    with pytest.raises(HydraError, match="has no class sub-folders; put each class's images"):
        class_folders(tmp_path / "flat", name="ID")
    with pytest.raises(RunnerError, match="holds no images"):
        find_images([tmp_path / "flat"])


# --- one .tsv of sentence pairs through every consumer ------------------------------------------


@pytest.fixture(scope="module")
def pair_export(tmp_path_factory):
    """A tiny two-segment BERT (5 classes) with a BERT tokenizer of VOCAB, exported; and a
    three-column .tsv (label, text, second text); returns (backbone, export folder, tsv, triples)."""
    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse

    root = tmp_path_factory.mktemp("pairs")
    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    tokenizer.save_pretrained(str(root / "tokenizer"))
    backbone = load_backbone(tiny_bert("segments").module, tokenizer_dir=str(root / "tokenizer"))
    hydra = fuse(backbone, random_spec(backbone, members=2, heads_per_member=2, seed=0))
    hydra.tokenizer_dir = str(root / "tokenizer")
    export = root / "export"
    export_onnx(hydra, export, batch=(1, 4, 8), validate=False)
    rng = np.random.default_rng(0)

    def words() -> str:
        return " ".join(f"w{int(i)}" for i in rng.integers(5, 100, int(rng.integers(1, 6))))

    triples = [(words(), words(), int(rng.integers(0, 5))) for _ in range(80)]
    tsv = root / "pairs.tsv"
    lines = [f"{label}\t{text}\t{pair}\n" for text, pair, label in triples]
    lines.insert(3, "\n")  # a blank line is skipped everywhere
    tsv.write_text("".join(lines), encoding="utf-8")
    return backbone, export, tsv, triples


def _tokens(backbone, triples):
    """What the checkpoint's own tokenizer makes of the pairs (transformers), stacked [N, 3, L]."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(backbone.tokenizer_dir)
    encoded = tokenizer(
        [t for t, _, _ in triples],
        [p for _, p, _ in triples],
        padding="longest",
        truncation=True,
        max_length=backbone.seq_len,
        return_tensors="np",
    )
    return np.stack(
        [encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]], axis=1
    )


def test_a_tsv_of_sentence_pairs_reads_alike_everywhere(pair_export, tmp_path):
    import shutil

    from hydra_deploy.cli.calibrate import main as calibrate_main
    from hydra_deploy.distributed.ray_score import collect_items, plan_shards
    from hydra_deploy.distributed.ray_score.actors import HydraScorer
    from hydra_deploy.distributed.ray_score.run import shard_columns
    from hydra_deploy.distributed.ray_score.shards import batch_items
    from hydra_deploy.engines import load_runner
    from hydra_deploy.engines.sources import (
        TEXT,
        iter_batches,
        model_family,
        read_source,
        score_inputs,
    )
    from hydra_deploy.evaluation.calibrate import data_sha256
    from hydra_deploy.evaluation.evaluate import EvalData, load_eval_data, member_logits
    from hydra_deploy.export_folder import read_info
    from hydra_deploy.pruning import load_data, load_inputs
    from hydra_deploy.uncertainty import ensemble_scores

    backbone, export, tsv, triples = pair_export
    pairs = [(t, p) for t, p, _ in triples]
    labels = [y for _, _, y in triples]
    expected_tokens = _tokens(backbone, triples)
    assert (expected_tokens[:, 2] == 1).any()  # the second texts are segment 1

    # fine-tuning and head selection: load_data (labelled) and load_inputs (OOD sets)
    data = load_data(tsv, backbone)
    x, y = data.dataset.tensors
    np.testing.assert_array_equal(x.numpy(), expected_tokens)
    assert y.tolist() == labels
    np.testing.assert_array_equal(load_inputs(tsv, backbone).numpy(), expected_tokens)

    # hydra-eval (ID and OOD) and hydra-calibrate read through load_eval_data
    runner = load_runner(export)
    id_data = load_eval_data(tsv, runner, name="ID data", labelled=True)
    assert list(zip(id_data.texts, id_data.pairs, id_data.labels.tolist(), strict=True)) == triples
    ood = load_eval_data(tsv, runner, name="OOD set 'o'", labelled=False)
    assert list(zip(ood.texts, ood.pairs, strict=True)) == pairs and ood.labels is None
    (batch,) = id_data.batches(runner, len(triples))  # the export's tokenizer, no torch
    for channel, key in enumerate(("input_ids", "attention_mask", "token_type_ids")):
        np.testing.assert_array_equal(batch[key], expected_tokens[:, channel])
    logits = member_logits(runner, id_data)
    probs = ensemble_scores(logits)["probs"]

    calibrated = tmp_path / "calibrated"
    shutil.copytree(export, calibrated)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = calibrate_main([str(calibrated), "--data", str(tsv), "--alpha", "0.2", "--quiet"])
    assert code == 0
    read = EvalData("--data", str(tsv), "text", len(triples), texts=[t for t, _ in pairs])
    read.pairs, read.labels = [p for _, p in pairs], np.asarray(labels, np.int64)
    assert read_info(calibrated).decisions.data_sha256 == data_sha256(read)
    read.pairs = None  # the hash sees the second texts
    assert read_info(calibrated).decisions.data_sha256 != data_sha256(read)

    # hydra-run: the labels are not read; the pairs are scored as pairs
    source = read_source(tsv, model_family(runner), runner=runner)
    assert source.kind == TEXT and source.items == pairs
    assert source.names == [f"{tsv}:{i}" for i in range(1, len(pairs) + 1)]
    chunks = [inputs for _, inputs in iter_batches(runner, TEXT, source.items, len(pairs))]
    np.testing.assert_array_equal(chunks[0]["token_type_ids"], expected_tokens[:, 2])
    results = score_inputs(runner, [tsv], batch_size=8, decisions=False)
    assert [r["prediction"] for r in results] == probs.argmax(1).tolist()

    # hydra-score-dataset: the driver's items, the table the actors get, the actors' scores
    names, sources = collect_items("bert", [tsv])
    assert (names, sources) == (source.names, pairs)
    shards = plan_shards(names, sources, 32)
    scorer = HydraScorer(str(export), "text", batch_size=8)
    for shard, columns in zip(shards, shard_columns(shards), strict=True):
        batch = {name: column.to_numpy(zero_copy_only=False) for name, column in columns.items()}
        assert batch_items(batch) == list(shard.sources)
        scored = scorer(batch)
        rows = slice(32 * shard.index, 32 * shard.index + len(shard.sources))
        np.testing.assert_allclose(scored["probs"], probs[rows], atol=1e-5)


def test_the_ray_table_mixes_texts_and_pairs(tmp_path):
    from hydra_deploy.distributed.ray_score import plan_shards
    from hydra_deploy.distributed.ray_score.run import shard_columns
    from hydra_deploy.distributed.ray_score.shards import _digest, batch_items

    labels = ["a.txt:1", "b.tsv:1", "b.tsv:2"]
    sources = ["one text", ("first", "second"), ("third", "fourth")]
    shards = plan_shards(labels, sources, 1)
    tables = shard_columns(shards)
    assert all(set(t) == {"shard", "index", "source", "pair"} for t in tables)  # one schema
    batches = [{k: v.to_numpy(zero_copy_only=False) for k, v in t.items()} for t in tables]
    assert [item for b in batches for item in batch_items(b)] == sources
    texts_only = shard_columns(plan_shards(labels[:1], sources[:1], 1))
    assert set(texts_only[0]) == {"shard", "index", "source"}
    # a run of single texts hashes its items as before (label<TAB>text per line)
    assert _digest(["a"], ["one text"]) == hashlib.sha256(b"a\tone text\n").hexdigest()
    assert _digest(["b"], [("x", "y")]) != _digest(["b"], ["x"])
