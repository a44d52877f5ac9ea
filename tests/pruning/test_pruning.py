"""Head importance (Taylor, circuit, random) and member selection."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from helpers.vit import TINY_VIT, scramble, tiny_vit

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import DataError, HydraError, SpecError
from hydra_deploy.pruning import circuit_search, head_importance, load_data, select_members
from hydra_deploy.pruning.selection import gumbel_chooser, heads_per_layer
from hydra_deploy.uncertainty.metrics import auroc


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ranks = [np.argsort(np.argsort(v.ravel())) for v in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def measured_loss_change(backbone, x, y) -> np.ndarray:
    """Mean |per-example loss change| of switching each head off, per token (the ground truth)."""
    L, H = backbone.num_layers, backbone.num_heads
    change = np.zeros((L, H))
    with torch.no_grad():
        full = F.cross_entropy(backbone(x), y, reduction="none")
        for layer in range(L):
            for head in range(H):
                mask = torch.ones(L, H)
                mask[layer, head] = 0
                off = F.cross_entropy(backbone(x, mask), y, reduction="none")
                change[layer, head] = (off - full).abs().mean() / backbone.num_tokens
    return change


def planted_model(planted=(1, 2)):
    """A tiny ViT where one head carries the signal: every other head's output is scaled by 0.02,
    and a sharp classifier makes the model confident in its own predictions (the labels)."""
    backbone = tiny_vit("token", seed=0)
    H, hd = backbone.num_heads, backbone.head_dim
    with torch.no_grad():
        for layer, block in enumerate(backbone.module.blocks):
            weight = block.attn.proj.weight.view(-1, H, hd)
            for head in range(H):
                if (layer, head) != planted:
                    weight[:, head] *= 0.02
        backbone.module.head.weight *= 20
    x = backbone.example_inputs(128, seed=1)
    with torch.no_grad():
        y = backbone(x).argmax(1)
    return backbone, x, y


# --- Taylor ----------------------------------------------------------------------------------------
def test_taylor_predicts_measured_loss_change():
    """First-order Taylor ranks heads as switching them off does, where head effects are small."""
    model = timm.create_model("vit_tiny_patch16_224", **TINY_VIT["token"]).eval()
    backbone = load_backbone(scramble(model, seed=0, gain=0.5))
    x = backbone.example_inputs(64, seed=1)
    y = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(2))
    taylor = head_importance(backbone, (x, y), "taylor", normalize=False)
    assert taylor.shape == (3, 4) and (taylor > 0).all()
    assert spearman(taylor, measured_loss_change(backbone, x, y)) >= 0.9


def test_taylor_is_per_example_mean_and_normalised_per_layer():
    backbone = tiny_vit("token")
    x = backbone.example_inputs(6, seed=3)
    y = torch.arange(6) % 5
    raw = head_importance(backbone, (x, y), "taylor", normalize=False, batch_size=4)
    assert all(p.grad is None for p in backbone.module.parameters())  # only the gates get grads
    # independent reference: one example at a time, |d loss / d gate| averaged
    expected = np.zeros_like(raw)
    for i in range(6):
        gates = torch.ones(3, 4, requires_grad=True)
        with backbone.head_gates(gates):
            loss = F.cross_entropy(backbone.module(x[i : i + 1]), y[i : i + 1])
        loss.backward()
        expected += gates.grad.abs().numpy() / 6
    np.testing.assert_allclose(raw, expected / backbone.num_tokens, rtol=1e-4, atol=1e-9)
    normed = head_importance(backbone, (x, y), "taylor")
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1.0, rtol=1e-6)


def test_planted_head_ranked_first_by_taylor_and_circuit():
    backbone, x, y = planted_model(planted=(1, 2))
    for method in ("taylor", "circuit"):
        scores = head_importance(backbone, (x, y), method, normalize=False)
        assert np.unravel_index(np.nanargmax(scores), scores.shape) == (1, 2), method


# --- circuit ---------------------------------------------------------------------------------------
def test_circuit_without_keep_is_leave_one_out():
    backbone = tiny_vit("avg_reg_ls")
    x = backbone.example_inputs(32, seed=4)
    y = torch.arange(32) % 5
    scores = head_importance(backbone, (x, y), "circuit")
    with torch.no_grad():
        full = F.cross_entropy(backbone(x), y)
        for layer, head in [(0, 1), (2, 3)]:
            mask = torch.ones(3, 4)
            mask[layer, head] = 0
            expected = F.cross_entropy(backbone(x, mask), y) - full
            assert scores[layer, head] == pytest.approx(float(expected), abs=1e-5)


def test_circuit_conditions_on_earlier_pruned_layers():
    backbone = tiny_vit("token")
    x = backbone.example_inputs(32, seed=5)
    y = torch.arange(32) % 5
    scores, mask = circuit_search(backbone, load_data((x, y), backbone), keep=[2, 1, 3])
    assert mask.sum(1).tolist() == [2, 1, 3]
    # each layer keeps its highest-scoring heads ...
    for layer, k in enumerate([2, 1, 3]):
        assert set(np.flatnonzero(mask[layer])) == set(np.argsort(-scores[layer])[:k])
    # ... scored with layer 0 already pruned: layer 1's scores are those of the pruned member
    prefix = mask.copy()
    prefix[1:] = 1.0
    with torch.no_grad():
        base = F.cross_entropy(backbone(x, prefix), y)
        trial = prefix.copy()
        trial[1, 0] = 0
        expected = F.cross_entropy(backbone(x, trial), y) - base
    assert scores[1, 0] == pytest.approx(float(expected), abs=1e-5)


def test_circuit_ood_objective_scores_auroc_drop():
    backbone = tiny_vit("token")
    x = backbone.example_inputs(40, seed=6)
    y = torch.arange(40) % 5
    x_ood = 3.0 * backbone.example_inputs(40, seed=7)
    scores = head_importance(backbone, (x, y), "circuit", objective="ood", ood_data=x_ood)

    def msp_auroc(mask):
        with torch.no_grad():
            msp = [backbone(v, mask).softmax(-1).max(-1).values.numpy() for v in (x, x_ood)]
        return auroc(-msp[0], -msp[1])

    mask = np.ones((3, 4), dtype=np.float32)
    mask[2, 1] = 0
    assert scores[2, 1] == pytest.approx(msp_auroc(np.ones((3, 4))) - msp_auroc(mask), abs=1e-9)
    with pytest.raises(DataError, match="ood_data"):
        head_importance(backbone, (x, y), "circuit", objective="ood")


def test_random_importance_is_seeded():
    backbone = tiny_vit("token")
    a = head_importance(backbone, method="random", seed=1)
    assert a.shape == (3, 4)
    np.testing.assert_array_equal(a, head_importance(backbone, method="random", seed=1))
    assert not np.array_equal(a, head_importance(backbone, method="random", seed=2))


def test_importance_errors():
    backbone = tiny_vit("token")
    x = backbone.example_inputs(4)
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(HydraError, match="unknown importance method"):
        head_importance(backbone, (x, y), "magnitude")
    with pytest.raises(DataError, match="needs labelled data"):
        head_importance(backbone, None, "taylor")
    with pytest.raises(HydraError, match="keep has 2 entries"):
        head_importance(backbone, (x, y), "circuit", keep=[1, 2])
    with pytest.raises(HydraError, match="objective"):
        head_importance(backbone, (x, y), "circuit", objective="accuracy")
    with pytest.raises(DataError, match="expects"):
        head_importance(backbone, (torch.randn(4, 3, 8, 8), y), "taylor")


# --- selection -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["taylor", "circuit", "random"])
def test_selection_is_seeded_and_members_differ(digits_vit, method):
    backbone, _, val = digits_vit
    spec = select_members(backbone, 3, heads_per_member=2, method=method, data=val, seed=0)
    assert spec.num_members == 3 and spec.importance == method and spec.seed == 0
    assert spec.heads_per_layer().tolist() == [[2, 2, 2]] * 3
    assert spec == select_members(backbone, 3, heads_per_member=2, method=method, data=val, seed=0)
    # another seed draws other members, each set distinct by construction
    others = [
        select_members(backbone, 3, heads_per_member=2, method=method, data=val, seed=seed)
        for seed in (1, 2, 3)
    ]
    assert any(other != spec for other in others)
    assert all(len({m.heads for m in other.members}) == 3 for other in others)
    overlap = np.asarray(spec.meta["overlap"])
    off_diagonal = overlap[~np.eye(3, dtype=bool)]
    assert (off_diagonal < 1).all()  # a trained model, and the members are all different
    assert spec.meta["selection"]["heads_per_layer"] == [2, 2, 2]


def test_selection_follows_importance_at_zero_temperature(digits_vit):
    backbone, _, val = digits_vit
    spec = select_members(backbone, 1, heads_per_member=2, data=val, temperature=0, resample=False)
    scores = head_importance(backbone, val, "taylor")
    for layer, heads in enumerate(spec.members[0].heads):
        assert set(heads) == set(np.argsort(-scores[layer])[:2])


def test_keep_ratio_rounds_per_layer_and_keeps_one_head(digits_vit):
    backbone, _, val = digits_vit
    assert heads_per_layer(backbone, None, [0.5, 0.1, 1.0], min_heads=1) == [2, 1, 4]
    assert heads_per_layer(backbone, None, 0.1, min_heads=1) == [1, 1, 1]
    assert heads_per_layer(backbone, None, 0.1, min_heads=0) == [0, 0, 0]
    assert heads_per_layer(backbone, [3, 0, 2], None, min_heads=0) == [3, 0, 2]
    spec = select_members(backbone, 3, keep_ratio=[0.5, 0.75, 0.25], data=val, seed=0)
    assert spec.heads_per_layer().tolist() == [[2, 3, 1]] * 3
    assert spec.meta["selection"]["keep_ratio"] == [0.5, 0.75, 0.25]


@pytest.mark.parametrize("ratio", [0, 0.0, -0.25, 1.5, float("nan"), [0.5, 0.0, 0.5]])
def test_keep_ratio_outside_zero_one_is_refused(ratio):
    """keep_ratio=0 used to keep one head per layer (min_heads=1) instead of being refused."""
    backbone = tiny_vit("token")
    with pytest.raises(HydraError, match=r"keep_ratio must be within \(0, 1\]"):
        heads_per_layer(backbone, None, ratio, min_heads=1)
    with pytest.raises(HydraError, match=r"keep_ratio must be within \(0, 1\]"):
        select_members(backbone, 2, keep_ratio=ratio, method="random")


def test_ood_circuit_selection_builds_an_ensemble(digits_vit):
    backbone, _, val = digits_vit
    x_ood = torch.randn(100, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    spec = select_members(
        backbone, 3, heads_per_member=2, method="circuit", data=val, ood_data=x_ood, seed=0
    )
    assert spec.meta["selection"]["objective"] == "ood"
    assert len({m.heads for m in spec.members}) == 3


def test_more_members_than_distinct_subsets_are_refused(digits_vit):
    backbone, _, val = digits_vit
    with pytest.raises(SpecError, match="allows only 1 distinct member"):
        select_members(backbone, 2, heads_per_member=4, data=val)  # all heads: no choice
    with pytest.raises(SpecError, match="allows only 64 distinct"):  # 4 ** 3 subsets
        select_members(backbone, 65, heads_per_member=1, method="random")
    assert select_members(backbone, 1, heads_per_member=4, data=val).num_members == 1


@pytest.mark.parametrize("method", ["taylor", "random"])
def test_members_are_distinct_by_construction(digits_vit, method):
    """Deterministic choices (temperature 0, no resample) would make every member the same top-k
    member: each repeat is changed by the cheapest swap instead of being refused (issue 19)."""
    backbone, _, val = digits_vit
    kwargs = dict(heads_per_member=1, method=method, data=val, temperature=0, resample=False)
    spec = select_members(backbone, 3, seed=0, **kwargs)
    heads = [m.heads for m in spec.members]
    assert len(set(heads)) == 3
    assert spec == select_members(backbone, 3, seed=0, **kwargs)  # seeded
    if method == "taylor":  # member 0 is the top-1 of every layer; the others differ by one swap
        scores = head_importance(backbone, val, "taylor")
        assert [h[0] for h in heads[0]] == [int(np.argmax(s)) for s in scores]
        for other in heads[1:]:
            assert sum(a != b for a, b in zip(heads[0], other, strict=True)) == 1
    # all 64 distinct subsets of 1 of 4 heads in 3 layers can be asked for
    many = select_members(backbone, 64, heads_per_member=1, method="random", seed=0)
    assert len({m.heads for m in many.members}) == 64


def test_selection_argument_errors(digits_vit):
    backbone, _, val = digits_vit
    with pytest.raises(HydraError, match="exactly one of"):
        select_members(backbone, 2, data=val)
    with pytest.raises(HydraError, match="exactly one of"):
        select_members(backbone, 2, heads_per_member=2, keep_ratio=0.5, data=val)
    with pytest.raises(SpecError, match="positive integer"):
        select_members(backbone, 0, heads_per_member=2, data=val)
    with pytest.raises(HydraError, match="cannot keep 5 heads of 4"):
        select_members(backbone, 2, heads_per_member=5, data=val)
    with pytest.raises(HydraError, match="min_heads"):
        select_members(backbone, 2, heads_per_member=[0, 1, 1], data=val)
    with pytest.raises(HydraError, match="keep_ratio must be within"):
        select_members(backbone, 2, keep_ratio=1.5, data=val)
    with pytest.raises(HydraError, match="circuit objective"):
        select_members(backbone, 2, heads_per_member=2, data=val, objective="ood")
    with pytest.raises(DataError, match="needs labelled data"):
        select_members(backbone, 2, heads_per_member=2, method="taylor")
    with pytest.raises(HydraError, match="temperature"):
        select_members(backbone, 2, heads_per_member=2, data=val, temperature=-1)


def test_gumbel_chooser_prefers_important_heads():
    rng = np.random.default_rng(0)
    choose = gumbel_chooser(rng, temperature=0.5)
    scores = np.array([0.0, 0.1, 0.2, 5.0])
    picks = [tuple(choose(np.arange(4), scores, 1)) for _ in range(500)]
    assert picks.count((3,)) > 400 and len(set(picks)) > 1
    top = gumbel_chooser(rng, temperature=0)
    assert top(np.arange(4), scores, 2).tolist() == [2, 3]


def test_ood_image_folder_is_read_with_the_backbone_preprocessing(tmp_path):
    from PIL import Image

    from hydra_deploy.pruning.importance import _ood_inputs

    backbone = tiny_vit("token")
    for index in range(3):  # any class sub-folder name: OOD labels are ignored
        folder = tmp_path / f"unrelated{index % 2}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(np.full((20, 24, 3), 60 * index, np.uint8)).save(folder / f"{index}.png")
    x = _ood_inputs(tmp_path, backbone, max_examples=None)
    assert tuple(x.shape) == (3, backbone.in_chans, *backbone.img_size) and x.dtype == torch.float32
    assert torch.isfinite(x).all() and x.std() > 0


@pytest.mark.parametrize("method", ["taylor", "circuit", "random"])
def test_members_can_keep_different_head_counts(digits_vit, method):
    backbone, _, val = digits_vit
    spec = select_members(backbone, 3, member_heads=[1, 2, 3], method=method, data=val, seed=0)
    assert spec.heads_per_layer().tolist() == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert spec.meta["selection"]["heads_per_layer"] == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    per_layer = select_members(backbone, 2, member_heads=[[1, 2, 3], 2], method=method, data=val)
    assert per_layer.heads_per_layer().tolist() == [[1, 2, 3], [2, 2, 2]]
    with pytest.raises(HydraError, match="one head count per member"):
        select_members(backbone, 3, member_heads=[1, 2], method=method, data=val)
    with pytest.raises(HydraError, match="not both"):
        select_members(backbone, 2, member_heads=[1, 2], heads_per_member=2, data=val)
    with pytest.raises(SpecError, match="allows only 1 distinct"):  # two members keeping all 4
        select_members(backbone, 3, member_heads=[4, 2, 4], method=method, data=val)


def test_headmap_conditioning_masks_the_circuit_found_so_far(digits_vit):
    """HeadMap's search (Wang et al. 2025): layer l's heads are scored with the circuit heads of
    earlier layers masked and every other head on, checked here against plain forward passes."""
    backbone, _, val = digits_vit
    x, y = val.dataset.tensors
    x, y = x[:64], y[:64]
    data = load_data((x, y), backbone)

    def loss(mask):
        with torch.no_grad():
            return float(F.cross_entropy(backbone(x, mask), y))

    scores, kept = circuit_search(backbone, data, keep=2, conditioning="headmap", max_examples=None)
    L, H = backbone.num_layers, backbone.num_heads
    condition = np.ones((L, H), np.float32)
    for layer in range(L):
        base = loss(condition)
        for head in range(H):
            trial = condition.copy()
            trial[layer, head] = 0.0
            assert scores[layer, head] == pytest.approx(loss(trial) - base, abs=1e-5)
        circuit = np.argsort(-scores[layer])[:2]
        assert set(np.flatnonzero(kept[layer])) == set(circuit)  # the circuit heads are kept
        condition[layer, circuit] = 0.0
    member, _ = circuit_search(backbone, data, keep=2, max_examples=None)
    np.testing.assert_allclose(member[0], scores[0], atol=1e-6)  # layer 0: nothing to condition on
    assert not np.allclose(member[1:], scores[1:])
    spec = select_members(
        backbone,
        2,
        heads_per_member=2,
        method="circuit",
        data=(x, y),
        conditioning="headmap",
        seed=0,
    )
    assert spec.meta["selection"]["conditioning"] == "headmap"
    with pytest.raises(HydraError, match="unknown circuit conditioning"):
        circuit_search(backbone, data, keep=2, conditioning="circuit")
