"""Fine-tuning members: loss goes down, pruned heads stay zero, fusion stays exact, runs resume."""

from __future__ import annotations

import copy
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from helpers.members import random_spec

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import CheckpointError, DataError, FinetuneError, HydraError, SpecError
from hydra_deploy.fusion import fuse
from hydra_deploy.pruning.finetune import (
    FinetunedMembers,
    finetune_members,
    zero_pruned_heads,
)
from hydra_deploy.specs import HydraSpec

FAST = dict(max_steps=30, batch_size=64, lr=1e-3, progress=False)


def make_spec(backbone, members: int = 3) -> HydraSpec:
    return random_spec(backbone, members=members, heads_per_member=2, seed=0)


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def states_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def head_slices(module: torch.nn.Module, layer: int, head: int) -> list[torch.Tensor]:
    """One head's Q/K/V rows, Q/K/V bias and output-projection columns."""
    attn = module.blocks[layer].attn
    H, hd = attn.num_heads, attn.head_dim
    return [
        attn.qkv.weight.detach().view(3, H, hd, -1)[:, head],
        attn.qkv.bias.detach().view(3, H, hd)[:, head],
        attn.proj.weight.detach().view(-1, H, hd)[:, head],
    ]


def masked_loss(module: torch.nn.Module, mask: np.ndarray, data) -> float:
    """Mean cross-entropy of ``module`` with ``mask`` over all of ``data`` (computed here)."""
    adapter = load_backbone(module)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.loader(batch_size=500):
            logits = adapter(x, mask)
            total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            count += len(y)
    return total / count


@pytest.fixture(scope="module")
def tuned(digits_vit, tmp_path_factory):
    """One fine-tuning run (saved), with what the tests need to check it against."""
    backbone, train, val = digits_vit
    spec = make_spec(backbone)
    before = state_of(backbone.module)
    rng_before = torch.get_rng_state()
    save_dir = tmp_path_factory.mktemp("members")
    members = finetune_members(
        backbone, spec, train, save_dir=save_dir, eval_examples=len(train), **FAST
    )
    return {
        "backbone": backbone,
        "train": train,
        "val": val,
        "spec": spec,
        "members": members,
        "before": before,
        "rng_before": rng_before,
        "rng_after": torch.get_rng_state(),
        "save_dir": save_dir,
    }


# --- 1. the loss goes down -----------------------------------------------------------------------
def test_finetuning_lowers_each_members_loss(tuned):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    members = tuned["members"]
    assert isinstance(members, FinetunedMembers) and len(members) == len(members.history) == 3
    for m, (module, entry) in enumerate(zip(members, members.history, strict=True)):
        assert entry["member"] == m and entry["seed"] == m and entry["resumed"] is False
        assert entry["steps"] == 30 and entry["epochs"] == pytest.approx(30 / 24)
        assert entry["loss_after"] < entry["loss_before"], entry
        mask = spec.head_mask(m)
        # independent check, over the same (here: all) training examples
        start = masked_loss(backbone.module, mask, train)
        end = masked_loss(module, mask, train)
        assert entry["loss_before"] == pytest.approx(start, abs=1e-4)
        assert entry["loss_after"] == pytest.approx(end, abs=1e-4)
        assert end < 0.9 * start, (m, start, end)


# --- 2. pruned heads held at zero, kept heads trained --------------------------------------------
def test_pruned_heads_are_exactly_zero_and_kept_heads_changed(tuned):
    backbone, spec = tuned["backbone"], tuned["spec"]
    for m, module in enumerate(tuned["members"]):
        assert not module.training
        for layer, kept in enumerate(spec.members[m].heads):
            for head in range(backbone.num_heads):
                got = head_slices(module, layer, head)
                if head in kept:
                    original = head_slices(backbone.module, layer, head)
                    assert not torch.equal(got[0], original[0]), (m, layer, head)
                    assert not torch.equal(got[2], original[2]), (m, layer, head)
                else:
                    assert all(bool((s == 0).all()) for s in got), (m, layer, head)
    # so the mask is redundant: the member unmasked equals the member masked
    x = backbone.example_inputs(4)
    member = load_backbone(tuned["members"][0])
    with torch.no_grad():
        torch.testing.assert_close(member(x), member(x, spec.head_mask(0)), atol=1e-6, rtol=0)


def test_zero_pruned_heads_helper(digits_vit):
    backbone = digits_vit[0]
    module = copy.deepcopy(backbone.module)
    kept = [[0, 2], [], [1, 2, 3]]
    assert zero_pruned_heads(module, kept) is module
    for layer, heads in enumerate(kept):
        for head in range(4):
            zero = all(bool((s == 0).all()) for s in head_slices(module, layer, head))
            assert zero == (head not in heads)
    with pytest.raises(SpecError, match="2 layers"):
        zero_pruned_heads(module, [[0], [1]])


# --- 3. the fused model equals the fine-tuned members --------------------------------------------
def test_fused_equals_finetuned_members(tuned):
    backbone, spec, members = tuned["backbone"], tuned["spec"], tuned["members"]
    x = backbone.example_inputs(5, seed=3)
    with torch.no_grad():
        fused = fuse(list(members), spec, "grouped")(x)
        averaged = fuse(list(members), spec, "average")(x)
        for m, module in enumerate(members):
            expected = load_backbone(module)(x, spec.head_mask(m))
            assert (fused[:, m] - expected).abs().max().item() <= 1e-4
            # averaged MLP: equals the member with every MLP replaced by the members' mean
            reference = copy.deepcopy(module)
            for layer, block in enumerate(reference.blocks):
                for name, param in block.mlp.named_parameters():
                    param.copy_(
                        torch.stack(
                            [o.blocks[layer].mlp.get_parameter(name) for o in members]
                        ).mean(0)
                    )
            expected_avg = load_backbone(reference)(x, spec.head_mask(m))
            assert (averaged[:, m] - expected_avg).abs().max().item() <= 1e-4
        assert (averaged - fused).abs().max().item() > 1e-4  # the members really differ


# --- 4. determinism ------------------------------------------------------------------------------
def test_same_seed_same_weights_other_seed_other_weights(tuned):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    again = finetune_members(backbone, spec, train, eval_examples=64, **FAST)
    for first, second in zip(tuned["members"], again, strict=True):
        assert states_equal(first, second)
    one = spec.with_members(spec.members[:1])
    other = finetune_members(backbone, one, train, seed=1, eval_examples=64, **FAST)
    assert other.history[0]["seed"] == 1
    assert not states_equal(other[0], tuned["members"][0])
    # the caller's global RNG is left as it was
    assert torch.equal(tuned["rng_before"], tuned["rng_after"])


def test_label_smoothing_trains_otherwise_and_is_recorded(tuned, tmp_path):
    """One field in FinetuneOptions is the whole option: flag, check, training and record."""
    from hydra_deploy.options import FinetuneOptions, flag_of

    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    one = spec.with_members(spec.members[:1])
    fast = {k: v for k, v in FAST.items() if k != "progress"}
    options = FinetuneOptions(data=train, save_dir=tmp_path, label_smoothing=0.2, **fast)
    smoothed = finetune_members(backbone, one, options=options, eval_examples=64, progress=False)
    assert not states_equal(smoothed[0], tuned["members"][0])

    def recorded(folder):
        return json.loads((folder / "member_0.json").read_text())["settings"]["label_smoothing"]

    assert recorded(tmp_path) == 0.2 and recorded(tuned["save_dir"]) == 0.0
    assert flag_of(FinetuneOptions, "label_smoothing") == "--label-smoothing"
    with pytest.raises(FinetuneError, match=r"label_smoothing must be a number in \[0, 1\)"):
        FinetuneOptions(data=train, label_smoothing=1.0)


# --- 5. saving and resuming ----------------------------------------------------------------------
def test_resume_loads_identical_members_quickly(tuned, tmp_path):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    folder = tmp_path / "run"
    shutil.copytree(tuned["save_dir"], folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"member_{m}.{ext}" for m in range(3) for ext in ("json", "safetensors")]
    record = json.loads((folder / "member_1.json").read_text())
    assert record["settings"]["heads"] == [list(h) for h in spec.members[1].heads]
    assert record["settings"]["lr"] == 1e-3 and record["steps"] == 30
    assert record["loss_after"] == tuned["members"].history[1]["loss_after"]

    resumed = finetune_members(
        backbone, spec, train, save_dir=folder, eval_examples=len(train), **FAST
    )
    assert [h["resumed"] for h in resumed.history] == [True] * 3
    for first, second, h1, h2 in zip(
        tuned["members"], resumed, tuned["members"].history, resumed.history, strict=True
    ):
        assert states_equal(first, second) and not second.training
        assert h2["loss_after"] == h1["loss_after"] and h2["steps"] == h1["steps"]
    trained_s = sum(h["seconds"] for h in tuned["members"].history)
    loaded_s = sum(h["seconds"] for h in resumed.history)
    assert loaded_s < 0.3 * trained_s, (loaded_s, trained_s)
    assert sorted(p.name for p in folder.iterdir()) == names  # nothing new, no temporary files


def test_changed_settings_retrain_with_a_warning(tuned, tmp_path, caplog, capsys, monkeypatch):
    from hydra_deploy import progress as progress_module

    monkeypatch.setattr(progress_module, "_is_terminal", lambda: True)  # bars on a terminal only
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    folder = tmp_path / "run"
    shutil.copytree(tuned["save_dir"], folder)
    one = spec.with_members(spec.members[:1])
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        changed = finetune_members(
            backbone,
            one,
            train,
            save_dir=folder,
            eval_examples=64,
            **{**FAST, "lr": 2e-3, "progress": True},
        )
    assert changed.history[0]["resumed"] is False
    assert "member 0" in caplog.text and "lr=0.001 -> 0.002" in caplog.text
    assert "fine-tuning member 0 (1 of 1)" in capsys.readouterr().err  # the progress bar
    assert not states_equal(changed[0], tuned["members"][0])
    assert json.loads((folder / "member_0.json").read_text())["settings"]["lr"] == 2e-3
    # and the retrained member is now the one that resumes
    caplog.clear()
    again = finetune_members(
        backbone, one, train, save_dir=folder, eval_examples=64, **{**FAST, "lr": 2e-3}
    )
    assert again.history[0]["resumed"] is True and states_equal(again[0], changed[0])
    assert "retraining" not in caplog.text
    assert capsys.readouterr().err == ""  # progress=False is quiet


def test_other_data_is_not_silently_reused(tuned, tmp_path, caplog):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    folder = tmp_path / "run"
    shutil.copytree(tuned["save_dir"], folder)
    one = spec.with_members(spec.members[:1])
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        other = finetune_members(
            backbone,
            one,
            train.subset(range(1000)),
            save_dir=folder,
            eval_examples=64,
            **{**FAST, "max_steps": 2},
        )
    assert other.history[0]["resumed"] is False and "data differ" in caplog.text


def test_corrupt_saved_member_raises_checkpoint_error(tuned, tmp_path):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    folder = tmp_path / "run"
    shutil.copytree(tuned["save_dir"], folder)
    weights = folder / "member_1.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"member_1\.safetensors.*resume=False"):
        finetune_members(backbone, spec, train, save_dir=folder, eval_examples=64, **FAST)
    (folder / "member_0.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"member_0\.json.*delete.*resume=False"):
        finetune_members(backbone, spec, train, save_dir=folder, eval_examples=64, **FAST)
    # resume=False ignores (and replaces) what is there
    one = spec.with_members(spec.members[:1])
    fresh = finetune_members(
        backbone, one, train, save_dir=folder, resume=False, eval_examples=64, **FAST
    )
    assert fresh.history[0]["resumed"] is False
    assert states_equal(fresh[0], tuned["members"][0])
    assert json.loads((folder / "member_0.json").read_text())["steps"] == 30


def test_interrupted_save_leaves_no_half_written_member(tuned, tmp_path, monkeypatch):
    import safetensors.torch

    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]

    def interrupted_save(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted_save)
    one = spec.with_members(spec.members[:1])
    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        finetune_members(
            backbone, one, train, save_dir=folder, eval_examples=64, **{**FAST, "max_steps": 2}
        )
    assert list(folder.iterdir()) == []


# --- 6. errors -----------------------------------------------------------------------------------
def test_spec_for_another_geometry_is_refused(digits_vit):
    backbone, train, _ = digits_vit
    for layers, heads, head_dim, word in [
        (4, 4, 8, "num_layers=4"),
        (3, 6, 8, "num_heads=6"),
        (3, 4, 16, "head_dim=16"),
    ]:
        spec = HydraSpec.random(
            backbone.name, layers, heads, head_dim, members=2, heads_per_member=1
        )
        with pytest.raises(SpecError, match=word):
            finetune_members(backbone, spec, train, **FAST)
    with pytest.raises(SpecError, match="HydraSpec"):
        finetune_members(backbone, make_spec(backbone).to_dict(), train, **FAST)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epochs": 0, "max_steps": None}, "epochs must be a positive"),
        ({"epochs": -1.5, "max_steps": None}, "epochs must be a positive"),
        ({"epochs": float("nan"), "max_steps": None}, "epochs must be a positive"),
        ({"lr": 0.0}, "lr must be a positive"),
        ({"lr": -1e-3}, "lr must be a positive"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
        ({"max_steps": 0}, "max_steps must be None or an int >= 1"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"eval_examples": 0}, "eval_examples"),
    ],
)
def test_bad_settings_are_refused(digits_vit, kwargs, match):
    backbone, train, _ = digits_vit
    with pytest.raises(FinetuneError, match=match) as info:
        finetune_members(backbone, make_spec(backbone), train, **{**FAST, **kwargs})
    assert isinstance(info.value, HydraError)


def test_bad_data_is_refused(digits_vit):
    backbone, train, _ = digits_vit
    spec = make_spec(backbone)
    x, y = train.dataset.tensors
    with pytest.raises(DataError, match="empty"):
        finetune_members(backbone, spec, (x[:0], y[:0]), **FAST)
    with pytest.raises(DataError, match=r"outside 0\.\.9"):
        finetune_members(backbone, spec, (x[:10], y[:10] + 5), **FAST)
    with pytest.raises(DataError, match="shape"):
        finetune_members(backbone, spec, (x[:10, :, :8], y[:10]), **FAST)


# --- 7. the backbone is left alone ---------------------------------------------------------------
def test_backbone_is_not_modified(tuned):
    module = tuned["backbone"].module
    after = module.state_dict()
    assert after.keys() == tuned["before"].keys()
    assert all(torch.equal(after[k], tuned["before"][k]) for k in after)
    assert not module.training
    assert all(not block.attn.proj._forward_pre_hooks for block in module.blocks)


# --- 8. shared parts: kept equal across members, stored once in the fused model -----------------
SHARED = ("cls_token", "pos_embed", "patch_embed.proj.weight", "norm.weight", "head.weight")


@pytest.mark.parametrize("shared_parts", ["frozen", "averaged"])
def test_shared_parts_stay_shared_and_the_fused_model_stores_them_once(
    tuned, shared_parts, tmp_path
):
    backbone, spec, train = tuned["backbone"], tuned["spec"], tuned["train"]
    members = finetune_members(
        backbone,
        spec,
        train,
        shared_parts=shared_parts,
        save_dir=tmp_path,
        **{**FAST, "max_steps": 10},
    )
    tables = [dict(m.named_parameters()) for m in members]
    for name in SHARED:
        assert all(torch.equal(t[name], tables[0][name]) for t in tables), name
        frozen_equal = torch.equal(tables[0][name], dict(backbone.module.named_parameters())[name])
        assert frozen_equal == (shared_parts == "frozen"), name  # averaged: tuned, then the mean
    blocks = [t["blocks.0.mlp.fc1.weight"] for t in tables]
    assert not torch.equal(blocks[0], blocks[1])  # the blocks are still each member's own
    assert all(p.requires_grad for m in members for p in m.parameters())  # unfrozen afterwards
    assert {e["shared_parts"] for e in members.history} == {shared_parts}

    per_member = fuse(tuned["members"], spec, "grouped")
    shared = fuse(members, spec, "grouped")
    assert per_member.merge["embeddings"] == per_member.merge["classifier"] == "per-member"
    assert shared.merge["embeddings"] == shared.merge["classifier"] == "shared"
    assert shared.num_parameters() < per_member.num_parameters()
    assert "per member: " in per_member.parameters_line()
    assert "embeddings" not in shared.parameters_line().partition("per member:")[2]
    # exact: the fused model equals each member run alone with its heads masked
    x = train.dataset.tensors[0][:6]
    with torch.no_grad():
        fused = shared(x)
        for m, module in enumerate(members):
            alone = load_backbone(module)(x, spec.head_mask(m))
            torch.testing.assert_close(fused[:, m], alone, atol=1e-5, rtol=1e-5)
    # a saved run with other shared_parts is not reused
    again = finetune_members(
        backbone,
        spec,
        train,
        shared_parts="per-member",
        save_dir=tmp_path,
        **{**FAST, "max_steps": 10},
    )
    assert not any(e["resumed"] for e in again.history)


def test_bad_shared_parts_are_refused(digits_vit):
    backbone, train, _ = digits_vit
    with pytest.raises(FinetuneError, match="shared_parts must be one of"):
        finetune_members(backbone, make_spec(backbone), train, shared_parts="shared", **FAST)


def test_no_progress_bars_in_a_log_file(digits_vit, capsys, caplog):
    """stderr that is not a terminal (a log file, CI) gets one summary line per member, not a
    progress bar redrawn per step (issue 17: 206 lines for one export)."""
    import logging

    backbone, train, _ = digits_vit
    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        finetune_members(
            backbone,
            make_spec(backbone, members=2),
            train,
            **{**FAST, "max_steps": 3, "progress": True},
        )
    err = capsys.readouterr().err
    assert "it/s" not in err and "|" not in err
    summaries = [r.getMessage() for r in caplog.records if "masked loss" in r.getMessage()]
    assert len(summaries) == 2 and summaries[0].startswith("member 0: 3 steps")


def test_shared_layers_are_frozen_and_fused_once(tuned):
    """A shared trunk: the first layers keep the same heads and weights in every member, so the
    fused model computes them once; a spec whose members differ there is refused."""
    backbone, train = tuned["backbone"], tuned["train"]
    spec = random_spec(backbone, members=3, heads_per_member=2, shared_layers=1, seed=0)
    members = finetune_members(backbone, spec, train, shared_layers=1, **{**FAST, "max_steps": 5})
    base = dict(backbone.module.named_parameters())
    tables = [dict(module.named_parameters()) for module in members]
    trunk = [
        n for n in base if n.startswith(("blocks.0.", "patch_embed.", "pos_embed", "cls_token"))
    ]
    for params in tables:
        assert all(torch.equal(params[n], tables[0][n]) for n in trunk)  # identical members
        # frozen: as the backbone's, but for the pruned heads' attention slices (zeroed)
        assert all(torch.equal(params[n], base[n]) for n in trunk if ".attn." not in n)
        assert not torch.equal(params["blocks.1.mlp.fc1.weight"], base["blocks.1.mlp.fc1.weight"])
    hydra = fuse(members, spec, "grouped")
    assert hydra.trunk_layers == 1 and hydra.merge["embeddings"] == "shared"
    with pytest.raises(FinetuneError, match=r"keep different heads in layer\(s\) \[0\]"):
        finetune_members(backbone, tuned["spec"], train, shared_layers=1, **FAST)
    with pytest.raises(FinetuneError, match=r"shared_layers must be an int in 0\.\.3"):
        finetune_members(backbone, spec, train, shared_layers=4, **FAST)
