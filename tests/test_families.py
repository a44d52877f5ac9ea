"""The family registry (hydra_deploy.families) and the invariants every registered family keeps:
the fused model equals its members one by one, ONNX Runtime equals PyTorch, the export folder
reloads, and the runner gives PyTorch's numbers."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json

import numpy as np
import pytest
import torch
from helpers.bert import tiny_bert
from helpers.members import perturbed_members, random_spec
from helpers.openclip import tiny_adapter
from helpers.vit import tiny_vit

import hydra_deploy.families as registry
from hydra_deploy.backbones import family_of_name, hf_bert, load_backbone
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import BackboneError, FinetuneError, FusionError
from hydra_deploy.export import export_onnx, load_export
from hydra_deploy.families import (
    Family,
    families,
    family_for_prefix,
    family_of_module,
    get_family,
    register,
)
from hydra_deploy.fusion import fuse
from hydra_deploy.fusion.model import check_same_architecture
from hydra_deploy.pruning.finetune import zero_pruned_heads

#: a tiny model of each family (what a new family must bring to join the registry's tests)
TINY = {
    "vit": lambda: tiny_vit("token"),
    "bert": lambda: tiny_bert("segments"),
    "openclip": lambda: tiny_adapter("tok")[0],
}
NAMES = [family.name for family in families()]


def test_every_registered_family_has_a_tiny_fixture():
    assert set(TINY) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_declaration_matches_the_code(name):
    family = get_family(name)
    backbone = TINY[name]()
    assert backbone.family == name and family_of_module(backbone.module) is family
    assert tuple(getattr(backbone, "input_names", ("pixel_values",))) == family.input_names
    for what in ("wrapper", "fused_class", "rebuild") + (("loader",) if family.prefix else ()):
        assert callable(family.resolve(what)), what
    if family.prefix:
        assert family_for_prefix(family.prefix) is family
    axes = family.dynamic_axes()
    assert set(axes) == set(family.input_names)
    assert all(a[0] == "batch" and (1 in a) == family.text for a in axes.values())


@pytest.mark.parametrize("name", NAMES)
def test_the_declared_block_layout_is_the_one_fusion_reads(name, monkeypatch):
    """``member_layout``'s block and its parts name real parts of a member's layer (fusion builds
    its blocks from them: no family keeps a second table), and a wrong name there breaks fusion."""
    import importlib
    from operator import attrgetter

    family = get_family(name)
    layout = family.member_layout
    backbone = TINY[name]()
    block = backbone.module.get_submodule(layout["block"].format(0))
    parts = layout["block_parts"]
    assert {"norm1", "norm2", "attn", "mlp", "fc1", "act", "fc2"} <= set(parts)
    for role, path in parts.items():
        assert attrgetter(path)(block) is not None, (role, path)
    fused_module = importlib.import_module(family.fused_class.partition(":")[0])
    assert not hasattr(fused_module, "BLOCK_PARTS")
    monkeypatch.setitem(layout, "block_parts", {**parts, "fc1": "no_such_layer"})
    with pytest.raises(AttributeError, match="no_such_layer"):
        fuse(backbone, _spec(backbone))


def _spec(backbone, members=3, seed=0):
    return random_spec(backbone, members=members, heads_per_member=2, seed=seed)


def _inputs(hydra, batch, seed):
    example = hydra.example_inputs(batch, seed)
    return example if isinstance(example, tuple) else (example,)


@pytest.mark.parametrize("name", NAMES)
def test_fused_equals_its_members_one_by_one(name):
    backbone = TINY[name]()
    spec = _spec(backbone)
    members = perturbed_members(backbone, 3, seed=1)
    hydra = fuse(members, spec, "grouped").eval()
    x = _inputs(hydra, 3, seed=2)
    with torch.no_grad():
        fused = hydra(*x)
        for m, member in enumerate(members):
            alone = fuse([member], spec.replace(members=[spec.members[m]], mlp_merge="grouped"))
            torch.testing.assert_close(fused[:, m], alone.eval()(*x)[:, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_onnx_reload_and_runner_equal_pytorch(name, tmp_path):
    backbone = TINY[name]()
    hydra = fuse(perturbed_members(backbone, 2, seed=3), _spec(backbone, 2, seed=4), "grouped")
    out = tmp_path / name
    info = export_onnx(hydra.eval(), out, batch=(1, 2, 4))
    assert info.family == name and info.validation["passed"]
    assert [i["name"] for i in info.record["inputs"]] == list(get_family(name).input_names)
    x = _inputs(hydra, 3, seed=5)
    with torch.no_grad():
        expected = hydra(*x).numpy()
        reloaded = load_export(out)(*x).numpy()  # checked against model.onnx on loading, too
    np.testing.assert_allclose(reloaded, expected, atol=1e-5, rtol=0)
    with load_runner(out, providers=["cpu"]) as runner:
        feed = {n: t.numpy() for n, t in zip(get_family(name).input_names, x, strict=True)}
        got = runner(feed)["member_logits"]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_registering_a_family():
    with pytest.raises(BackboneError, match="registered already"):
        register(get_family("vit"))
    with pytest.raises(BackboneError, match="prefix 'hf' is 'bert'"):
        register(Family(**{**get_family("bert").__dict__, "name": "roberta"}))
    with pytest.raises(BackboneError, match="input_kind must be"):
        register(Family(**{**get_family("vit").__dict__, "name": "x", "input_kind": "audio"}))
    with pytest.raises(BackboneError, match=r"unknown model family 'siglip'.*vit, bert, openclip"):
        get_family("siglip")
    assert [f.name for f in families()] == NAMES  # nothing half-registered


def test_an_unknown_family_is_refused_by_fusion_and_loading():
    backbone = tiny_vit("token")
    backbone.family = "siglip"
    with pytest.raises(FusionError, match="fusion is not implemented for the 'siglip' family"):
        fuse(backbone, _spec(backbone))
    with pytest.raises(BackboneError, match=r"unknown backbone family 'bart'.*'hf:<folder>'"):
        load_backbone("bart:facebook/bart-base")


# --- a family is registered in one place -----------------------------------------------------------
#: what the stand-in functions of a test family were called with
CALLS: list[tuple[str, object]] = []


def _loader(source, checkpoint=None, num_classes=None, **kwargs):
    CALLS.append(("loader", source))
    return tiny_bert("segments")


def _signature(adapter):
    CALLS.append(("architecture", adapter))
    return {"declared part": getattr(adapter.module, "test_tag", 0)}


def _head_views(module):
    CALLS.append(("head_views", module))
    return hf_bert.head_views(module)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (what it registers is forgotten)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    CALLS.clear()
    yield registry
    CALLS.clear()


@pytest.mark.parametrize("name", NAMES)
def test_every_family_declares_its_signature_and_the_fused_models_keep_no_check(name):
    family = get_family(name)
    assert callable(family.resolve("architecture"))
    fused_module = importlib.import_module(family.fused_class.partition(":")[0])
    assert not hasattr(fused_module, "check_same_architecture")
    assert family.resolve("fused_class").check_members is check_same_architecture
    backbone = TINY[name]()
    check_same_architecture([backbone, backbone])  # a member is its own architecture
    for alias, target in family.aliases.items():
        assert family_of_name(alias) is family and alias != target


def test_a_new_hugging_face_family_is_recognised_from_its_registration(scratch_registry, tmp_path):
    """A folder's family comes from the registered ``model_types`` only: registering a family
    that claims a ``model_type`` makes both the folder and ``hf:<folder>`` load through its
    loader (the ``hf`` prefix stays bert's, bert keeps its own folders)."""
    folder = tmp_path / "encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "textbert"}))
    assert family_of_name(folder).name == "bert"  # unclaimed: the Hugging Face loader refuses it
    bert = get_family("bert")
    new = dataclasses.replace(
        bert, name="textbert", prefix=None, model_types=("textbert",), loader=f"{__name__}:_loader"
    )
    register(new)
    assert registry.family_for_folder(folder) is new and family_of_name(folder) is new
    assert family_of_name(f"hf:{folder}") is new
    load_backbone(str(folder))
    load_backbone(f"hf:{folder}", num_classes=5)
    assert [("loader", str(folder)), ("loader", str(folder))] == CALLS
    with pytest.raises(BackboneError, match="model_type 'textbert' is 'textbert'"):
        register(dataclasses.replace(new, name="other"))
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert family_of_name(folder) is bert


def test_an_alias_belongs_to_the_family_declaring_it(scratch_registry):
    openclip = get_family("openclip")
    assert family_of_name("clip_b32").name == "vit"  # no family claims it: a timm name
    aliased = register(
        dataclasses.replace(openclip, aliases={"clip_b32": "ViT-B-32"}), replace=True
    )
    assert family_of_name("clip_b32") is aliased
    with pytest.raises(BackboneError, match="alias 'vit_b16' is 'vit'"):
        register(dataclasses.replace(openclip, aliases={"vit_b16": "ViT-B-16"}), replace=True)


def test_the_architecture_check_is_the_familys_declared_signature(scratch_registry):
    """Fusion compares what the family's registration declares, nothing else: a signature that
    only reads a tag refuses members whose tags differ, naming the entry."""
    register(
        dataclasses.replace(get_family("bert"), architecture=f"{__name__}:_signature"),
        replace=True,
    )
    backbone = tiny_bert("segments")
    other = load_backbone(copy.deepcopy(backbone.module))
    spec = _spec(backbone, members=2)
    fuse([backbone, other], spec, "grouped")
    assert [what for what, _ in CALLS] == ["architecture"] * 2
    other.module.test_tag = 1
    with pytest.raises(
        FusionError,
        match="member 1 is not the same architecture as member 0: its "
        "declared part differ; members must be copies of one bert backbone",
    ):
        fuse([backbone, other], spec, "grouped")


def test_fine_tuning_zeroes_the_heads_the_family_declares(scratch_registry):
    backbone = tiny_bert("segments")
    spec = _spec(backbone, members=1)
    bert = get_family("bert")
    register(dataclasses.replace(bert, head_views=f"{__name__}:_head_views"), replace=True)
    zero_pruned_heads(backbone.module, spec.members[0].heads)
    assert [("head_views", backbone.module)] == CALLS
    register(dataclasses.replace(bert, head_views=None), replace=True)
    with pytest.raises(FinetuneError, match=r"declares no head_views.*: vit$"):
        zero_pruned_heads(backbone.module, spec.members[0].heads)
