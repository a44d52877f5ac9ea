"""Tests of hydra_deploy.backbones: names, checkpoints, wrapping, the adapter view and MACs."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file
from torch import nn

from hydra_deploy.backbones import ALIASES, TimmVitAdapter, load_backbone, resolve_name
from hydra_deploy.backbones.checkpoint import read_state_dict, weights_file
from hydra_deploy.backbones.timm_vit import check_supported
from hydra_deploy.errors import (
    BackboneError,
    CheckpointError,
    HydraError,
    SpecError,
    UnsupportedModelError,
)

ARCH = "vit_tiny_patch16_224"
# timm keyword arguments of a tiny ViT: 16 px images, 4 px patches -> 16 patches + 1 class token.
TINY = dict(img_size=16, patch_size=4, depth=2, num_heads=4, embed_dim=32)
CLASSES = 5


# --------------------------------------------------------------------------------------------------
# helpers


def scramble(module: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every weight at O(1) activation scale so that every head and weight matters.

    timm's init (std 0.02) makes attention near uniform and outputs tiny, which can hide bugs.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2 and "pos_embed" not in name and "token" not in name:
                param.copy_(noise * 1.5 / param[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.3 * noise)
    return module


def tiny_model(seed: int = 0, num_classes: int = CLASSES, **extra) -> nn.Module:
    """A tiny timm VisionTransformer (not wrapped) with scrambled weights."""
    model = timm.create_model(ARCH, pretrained=False, num_classes=num_classes, **TINY, **extra)
    return scramble(model.eval(), seed)


def tiny_adapter(seed: int = 0, **extra) -> TimmVitAdapter:
    return load_backbone(tiny_model(seed, **extra))


def inputs(batch: int = 2, seed: int = 1, size: int = 16) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.fixture
def model() -> nn.Module:
    return tiny_model(seed=3)


# --------------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize(
    ("alias", "timm_name"),
    [
        ("vit_ti16", "vit_tiny_patch16_224"),
        ("vit_s16", "vit_small_patch16_224"),
        ("vit_b16", "vit_base_patch16_224"),
        ("vit_l16", "vit_large_patch16_224"),
    ],
)
def test_alias_resolves_to_timm_name(alias, timm_name):
    assert ALIASES[alias] == timm_name
    assert resolve_name(alias) == timm_name
    assert timm.is_model(timm_name)


def test_timm_name_resolves_to_itself():
    assert resolve_name("deit_small_patch16_224") == "deit_small_patch16_224"
    assert resolve_name(ARCH) == ARCH


def test_load_by_alias_and_by_timm_name_build_the_same_architecture():
    by_alias = load_backbone("vit_ti16", num_classes=CLASSES, **TINY)
    by_name = load_backbone(ARCH, num_classes=CLASSES, **TINY)
    assert by_alias.name == "vit_ti16"
    assert by_name.name == ARCH
    for adapter in (by_alias, by_name):
        assert isinstance(adapter, TimmVitAdapter)
        assert (adapter.num_layers, adapter.num_heads, adapter.embed_dim) == (2, 4, 32)
        assert adapter.num_classes == CLASSES
        assert adapter.weights == "random"
    assert by_alias.module.state_dict().keys() == by_name.module.state_dict().keys()


@pytest.mark.parametrize(
    ("typo", "suggestion"), [("vit_b17", "vit_b16"), ("vit_tiny_patch16_22", ARCH)]
)
def test_unknown_name_suggests_close_match(typo, suggestion):
    with pytest.raises(BackboneError, match="unknown backbone") as info:
        resolve_name(typo)
    assert suggestion in str(info.value)
    assert "Did you mean" in str(info.value)
    with pytest.raises(BackboneError, match=suggestion):
        load_backbone(typo)


def test_unknown_name_far_from_everything_has_no_suggestion():
    with pytest.raises(BackboneError) as info:
        resolve_name("qqqqqqqqqqqqqqqqqqqqqqqq")
    assert "Did you mean" not in str(info.value)


def test_non_vit_timm_model_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="ResNet is not a timm VisionTransformer"):
        load_backbone("resnet18", num_classes=CLASSES)


def test_non_timm_module_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="not a timm VisionTransformer"):
        load_backbone(nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        (dict(qk_norm=True), "qk_norm"),
        (dict(global_pool="map"), "global_pool='map'"),
        (dict(dynamic_img_size=True), "dynamic_img_size"),
    ],
)
def test_unsupported_vit_features_are_named(kwargs, feature):
    model = timm.create_model(ARCH, num_classes=CLASSES, **TINY, **kwargs)
    with pytest.raises(UnsupportedModelError, match="does not implement") as info:
        check_supported(model)
    assert feature in str(info.value)
    with pytest.raises(UnsupportedModelError, match=re.escape(feature)):
        load_backbone(ARCH, num_classes=CLASSES, **TINY, **kwargs)


def test_timm_refusing_arguments_is_a_backbone_error():
    # timm rejects some argument combinations with an assert; users must see a HydraError.
    with pytest.raises(BackboneError, match="timm cannot build"):
        load_backbone(ARCH, num_classes=CLASSES, class_token=False, global_pool="token", **TINY)
    with pytest.raises(BackboneError, match="timm cannot build"):
        load_backbone(ARCH, num_classes=CLASSES, global_pool="nonsense", **TINY)
    with pytest.raises(BackboneError, match="unexpected keyword"):
        load_backbone(ARCH, num_classes=CLASSES, no_such_argument=1, **TINY)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "5", True])
def test_invalid_num_classes(bad):
    with pytest.raises(BackboneError, match="num_classes must be a positive integer"):
        load_backbone(ARCH, num_classes=bad, **TINY)


def test_no_classifier_head_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="num_classes"):
        load_backbone(timm.create_model(ARCH, num_classes=0, **TINY))


# --------------------------------------------------------------------------------------------------
# checkpoints


def _save(model: nn.Module, path: Path, kind: str) -> Path:
    state = model.state_dict()
    if kind == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "w.safetensors"))
        return path / "w.safetensors"
    if kind == "pth":
        torch.save(state, path / "w.pth")
        return path / "w.pth"
    if kind in ("state_dict", "model"):
        torch.save({kind: state}, path / f"{kind}.pth")
        return path / f"{kind}.pth"
    if kind == "ema":  # timm prefers the EMA weights of a training checkpoint
        torch.save(
            {
                "state_dict": {k: torch.zeros_like(v) for k, v in state.items()},
                "state_dict_ema": state,
            },
            path / "ema.pth",
        )
        return path / "ema.pth"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["safetensors", "pth", "state_dict", "model", "ema"])
def test_checkpoint_round_trip(model, tmp_path, kind, caplog):
    path = _save(model, tmp_path, kind)
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        loaded = load_backbone(ARCH, checkpoint=path, num_classes=CLASSES, **TINY)
    assert "random weights" not in caplog.text
    assert loaded.weights == str(path)
    assert loaded.module is not model
    x = inputs()
    reference = run(model, x)
    assert torch.equal(run(loaded.module, x), reference)
    # the wrapped file alone, without num_classes: the classifier is sized from the checkpoint
    inferred = load_backbone(ARCH, checkpoint=path, **TINY)
    assert inferred.num_classes == CLASSES != timm.create_model(ARCH, **TINY).num_classes
    assert torch.equal(run(inferred.module, x), reference)


def test_checkpoint_loads_into_a_built_module(model, tmp_path):
    path = _save(model, tmp_path, "safetensors")
    other = tiny_model(seed=99)
    x = inputs()
    assert not torch.allclose(run(other, x), run(model, x))
    adapter = load_backbone(other, checkpoint=path)
    assert adapter.module is other
    assert adapter.weights == str(path)
    assert torch.equal(run(other, x), run(model, x))


def _folder(model: nn.Module, path: Path, **config) -> Path:
    path.mkdir()
    save_file(model.state_dict(), str(path / "model.safetensors"))
    config = {"architecture": ARCH, "num_classes": CLASSES, **config}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_folder_checkpoint_reads_architecture_from_config(model, tmp_path):
    folder = _folder(model, tmp_path / "hub_folder", num_features=32, global_pool="token")
    x = inputs()
    # config.json supplies the architecture (and num_classes); other model arguments are not read
    # from it, so a non-default geometry is passed as timm keyword arguments.
    adapter = load_backbone(folder, **TINY)
    assert adapter.name == ARCH
    assert adapter.num_classes == CLASSES
    assert adapter.weights == str(folder)
    assert torch.equal(run(adapter.module, x), run(model, x))
    # the same folder given as checkpoint of an explicit name, and as a str
    named = load_backbone("vit_ti16", checkpoint=str(folder), **TINY)
    assert named.name == "vit_ti16"
    assert torch.equal(run(named.module, x), run(model, x))


def test_folder_without_the_timm_kwargs_does_not_fit(model, tmp_path):
    folder = _folder(model, tmp_path / "hub_folder")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_backbone(folder)  # builds the default 224 px, 192-wide ViT-Tiny


def test_headless_checkpoint_names_the_missing_head(tmp_path):
    # a state dict without classifier (e.g. a feature extractor)
    source = tiny_model(seed=4)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}
    folder = tmp_path / "f"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": ARCH, "num_classes": 7}))
    with pytest.raises(CheckpointError, match="missing keys") as info:
        load_backbone(folder, **TINY)
    assert "head.weight" in str(info.value)


def test_folder_without_architecture(model, tmp_path):
    folder = tmp_path / "no_config"
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    with pytest.raises(BackboneError, match="architecture") as info:
        load_backbone(folder)
    assert "checkpoint=" in str(info.value)
    # ... but the folder works as the checkpoint of a named model
    adapter = load_backbone(ARCH, checkpoint=folder, **TINY)
    assert torch.equal(run(adapter.module, inputs()), run(model, inputs()))


def test_num_classes_mismatching_checkpoint(model, tmp_path):
    path = _save(model, tmp_path, "safetensors")
    with pytest.raises(CheckpointError, match="num_classes") as info:
        load_backbone(ARCH, checkpoint=path, num_classes=CLASSES + 2, **TINY)
    message = str(info.value)
    assert "head.weight" in message
    assert f"checkpoint ({CLASSES}, 32) vs model ({CLASSES + 2}, 32)" in message


def test_checkpoint_of_another_architecture(model, tmp_path):
    path = _save(model, tmp_path, "safetensors")
    with pytest.raises(CheckpointError, match="does not fit the model") as info:
        load_backbone(ARCH, checkpoint=path, **dict(TINY, depth=3))
    assert "the file has depth=2 where the model has depth=3" in str(info.value)
    assert "load_backbone(..., depth=2)" in str(info.value)  # from Python: its spelling


def test_missing_checkpoint(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_backbone(ARCH, checkpoint=missing, **TINY)
    assert str(missing) in str(info.value)
    assert "checkpoint=None" in str(info.value)


def test_folder_without_weights(tmp_path):
    with pytest.raises(CheckpointError, match="holds none of") as info:
        load_backbone(ARCH, checkpoint=tmp_path, **TINY)
    assert "model.safetensors" in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": ARCH}))
    with pytest.raises(CheckpointError, match="holds none of"):
        load_backbone(tmp_path, **TINY)


def test_unknown_extension(model, tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("not weights")
    with pytest.raises(CheckpointError, match=r"unknown extension '\.txt'") as info:
        load_backbone(ARCH, checkpoint=path, **TINY)
    assert ".safetensors" in str(info.value) and ".pth" in str(info.value)


@pytest.mark.parametrize("name", ["x.safetensors", "x.pth"])
def test_corrupt_checkpoint(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="cannot read checkpoint") as info:
        load_backbone(ARCH, checkpoint=path, **TINY)
    message = str(info.value)
    assert str(path) in message
    assert "safetensors" in message and "state dict" in message
    with pytest.raises(CheckpointError):
        read_state_dict(path)


def test_truncated_safetensors(model, tmp_path):
    path = _save(model, tmp_path, "safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_backbone(ARCH, checkpoint=path, **TINY)


def test_training_checkpoint_with_non_tensors(model, tmp_path):
    path = tmp_path / "train.pth"
    torch.save({**model.state_dict(), "epoch": 3}, path)
    with pytest.raises(CheckpointError, match="not tensors") as info:
        load_backbone(ARCH, checkpoint=path, **TINY)
    assert "epoch" in str(info.value) and "state_dict()" in str(info.value)


def test_weights_file_resolution(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert weights_file(tmp_path) == tmp_path / "pytorch_model.bin"
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert weights_file(tmp_path) == tmp_path / "model.safetensors"  # safetensors preferred
    assert weights_file(tmp_path / "pytorch_model.bin") == tmp_path / "pytorch_model.bin"


def test_hub_offline_fails_fast_and_names_local_option(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        load_backbone("vit_ti16", checkpoint="hub")
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "HF_HUB_OFFLINE" in message
    assert "local file" in message and "checkpoint='path/to/model.safetensors'" in message


def test_hub_checkpoint_needs_a_name(model):
    with pytest.raises(CheckpointError, match="needs a model name"):
        load_backbone(model, checkpoint="hub")


def test_no_checkpoint_warns_random_weights(caplog):
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        adapter = load_backbone("vit_ti16", num_classes=CLASSES, **TINY)
    assert adapter.weights == "random"
    records = [r for r in caplog.records if "random weights" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "vit_ti16" in records[0].getMessage()


def test_errors_are_hydra_errors():
    assert issubclass(UnsupportedModelError, BackboneError)
    assert issubclass(BackboneError, HydraError) and issubclass(CheckpointError, HydraError)
    assert issubclass(CheckpointError, OSError)


# --------------------------------------------------------------------------------------------------
# wrapping


def test_wrap_existing_module(model):
    adapter = load_backbone(model)
    assert isinstance(adapter, TimmVitAdapter)
    assert adapter.module is model
    assert adapter.name == ARCH
    assert adapter.weights == "module"
    assert load_backbone(model, num_classes=CLASSES).module is model


def test_wrap_module_num_classes_mismatch(model):
    with pytest.raises(BackboneError, match="num_classes=7") as info:
        load_backbone(model, num_classes=7)
    assert "reset_classifier" in str(info.value)


def test_wrap_module_refuses_timm_kwargs(model):
    with pytest.raises(BackboneError, match="timm keyword arguments"):
        load_backbone(model, img_size=32)


def test_adapter_is_returned_as_is(model):
    adapter = load_backbone(model)
    assert load_backbone(adapter) is adapter
    assert load_backbone(adapter, num_classes=CLASSES) is adapter
    with pytest.raises(BackboneError, match="already built"):
        load_backbone(adapter, checkpoint="w.safetensors")
    with pytest.raises(BackboneError, match="already built"):
        load_backbone(adapter, depth=3)
    with pytest.raises(BackboneError, match="num_classes=7"):
        load_backbone(adapter, num_classes=7)


@pytest.mark.parametrize("bad", [3, 2.0, None, ["vit_b16"]])
def test_wrong_type(bad):
    with pytest.raises(BackboneError, match="load_backbone expects") as info:
        load_backbone(bad)
    assert type(bad).__name__ in str(info.value)


# --------------------------------------------------------------------------------------------------
# adapter view


@pytest.mark.parametrize(
    "extra",
    [{}, dict(class_token=False, global_pool="avg", reg_tokens=2, qkv_bias=False, mlp_ratio=2.0)],
    ids=["token", "avg_reg"],
)
def test_adapter_geometry_matches_timm(extra):
    module = tiny_model(**extra)
    adapter = load_backbone(module)
    assert adapter.num_layers == len(module.blocks) == 2
    assert adapter.num_heads == module.blocks[0].attn.num_heads == 4
    assert adapter.head_dim == module.blocks[0].attn.head_dim == 8
    assert adapter.embed_dim == module.embed_dim == 32
    assert adapter.num_classes == module.num_classes == CLASSES
    assert adapter.num_tokens == 16 + module.num_prefix_tokens
    assert adapter.mlp_hidden == module.blocks[0].mlp.fc1.out_features
    assert adapter.num_parameters() == sum(p.numel() for p in module.parameters())
    x = adapter.example_inputs(3)
    assert x.shape == (3, 3, 16, 16)
    assert torch.equal(x, adapter.example_inputs(3))  # seeded
    assert not module.training  # the adapter puts the model in eval mode


def test_forward_without_and_with_ones_mask_equals_module(model):
    adapter = load_backbone(model)
    x = inputs()
    reference = run(model, x)
    with torch.no_grad():
        assert_same(adapter.forward(x), reference)
        assert_same(adapter(x), reference)
        ones = torch.ones(adapter.num_layers, adapter.num_heads)
        assert_same(adapter.forward(x, ones), reference)
        assert_same(adapter.forward(x, ones.numpy()), reference)  # numpy masks work too


@pytest.mark.parametrize("layer", [0, 1])
def test_masking_a_whole_layer_leaves_the_projection_bias(model, layer):
    adapter = load_backbone(model)
    x = inputs()
    mask = torch.ones(adapter.num_layers, adapter.num_heads)
    mask[layer] = 0
    with torch.no_grad():
        masked = adapter.forward(x, mask)
    attn = model.blocks[layer].attn

    def only_bias(_module, _args, output):
        return attn.proj.bias.expand_as(output)

    handle = attn.register_forward_hook(only_bias)
    try:
        reference = run(model, x)
    finally:
        handle.remove()
    assert_same(masked, reference)
    assert not torch.allclose(masked, run(model, x), atol=1e-3)  # the mask did something


@pytest.mark.parametrize(("layer", "head"), [(0, 0), (1, 2), (0, 3)])
def test_masking_one_head_equals_zeroing_its_projection_columns(model, layer, head):
    adapter = load_backbone(model)
    x = inputs()
    mask = torch.ones(adapter.num_layers, adapter.num_heads)
    mask[layer, head] = 0
    with torch.no_grad():
        masked = adapter.forward(x, mask)
    pruned = copy.deepcopy(model)
    hd = adapter.head_dim
    with torch.no_grad():
        pruned.blocks[layer].attn.proj.weight[:, head * hd : (head + 1) * hd] = 0
    assert_same(masked, run(pruned, x))
    assert not torch.allclose(masked, run(model, x), atol=1e-3)


def test_fractional_gates_scale_head_outputs(model):
    adapter = load_backbone(model)
    x = inputs()
    gates = torch.full((adapter.num_layers, adapter.num_heads), 0.5)
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for block in scaled.blocks:
            block.attn.proj.weight.mul_(0.5)
        assert_same(adapter.forward(x, gates), run(scaled, x))


@pytest.mark.parametrize("shape", [(2, 5), (3, 4), (4,), (2, 4, 1), (8,)])
def test_head_mask_of_wrong_shape(model, shape):
    adapter = load_backbone(model)
    with pytest.raises(SpecError, match=r"expected \(2, 4\)"):
        adapter.forward(inputs(), torch.ones(shape))
    with pytest.raises(SpecError), adapter.head_gates(torch.ones(shape)):
        pass
    assert all(not b.attn.proj._forward_pre_hooks for b in model.blocks)


def test_gate_gradients_are_taylor_importances():
    module = tiny_model(seed=5).double()
    adapter = load_backbone(module)
    x = inputs().double()
    target = torch.tensor([1, 3])

    def loss_at(gates: torch.Tensor) -> torch.Tensor:
        with adapter.head_gates(gates):
            return nn.functional.cross_entropy(module(x), target)

    gates = torch.ones(
        adapter.num_layers, adapter.num_heads, dtype=torch.float64, requires_grad=True
    )
    with adapter.head_gates(gates) as used:
        assert used is gates
        loss = nn.functional.cross_entropy(module(x), target)
    loss.backward()
    assert gates.grad is not None and gates.grad.shape == gates.shape
    assert (gates.grad != 0).all()
    # the gradient is dLoss/dgate: compare with central differences
    eps = 1e-5
    with torch.no_grad():
        for layer in range(adapter.num_layers):
            for head in range(adapter.num_heads):
                plus, minus = torch.ones_like(gates), torch.ones_like(gates)
                plus[layer, head] += eps
                minus[layer, head] -= eps
                numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps)
                assert abs(numeric - gates.grad[layer, head]) < 1e-6 * max(1.0, abs(numeric))


def test_hooks_are_removed_after_the_context(model):
    adapter = load_backbone(model)
    x = inputs()
    reference = run(model, x)
    zeros = torch.zeros(adapter.num_layers, adapter.num_heads)
    with adapter.head_gates(zeros):
        assert all(len(b.attn.proj._forward_pre_hooks) == 1 for b in model.blocks)
        inside = run(model, x)
    assert not torch.allclose(inside, reference, atol=1e-3)
    assert all(not b.attn.proj._forward_pre_hooks for b in model.blocks)
    assert torch.equal(run(model, x), reference)
    # also when the body raises
    with pytest.raises(RuntimeError, match="boom"), adapter.head_gates(zeros):
        raise RuntimeError("boom")
    assert all(not b.attn.proj._forward_pre_hooks for b in model.blocks)
    assert torch.equal(run(model, x), reference)
    # and after a masked forward
    with torch.no_grad():
        adapter.forward(x, zeros)
    assert torch.equal(run(model, x), reference)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_attention_weights_reconstruct_timm_weights(qkv_bias):
    module = tiny_model(seed=6, qkv_bias=qkv_bias)
    adapter = load_backbone(module)
    H, hd, D = adapter.num_heads, adapter.head_dim, adapter.embed_dim
    for layer in range(adapter.num_layers):
        attn = module.blocks[layer].attn
        w = adapter.attention_weights(layer)
        for t in (w.q, w.k, w.v):
            assert t.shape == (H, hd, D)
            assert not t.requires_grad
        assert w.proj.shape == (D, H, hd)
        assert torch.equal(torch.stack([w.q, w.k, w.v]).reshape(3 * D, D), attn.qkv.weight)
        assert torch.equal(w.proj.reshape(D, D), attn.proj.weight)
        assert torch.equal(w.proj_bias, attn.proj.bias)
        # head h of K is rows D + h*hd .. D + (h+1)*hd of qkv; its proj columns h*hd .. (h+1)*hd
        h = 2
        assert torch.equal(w.k[h], attn.qkv.weight[D + h * hd : D + (h + 1) * hd])
        assert torch.equal(w.proj[:, h], attn.proj.weight[:, h * hd : (h + 1) * hd])
        if qkv_bias:
            bias = torch.cat([w.q_bias, w.k_bias, w.v_bias]).reshape(-1)
            assert w.q_bias.shape == (H, hd)
            assert torch.equal(bias, attn.qkv.bias)
        else:
            assert w.q_bias is None and w.k_bias is None and w.v_bias is None


def test_attention_weights_compute_the_attention():
    """Per-head attention from the canonical weights equals timm's attention module.

    The einsums sum in another order than timm's fused qkv matmul, so the check runs in float64:
    in float32 the two differ by a few ulp, a margin that depends on the CPU's kernels.
    """
    module = tiny_model(seed=7).double()
    adapter = load_backbone(module)
    tokens = torch.randn(2, adapter.num_tokens, adapter.embed_dim, dtype=torch.float64)
    attn = module.blocks[1].attn
    w = adapter.attention_weights(1)
    q = torch.einsum("bnd,hed->bhne", tokens, w.q) + w.q_bias[None, :, None]
    k = torch.einsum("bnd,hed->bhne", tokens, w.k) + w.k_bias[None, :, None]
    v = torch.einsum("bnd,hed->bhne", tokens, w.v) + w.v_bias[None, :, None]
    probs = torch.softmax(q @ k.transpose(-1, -2) * adapter.head_dim**-0.5, dim=-1)
    out = torch.einsum("bhne,dhe->bnd", probs @ v, w.proj) + w.proj_bias
    torch.testing.assert_close(out, run(attn, tokens), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# MACs


def hand_macs(*, patches, prefix, in_chans, patch, D, H, hidden, C, L) -> int:
    N = patches + prefix
    hd = D // H
    embed = patches * in_chans * patch * patch * D
    layer = 3 * N * D * D + 2 * H * N * N * hd + N * D * D + 2 * N * D * hidden
    return embed + L * layer + D * C


@pytest.mark.parametrize(
    ("extra", "prefix", "hidden"),
    [
        ({}, 1, 128),
        (dict(class_token=False, global_pool="avg", reg_tokens=2, mlp_ratio=2.0), 2, 64),
    ],
    ids=["token", "avg_reg"],
)
def test_macs_of_tiny_model_match_hand_formula(extra, prefix, hidden):
    adapter = tiny_adapter(**extra)
    expected = hand_macs(
        patches=16, prefix=prefix, in_chans=3, patch=4, D=32, H=4, hidden=hidden, C=CLASSES, L=2
    )
    assert adapter.macs() == expected
    if not extra:
        # by hand: patch 16*3*4*4*32 = 24576; per layer 52224 + 18496 + 17408 + 139264; head 160
        assert expected == 24576 + 2 * (52224 + 18496 + 17408 + 139264) + 160 == 479520
    # the explicit single-model layer_heads gives the same count
    assert adapter.macs([[4]] * 2) == expected


def test_macs_scale_with_kept_heads_and_streams():
    adapter = tiny_adapter()
    N, D, hd = 17, 32, 8
    full = adapter.macs()
    per_head = N * D * 3 * hd + 2 * N * N * hd + N * hd * D
    assert adapter.macs([[3], [4]]) == full - per_head
    # a second stream in layer 1 with 2 heads adds its attention and a whole MLP
    assert adapter.macs([[4], [4, 2]]) == full + 2 * per_head + 2 * N * D * 128
    embed, head = 16 * 3 * 16 * D, D * CLASSES
    assert adapter.macs(embed_streams=2, head_streams=3) == full + embed + 2 * head


@pytest.mark.slow
def test_macs_of_vit_b16_match_the_cited_figure():
    adapter = load_backbone("vit_b16")
    assert adapter.num_classes == 1000
    assert (adapter.num_layers, adapter.num_heads, adapter.embed_dim) == (12, 12, 768)
    macs = adapter.macs()
    assert abs(macs - 17.58e9) / 17.58e9 < 0.01
    assert macs == hand_macs(
        patches=196, prefix=1, in_chans=3, patch=16, D=768, H=12, hidden=3072, C=1000, L=12
    )
