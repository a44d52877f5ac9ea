"""The OpenCLIP family: zero-shot classifier, head gates, fused == members, selection, errors.

Everything runs on tiny random OpenCLIP models (no weights are reachable offline) whose weights
are scrambled so every head matters; one slow test builds ViT-B-32 by name with random weights.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re

import numpy as np
import open_clip
import pytest
import torch
from helpers.members import specs
from helpers.openclip import (
    CLASSES,
    TEMPLATES,
    TEXT_CFG,
    TINY_CLIP,
    member_copy,
    tiny_adapter,
    tiny_clip,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.backbones import load_backbone
from hydra_deploy.backbones.openclip import (
    DEFAULT_TEMPLATES,
    GatedMultiheadAttention,
    OpenClipAdapter,
    ZeroShotClassifier,
    load_openclip,
    rebuild_openclip,
    wrap_openclip,
)
from hydra_deploy.errors import (
    BackboneError,
    CheckpointError,
    FusionError,
    UnsupportedModelError,
)
from hydra_deploy.fusion import fuse
from hydra_deploy.pruning import select_members
from hydra_deploy.specs import HydraSpec

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny_clips() -> dict:
    return {name: tiny_adapter(name) for name in TINY_CLIP}


def assert_members_match(hydra, references, spec, x, atol=ATOL):
    with torch.no_grad():
        fused = hydra(x)
        assert fused.shape == (x.shape[0], spec.num_members, references[0].num_classes)
        for m in range(spec.num_members):
            expected = references[m](x, spec.head_mask(m))
            error = (fused[:, m] - expected).abs().max().item()
            assert error <= atol, f"member {m}: max abs error {error:.2e} > {atol:.0e}"


# --- the zero-shot classifier --------------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_CLIP))
def test_classifier_equals_open_clip_zero_shot(tiny_clips, config):
    backbone, reference = tiny_clips[config]
    assert backbone.family == "openclip" and backbone.num_classes == len(CLASSES)
    assert backbone.class_names == CLASSES and backbone.templates == TEMPLATES
    weights = backbone.module.class_weights
    torch.testing.assert_close(weights.norm(dim=-1), torch.ones(len(CLASSES)))
    tokenizer = open_clip.SimpleTokenizer(context_length=TEXT_CFG["context_length"])
    templates = [t.replace("{c}", "{}") for t in TEMPLATES]
    expected = open_clip.build_zero_shot_classifier(reference, tokenizer, CLASSES, templates)
    torch.testing.assert_close(weights, expected.T, atol=1e-6, rtol=1e-5)
    # logits: open_clip's own CLIP forward (untouched nn.MultiheadAttention) on the class prompts
    x = backbone.example_inputs(4, seed=3)
    with torch.no_grad():
        image_features = reference.encode_image(x, normalize=True)
        expected_logits = reference.logit_scale.exp() * image_features @ expected
        if reference.logit_bias is not None:
            expected_logits = expected_logits + reference.logit_bias
        torch.testing.assert_close(backbone(x), expected_logits, atol=ATOL, rtol=0)
        # embed / run_layers / classify (circuit search) compose to the forward
        hidden = backbone.embed(x)
        hidden = backbone.run_layers(backbone.run_layers(hidden, 0, 1), 1, backbone.num_layers)
        torch.testing.assert_close(backbone.classify(hidden), backbone(x), atol=ATOL, rtol=0)
    assert backbone(x).abs().max() > 0.5  # the classes are told apart (a test that can fail)


def test_templates_and_classes_from_files(tmp_path):
    (tmp_path / "names.txt").write_text("cat\n\n  dog \ncar\n")
    (tmp_path / "templates.txt").write_text("a photo of a {}.\nart of the {}.\n")
    clip = tiny_clip("tok")
    backbone = wrap_openclip(
        clip, classes=tmp_path / "names.txt", templates=str(tmp_path / "templates.txt")
    )
    assert backbone.class_names == ["cat", "dog", "car"]
    assert backbone.templates == ["a photo of a {}.", "art of the {}."]
    default = wrap_openclip(tiny_clip("tok"), classes=["cat"])
    assert default.templates == list(DEFAULT_TEMPLATES)


# --- head gates ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_CLIP))
def test_gates_ones_identity_zeros_equal_zeroed_value_rows(tiny_clips, config):
    backbone, _ = tiny_clips[config]
    L, H, hd, D = backbone.num_layers, backbone.num_heads, backbone.head_dim, backbone.embed_dim
    assert all(
        isinstance(b.attn, GatedMultiheadAttention) for b in backbone.visual.transformer.resblocks
    )
    x = backbone.example_inputs(3, seed=5)
    mask = torch.ones(L, H)
    mask[0, 1] = mask[-1, 0] = mask[-1, 2] = 0.0
    with torch.no_grad():
        plain = backbone(x)
        assert torch.equal(backbone(x, torch.ones(L, H)), plain)
        gated = backbone(x, mask)
        assert (gated - plain).abs().max() > 1e-3  # switching heads off changes the logits
        zeroed = copy.deepcopy(backbone.module)  # the same heads' value rows set to zero instead
        for layer, head in (mask == 0).nonzero().tolist():
            attn = zeroed.visual.transformer.resblocks[layer].attn
            rows = slice(2 * D + head * hd, 2 * D + (head + 1) * hd)
            attn.in_proj_weight[rows] = 0.0
            attn.in_proj_bias[rows] = 0.0
        torch.testing.assert_close(zeroed(x), gated, atol=ATOL, rtol=0)
        # per-example gates [B, L, H]: row b is gated by its own mask
        masks = torch.stack([torch.ones(L, H), mask, 1.0 - mask])
        per_example = backbone(x, masks)
        for b in range(3):
            expected = backbone(x[b : b + 1], masks[b])
            torch.testing.assert_close(per_example[b : b + 1], expected, atol=ATOL, rtol=0)


def test_gate_gradients_and_attention_weights(tiny_clips):
    backbone, _ = tiny_clips["tok"]
    x = backbone.example_inputs(2, seed=1)
    gates = torch.ones(backbone.num_layers, backbone.num_heads, requires_grad=True)
    with backbone.head_gates(gates):
        backbone.module(x).logsumexp(-1).sum().backward()
    assert gates.grad is not None and bool((gates.grad != 0).all())
    # canonical layout: rebuild layer 1's attention from AttentionWeights by hand
    weights = backbone.attention_weights(1)
    H, hd = backbone.num_heads, backbone.head_dim
    assert weights.q.shape == (H, hd, backbone.embed_dim)
    assert weights.proj.shape == (backbone.embed_dim, H, hd)
    block = backbone.visual.transformer.resblocks[1]
    with torch.no_grad():
        h = block.ln_1(backbone.embed(x))  # [B, N, D]
        q, k, v = (
            torch.einsum("hed,bnd->bhne", w, h) + b[None, :, None, :]
            for w, b in (
                (weights.q, weights.q_bias),
                (weights.k, weights.k_bias),
                (weights.v, weights.v_bias),
            )
        )
        heads = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
        out = torch.einsum("dhe,bhne->bnd", weights.proj, heads) + weights.proj_bias
        torch.testing.assert_close(block.attn(h, h, h)[0], out, atol=ATOL, rtol=0)


def test_state_dict_keys_unchanged_by_gates():
    clip = tiny_clip("tok")
    keys = list(clip.state_dict())
    backbone = wrap_openclip(clip, classes=CLASSES)
    assert list(clip.state_dict()) == keys  # checkpoints still load into fresh open_clip models
    own = backbone.module.state_dict()
    assert {"class_weights", "logit_scale"} <= set(own) and "logit_bias" not in own
    assert [k for k in own if k.startswith("visual.")] == [
        k for k in keys if k.startswith("visual.")
    ]
    fresh = open_clip.CLIP(embed_dim=16, vision_cfg=TINY_CLIP["tok"], text_cfg=TEXT_CFG)
    fresh.load_state_dict(clip.state_dict())


# --- fused == members ------------------------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_CLIP))
@given(data=st.data(), merge=st.sampled_from(["average", "grouped"]))
def test_fused_equals_masked_backbone(tiny_clips, config, data, merge):
    backbone, _ = tiny_clips[config]
    spec = data.draw(specs(backbone))
    hydra = fuse(backbone, spec, merge)
    assert hydra.family == "openclip" and hydra.num_classes == len(CLASSES)
    x = backbone.example_inputs(3, seed=data.draw(st.integers(0, 1000)))
    assert_members_match(hydra, [backbone] * spec.num_members, spec, x)


@pytest.mark.parametrize("config", sorted(TINY_CLIP))
@settings(max_examples=8)
@given(data=st.data())
def test_grouped_equals_finetuned_members(tiny_clips, config, data):
    backbone, _ = tiny_clips[config]
    spec = data.draw(specs(backbone, max_members=3))
    seed = data.draw(st.integers(0, 99))
    members = [member_copy(backbone, seed * 10 + m) for m in range(spec.num_members)]
    hydra = fuse(members, spec, "grouped")
    assert_members_match(hydra, members, spec, backbone.example_inputs(2, seed=1))
    if spec.num_members > 1:
        assert hydra.merge["projection"] == "per-member" and hydra.trunk_layers == 0
        assert hydra.merge["embeddings"] == "per-member" and hydra.merge["mlp"] == "grouped"


@settings(max_examples=8)
@given(data=st.data())
def test_average_equals_members_with_mean_mlp(tiny_clips, data):
    backbone, _ = tiny_clips["avg_ls_quickgelu"]
    spec = data.draw(specs(backbone, max_members=3))
    members = [member_copy(backbone, 50 + m) for m in range(spec.num_members)]
    hydra = fuse(members, spec, "average")
    averaged = []
    for member in members:
        module = copy.deepcopy(member.module)
        for layer, block in enumerate(module.visual.transformer.resblocks):
            for name, param in block.mlp.named_parameters():
                stack = [
                    m.visual.transformer.resblocks[layer].mlp.get_parameter(name) for m in members
                ]
                with torch.no_grad():
                    param.copy_(torch.stack(stack).mean(0))
        averaged.append(OpenClipAdapter(module, name=backbone.name))
    assert_members_match(hydra, averaged, spec, backbone.example_inputs(2, seed=4))


def test_fused_attributes_shared_trunk_and_rebuild(tiny_clips):
    backbone, _ = tiny_clips["tok"]
    L = backbone.num_layers
    heads = [[[0, 1, 2, 3]] + [[0, 2]] * (L - 1), [[0, 1, 2, 3]] + [[1, 3]] * (L - 1)]
    spec = HydraSpec(backbone.name, L, 4, backbone.head_dim, [{"heads": h} for h in heads])
    hydra = fuse(backbone, spec)
    assert hydra.trunk_layers == 1 and hydra.input_names == ("pixel_values",)
    assert hydra.class_names == CLASSES and hydra.num_members == 2
    assert hydra.macs["single"] < hydra.macs["hydra"] < hydra.macs["deep_ensemble"]
    config = hydra.preprocessing
    assert config["input_size"] == (3, 32, 32) and config["crop_pct"] == 1.0
    assert config["interpolation"] == "bicubic" and config["crop_mode"] == "center"
    x = hydra.example_inputs(3, seed=2)
    assert x.shape == (3, 3, 32, 32)
    assert_members_match(hydra, [backbone] * 2, spec, x)
    # what an export folder needs: JSON-able kwargs -> same architecture -> same outputs
    kwargs = json.loads(json.dumps(hydra.backbone_kwargs))
    assert kwargs["classes"] == CLASSES and kwargs["templates"] == TEMPLATES
    rebuilt = fuse(rebuild_openclip(kwargs), spec)
    rebuilt.load_state_dict(hydra.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), hydra(x), atol=0, rtol=0)
    with pytest.raises(FusionError, match="pixel_values must be"):
        hydra(torch.zeros(1, 3, 16, 16))


def test_members_with_different_classifiers_are_refused(tiny_clips):
    backbone, _ = tiny_clips["tok"]
    other = wrap_openclip(tiny_clip("tok"), classes=[*CLASSES[:4], "bus"], templates=TEMPLATES)
    spec = HydraSpec(
        backbone.name,
        backbone.num_layers,
        4,
        backbone.head_dim,
        [{"heads": [[0]] * 3}, {"heads": [[1]] * 3}],
    )
    with pytest.raises(FusionError, match="zero-shot classifier"):
        fuse([backbone, other], spec)


def test_data_config_matches_open_clip_transform(registered_tiny):
    """timm's transform from data_config() == open_clip's own eval transform for the model."""
    from PIL import Image
    from timm.data import create_transform

    backbone = load_openclip(registered_tiny, classes=CLASSES)
    _, _, theirs = open_clip.create_model_and_transforms(registered_tiny)
    ours = create_transform(**backbone.data_config(), is_training=False)
    rng = np.random.default_rng(0)
    for size in ((45, 61), (70, 33)):
        image = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        torch.testing.assert_close(ours(image), theirs(image), atol=1e-5, rtol=0)


# --- selection with no training (the zero-shot setting) --------------------------------------------
def test_circuit_selection_zero_shot(tiny_clips):
    backbone, _ = tiny_clips["tok"]
    generator = torch.Generator().manual_seed(0)
    x_id = torch.randn(40, 3, 32, 32, generator=generator)
    with torch.no_grad():
        y = backbone(x_id).argmax(-1)  # zero-shot predictions as labels: no annotation needed
    x_ood = 3.0 * torch.rand(40, 3, 32, 32, generator=generator) - 1.5
    spec = select_members(
        backbone,
        3,
        heads_per_member=2,
        method="circuit",
        data=(x_id, y),
        ood_data=x_ood,
        seed=0,
        batch_size=40,
    )
    assert spec.num_members == 3 and spec.backbone == backbone.name
    assert all(len(h) == 2 for member in spec.members for h in member.heads)
    assert spec.meta["selection"]["objective"] == "ood"
    hydra = fuse(backbone, spec)
    assert_members_match(hydra, [backbone] * 3, spec, x_ood[:4])


# --- loading by name, checkpoints, errors ----------------------------------------------------------
@pytest.fixture(scope="module")
def registered_tiny(tmp_path_factory) -> str:
    """A tiny model config registered with open_clip under a name, as a user's own config would be."""
    folder = tmp_path_factory.mktemp("open_clip_configs")
    name = "hydra-test-tiny-vit"
    config = {"embed_dim": 16, "vision_cfg": TINY_CLIP["tok"], "text_cfg": TEXT_CFG}
    (folder / f"{name}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder)
    return name


def test_load_by_name_random_and_checkpoint(registered_tiny, tmp_path, caplog):
    (tmp_path / "names.txt").write_text("\n".join(CLASSES) + "\n")
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        backbone = load_backbone(f"openclip:{registered_tiny}", classes=tmp_path / "names.txt")
    assert "random weights" in caplog.text
    assert backbone.name == f"openclip:{registered_tiny}" and backbone.weights == "random"
    assert backbone.family == "openclip" and backbone.num_heads == 4
    # a local checkpoint: the saved CLIP's logits come back
    clip = tiny_clip("tok", seed=3)
    path = tmp_path / "clip.pt"
    torch.save(clip.state_dict(), path)
    loaded = load_openclip(registered_tiny, checkpoint=path, classes=CLASSES)
    direct = wrap_openclip(clip, classes=CLASSES, model_name=registered_tiny)
    assert loaded.weights == str(path)
    x = loaded.example_inputs(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), direct(x), atol=ATOL, rtol=0)
    other = tiny_clip("avg_ls_quickgelu")
    torch.save(other.state_dict(), tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="model name matches"):
        load_openclip(registered_tiny, checkpoint=tmp_path / "other.pt", classes=CLASSES)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_openclip(registered_tiny, checkpoint=tmp_path / "missing.pt", classes=CLASSES)


def test_errors(registered_tiny, tmp_path, monkeypatch):
    with pytest.raises(BackboneError, match=r"Did you mean.*ViT-B-32"):
        load_backbone("openclip:ViT-B-33", classes=CLASSES)
    with pytest.raises(BackboneError, match=re.escape("pass classes=[...]")):
        load_backbone(f"openclip:{registered_tiny}")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(BackboneError, match="empty"):
        load_openclip(registered_tiny, classes=tmp_path / "empty.txt")
    with pytest.raises(BackboneError, match="does not exist"):
        load_openclip(registered_tiny, classes=str(tmp_path / "nope.txt"))
    with pytest.raises(BackboneError, match="placeholder"):
        load_openclip(registered_tiny, classes=CLASSES, templates=["a photo"])
    with pytest.raises(BackboneError, match="num_classes=3"):
        load_openclip(registered_tiny, num_classes=3, classes=CLASSES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        CheckpointError, match=re.escape("checkpoint='path/to/open_clip_model.safetensors'")
    ):
        load_openclip("ViT-B-32", classes=CLASSES, pretrained="laion2b_s34b_b79k")
    with pytest.raises(CheckpointError, match="tags: openai"):
        load_openclip("ViT-B-32", classes=CLASSES, pretrained="no-such-tag")
    with pytest.raises(BackboneError, match="not both"):
        load_openclip(registered_tiny, classes=CLASSES, checkpoint="x.pt", pretrained="openai")


def test_unsupported_towers_are_refused():
    resnet = open_clip.CLIP(
        embed_dim=16,
        text_cfg=TEXT_CFG,
        vision_cfg=dict(layers=(1, 1, 1, 1), width=8, head_width=8, image_size=32),
    )
    with pytest.raises(UnsupportedModelError, match="ModifiedResNet"):
        wrap_openclip(resnet, classes=CLASSES)
    pooled = open_clip.CLIP(
        embed_dim=16,
        text_cfg=TEXT_CFG,
        vision_cfg={
            **TINY_CLIP["tok"],
            "attentional_pool": True,
            "attn_pooler_queries": 2,
            "attn_pooler_heads": 2,
        },
    )
    with pytest.raises(UnsupportedModelError, match="attentional pooling"):
        wrap_openclip(pooled, classes=CLASSES)
    custom = open_clip.CLIP(
        embed_dim=16, text_cfg=TEXT_CFG, vision_cfg={**TINY_CLIP["tok"], "qk_norm": True}
    )
    with pytest.raises(UnsupportedModelError, match="CustomResidualAttentionBlock"):
        wrap_openclip(custom, classes=CLASSES)
    with pytest.raises(BackboneError, match="text tower"):
        wrap_openclip(tiny_clip().visual, classes=CLASSES)
    built = wrap_openclip(tiny_clip(), classes=["a", "b"])
    assert isinstance(built.module, ZeroShotClassifier)
    again = wrap_openclip(built.module)  # an already built classifier is wrapped as it is
    assert again.module is built.module and again.num_classes == 2
    with pytest.raises(BackboneError, match="already holds"):
        wrap_openclip(built.module, classes=["c"])


@pytest.mark.slow
def test_vit_b32_by_name_random_weights():
    """The real architecture by name (random init, ~10 s): tokenizer offline, fused == members."""
    backbone = load_openclip("ViT-B-32", classes=CLASSES, templates=TEMPLATES[:1])
    assert (backbone.num_layers, backbone.num_heads, backbone.head_dim) == (12, 12, 64)
    assert backbone.data_config()["input_size"] == (3, 224, 224)
    spec = HydraSpec.random(backbone.name, 12, 12, 64, members=2, heads_per_member=4, seed=0)
    hydra = fuse(backbone, spec)
    assert_members_match(hydra, [backbone] * 2, spec, backbone.example_inputs(1), atol=1e-4)
