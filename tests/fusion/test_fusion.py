"""The fused Hydra ViT equals its members run one by one (the exactness contract)."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from helpers.members import perturbed_members, specs
from helpers.vit import TINY_VIT, scramble, tiny_vit
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import FusionError, SpecError, UnsupportedModelError
from hydra_deploy.fusion import LOWERINGS, GroupedLinear, fuse, grouped_linear
from hydra_deploy.specs import HydraSpec

ATOL = 1e-5  # float32, tiny models (the bound)


def with_mlp_average(members: list) -> list:
    """Reference for mlp_merge='average': each member with every MLP replaced by the mean MLP."""
    averaged = []
    for member in members:
        module = copy.deepcopy(member.module)
        for layer, block in enumerate(module.blocks):
            for name, param in block.mlp.named_parameters():
                mean = torch.stack(
                    [m.module.blocks[layer].mlp.get_parameter(name) for m in members]
                ).mean(0)
                with torch.no_grad():
                    param.copy_(mean)
        averaged.append(load_backbone(module))
    return averaged


def assert_members_match(hydra, references, spec, x, atol=ATOL):
    with torch.no_grad():
        fused = hydra(x)
        assert fused.shape == (x.shape[0], spec.num_members, references[0].num_classes)
        for m in range(spec.num_members):
            expected = references[m](x, spec.head_mask(m))
            error = (fused[:, m] - expected).abs().max().item()
            assert error <= atol, f"member {m}: max abs error {error:.2e} > {atol:.0e}"


# --- GroupedLinear -------------------------------------------------------------------------------
@given(
    groups=st.integers(1, 4),
    din=st.integers(1, 9),
    dout=st.integers(1, 9),
    rows=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_linear_lowerings_equal_per_group_matmul(groups, din, dout, rows, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, *rows, din, generator=g)
    weight = torch.randn(groups, din, dout, generator=g)
    b = torch.randn(groups, dout, generator=g) if bias else None
    expected = torch.stack([x[i] @ weight[i] + (0 if b is None else b[i]) for i in range(groups)])
    for lowering in LOWERINGS:
        out = grouped_linear(x, weight, b, lowering)
        assert out.shape == (groups, *rows, dout)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=lowering)


def test_grouped_linear_module_and_errors():
    layer = GroupedLinear(3, 4, 5)
    assert layer.weight.shape == (3, 4, 5) and layer.bias.shape == (3, 5)
    x = torch.randn(3, 2, 4)
    outs = {lw: GroupedLinear.from_weights(layer.weight, layer.bias, lw)(x) for lw in LOWERINGS}
    for lowering, out in outs.items():
        torch.testing.assert_close(out, outs["loop"], msg=lowering)
    with pytest.raises(FusionError, match="does not fit weight"):
        layer(torch.randn(2, 2, 4))
    with pytest.raises(FusionError, match="lowering"):
        GroupedLinear(3, 4, 5, lowering="winograd")
    with pytest.raises(FusionError, match="positive sizes"):
        GroupedLinear(0, 4, 5)


# --- exactness: identical members ----------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_VIT))
@given(data=st.data(), merge=st.sampled_from(["average", "grouped"]))
def test_fused_equals_masked_backbone(tiny_vits, config, data, merge):
    backbone = tiny_vits[config]
    spec = data.draw(specs(backbone))
    hydra = fuse(backbone, spec, merge)
    x = backbone.example_inputs(3, seed=data.draw(st.integers(0, 1000)))
    assert_members_match(hydra, [backbone] * spec.num_members, spec, x)


# --- exactness: fine-tuned members ---------------------------------------------------------------
@pytest.mark.parametrize("config", sorted(TINY_VIT))
@given(data=st.data())
def test_grouped_equals_finetuned_members(tiny_vits, config, data):
    backbone = tiny_vits[config]
    spec = data.draw(specs(backbone))
    members = perturbed_members(backbone, spec.num_members, seed=data.draw(st.integers(0, 99)))
    hydra = fuse(members, spec, "grouped")
    x = backbone.example_inputs(2, seed=1)
    assert_members_match(hydra, members, spec, x)
    if spec.num_members > 1:
        assert hydra.merge["mlp"] == "grouped" and hydra.merge["embeddings"] == "per-member"
        assert hydra.trunk_layers == 0


@pytest.mark.parametrize("config", sorted(TINY_VIT))
@given(data=st.data())
def test_average_equals_members_with_mean_mlp(tiny_vits, config, data):
    backbone = tiny_vits[config]
    spec = data.draw(specs(backbone))
    members = perturbed_members(backbone, spec.num_members, seed=data.draw(st.integers(0, 99)))
    hydra = fuse(members, spec, "average")
    x = backbone.example_inputs(2, seed=2)
    assert_members_match(hydra, with_mlp_average(members), spec, x)


def test_average_differs_from_grouped_for_finetuned_members(tiny_vits):
    """The averaged MLP is a real approximation: the test above would catch a silent 'grouped'."""
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=0)
    members = perturbed_members(backbone, 3, seed=0, scale=0.1)
    x = backbone.example_inputs(2)
    with torch.no_grad():
        gap = (fuse(members, spec, "average")(x) - fuse(members, spec, "grouped")(x)).abs().max()
    assert gap > 1e-3


def test_the_summaries_say_the_mlp_merge_fuse_was_given(tiny_vits):
    """fuse(..., mlp_merge=) wins over the spec's, and every summary says what was built."""
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    assert spec.mlp_merge == "average"
    members = perturbed_members(backbone, 2, seed=0, scale=0.1)
    for merge in ("grouped", "average"):
        hydra = fuse(members, spec, mlp_merge=merge)
        assert hydra.spec.mlp_merge == merge and hydra.merge["mlp"] == merge
        assert f"mlp_merge={merge}" in hydra.spec.summary() and f"mlp={merge}" in hydra.summary()


# --- the shared trunk ----------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [0, 1, 2])
def test_shared_trunk_is_detected_exact_and_cheaper(tiny_vits, shared):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(
        backbone.name, 3, 4, 8, members=3, heads_per_member=2, shared_layers=shared, seed=3
    )
    with_trunk = fuse(backbone, spec)
    without = fuse(backbone, spec, shared_trunk=False)
    assert with_trunk.trunk_layers == spec.shared_prefix_layers() >= shared
    assert without.trunk_layers == 0
    x = backbone.example_inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(with_trunk(x), without(x), atol=1e-6, rtol=0)
    assert_members_match(with_trunk, [backbone] * 3, spec, x)
    if with_trunk.trunk_layers:
        assert with_trunk.macs["hydra"] < without.macs["hydra"]
    else:
        assert with_trunk.macs["hydra"] == without.macs["hydra"]


def test_trunk_needs_identical_weights(tiny_vits):
    """Members with the same heads but different (fine-tuned) weights get no shared trunk."""
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(
        backbone.name, 3, 4, 8, members=2, heads_per_member=2, shared_layers=2, seed=0
    )
    members = perturbed_members(backbone, 2, seed=5)
    hydra = fuse(members, spec, "grouped")
    assert hydra.trunk_layers == 0
    assert_members_match(hydra, members, spec, backbone.example_inputs(2))


def test_identical_members_all_layers_trunk(tiny_vits):
    """M copies of one member: every layer is trunk, output is the member repeated M times."""
    backbone = tiny_vits["token"]
    one = HydraSpec.random(backbone.name, 3, 4, 8, members=1, heads_per_member=3, seed=0)
    spec = one.with_members(list(one.members) * 3)
    hydra = fuse(backbone, spec)
    assert hydra.trunk_layers == 3 and len(hydra.blocks) == 0
    assert hydra.macs["hydra"] == backbone.macs([[3]] * 3)
    assert_members_match(hydra, [backbone] * 3, spec, backbone.example_inputs(2))


# --- special cases -------------------------------------------------------------------------------
def test_layer_where_no_member_keeps_a_head(tiny_vits):
    backbone = tiny_vits["avg_reg_ls"]
    heads = [[[0, 1], [], [3]], [[2], [], []], [[1, 3], [], [0, 1, 2, 3]]]
    spec = HydraSpec(backbone.name, 3, 4, 8, [{"heads": h} for h in heads])
    hydra = fuse(backbone, spec, "grouped")
    assert hydra.blocks[1].attn.qkv is None
    assert hydra.merge["padded_heads"] == (2 - 1) + (4 - 1) + (
        4 - 0
    )  # layer 0: [2,1,2]; 2: [1,0,4]
    assert_members_match(hydra, [backbone] * 3, spec, backbone.example_inputs(2))


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_every_lowering_gives_the_same_model(tiny_vits, lowering):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=4)
    members = perturbed_members(backbone, 3, seed=1)
    hydra = fuse(members, spec, "grouped", lowering=lowering)
    assert all(b.attn.qkv.lowering == lowering for b in hydra.blocks)
    assert_members_match(hydra, members, spec, backbone.example_inputs(2))


def test_batch_of_one_and_macs(tiny_vits):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, disjoint=True)
    hydra = fuse(backbone, spec)
    assert_members_match(hydra, [backbone] * 2, spec, backbone.example_inputs(1))
    assert hydra.macs["single"] == backbone.macs()
    assert hydra.macs["deep_ensemble"] == 2 * backbone.macs()
    assert hydra.macs["hydra"] == backbone.macs([[2, 2]] * 3, embed_streams=1, head_streams=2)


# --- refusals: fuse never silently computes something else ----------------------------------------
def test_spec_that_does_not_fit_the_backbone(tiny_vits):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 4, 4, 8, members=2, heads_per_member=1)
    with pytest.raises(SpecError, match="num_layers=4 \\(backbone has 3\\)"):
        fuse(backbone, spec)
    spec = HydraSpec.random(backbone.name, 3, 6, 8, members=2, heads_per_member=1)
    with pytest.raises(SpecError, match="num_heads=6"):
        fuse(backbone, spec)


def test_member_count_and_architecture_mismatch(tiny_vits):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=1)
    with pytest.raises(FusionError, match="got 2 member models but the spec has 3"):
        fuse([backbone, backbone], spec)
    other = tiny_vit("token", seed=1)
    wider = timm.create_model("vit_tiny_patch16_224", **{**TINY_VIT["token"], "mlp_ratio": 2.0})
    differ = (
        r"member 2 is not the same architecture .* weights' shapes or dtypes differ \(blocks\.0"
    )
    with pytest.raises(FusionError, match=differ):
        fuse([backbone, other, wider], spec)
    pooled = timm.create_model(
        "vit_tiny_patch16_224", **{**TINY_VIT["token"], "global_pool": "avg", "fc_norm": False}
    )
    with pytest.raises(FusionError, match="pooling"):
        fuse([backbone, backbone, pooled], spec)


def test_bad_arguments(tiny_vits):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=1)
    with pytest.raises(FusionError, match="mlp_merge"):
        fuse(backbone, spec, "median")
    with pytest.raises(FusionError, match="lowering"):
        fuse(backbone, spec, lowering="fft")
    with pytest.raises(SpecError, match="HydraSpec"):
        fuse(backbone, spec.to_dict())


def test_unsupported_models_are_refused():
    for kwargs, feature in [({"qk_norm": True}, "qk_norm"), ({"global_pool": "map"}, "map")]:
        model = timm.create_model("vit_tiny_patch16_224", **{**TINY_VIT["token"], **kwargs})
        with pytest.raises(UnsupportedModelError, match=feature):
            load_backbone(model)


def test_spec_records_merge_choice(tiny_vits):
    backbone = tiny_vits["token"]
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=1)
    assert fuse(backbone, spec, "grouped").spec.mlp_merge == "grouped"
    assert fuse(backbone, spec).spec.mlp_merge == spec.mlp_merge == "average"


def test_wrong_input_shape_is_refused(tiny_vits):
    backbone = tiny_vits["token"]
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=1))
    with pytest.raises(FusionError, match=r"pixel_values must be \[batch, 3, 16, 16\]"):
        hydra(torch.randn(2, 3, 32, 32))
    with pytest.raises(FusionError, match="got \\[3, 16, 16\\]"):
        hydra(torch.randn(3, 16, 16))


# --- real size -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vit_s16():
    backbone = load_backbone("vit_s16", num_classes=10)
    scramble(backbone.module, seed=0, gain=1.0)
    return backbone


@pytest.mark.slow
@settings(max_examples=5)
@given(data=st.data(), merge=st.sampled_from(["average", "grouped"]))
def test_vit_s16_any_spec_equals_masked_backbone(vit_s16, data, merge):
    spec = data.draw(specs(vit_s16, max_members=4))
    hydra = fuse(vit_s16, spec, merge)
    assert_members_match(
        hydra, [vit_s16] * spec.num_members, spec, vit_s16.example_inputs(1), atol=1e-4
    )


@pytest.mark.slow
def test_vit_s16_fused_equals_members(vit_s16):
    backbone = vit_s16
    spec = HydraSpec.random(
        backbone.name, 12, 6, 64, members=3, heads_per_member=[2, 3, 1], shared_layers=2, seed=0
    )
    hydra = fuse(backbone, spec)
    assert hydra.trunk_layers == 2
    assert_members_match(hydra, [backbone] * 3, spec, backbone.example_inputs(2), atol=1e-4)
    members = perturbed_members(backbone, 3, seed=0, scale=0.01)
    assert_members_match(
        fuse(members, spec, "grouped"), members, spec, backbone.example_inputs(1), atol=1e-4
    )


def test_cli_lowerings_mirror_the_fusion_module():
    from hydra_deploy.cli import model_options as build
    from hydra_deploy.fusion import DEFAULT_LOWERING

    assert build.LOWERINGS == LOWERINGS and build.DEFAULT_LOWERING == DEFAULT_LOWERING == "loop"
    assert fuse.__kwdefaults__["lowering"] == DEFAULT_LOWERING
