"""The option groups (hydra_deploy.options): one flag per field, one field per build flag, the
flags parsed back into the groups, and the fine-tuning record they compare on."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hydra_deploy.cli.model_options import add_build_arguments
from hydra_deploy.errors import FinetuneError, ParameterError
from hydra_deploy.options import (
    GROUPS,
    PARAMETER_FLAGS,
    FinetuneOptions,
    FuseOptions,
    LoadOptions,
    SelectionOptions,
    add_options,
    from_args,
)

#: fields no flag sets, each for a stated reason
LIBRARY_ONLY = {
    # --shared-layers draws a spec's shared trunk; freezing it while fine-tuning is library only
    (FinetuneOptions, "shared_layers"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    return parser


def _field_flags() -> dict[str, set[str]]:
    """Every flag (and alias) -> the names of the fields that declare it."""
    flags: dict[str, set[str]] = {}
    for group in GROUPS:
        for f in dataclasses.fields(group):
            if f.metadata["group"] is not None:
                assert f.metadata["group"] in GROUPS  # its flags are that group's fields
                continue
            if f.metadata["flag"] is None:
                assert (group, f.name) in LIBRARY_ONLY, f"{group.__name__}.{f.name} has no flag"
                continue
            for spelling in (f.metadata["flag"], *f.metadata["aliases"]):
                flags.setdefault(spelling, set()).add(f.name)
    return flags


def test_every_field_has_one_flag_and_every_build_flag_one_field():
    flags = _field_flags()
    assert all(len(names) == 1 for names in flags.values()), flags  # --seed: one name, shared
    parser_flags = {
        s
        for action in _build_parser()._actions
        for s in action.option_strings
        if s not in ("-h", "--help")
    }
    # --backbone is build_hydra's positional argument, not an option of a group
    assert parser_flags - {"--backbone"} == set(flags)


def test_a_flag_declared_in_two_groups_is_one_option():
    for flag in ("--seed",):
        declared = [
            (f.name, f.default, f.metadata["help"], f.metadata["type"])
            for group in GROUPS
            for f in dataclasses.fields(group)
            if f.metadata["flag"] == flag
        ]
        assert len(declared) == 2 and len(set(declared)) == 1


def test_default_flags_give_default_groups():
    args = _build_parser().parse_args(["--backbone", "vit_ti16"])
    assert from_args(SelectionOptions, args) == SelectionOptions()
    assert from_args(FinetuneOptions, args) == FinetuneOptions()
    assert from_args(FuseOptions, args) == FuseOptions()
    assert from_args(LoadOptions, args).load_kwargs() == LoadOptions().load_kwargs()


def test_flags_reach_their_fields():
    args = _build_parser().parse_args(
        [
            "--backbone",
            "vit_ti16",
            "--finetune",
            "train/",
            "--finetune-steps",
            "3",
            "--finetune-batch-size",
            "4",
            "--weight-decay",
            "0.1",
            "--seed",
            "7",
            "-m",
            "2",
            "--grouped-linear",
            "bmm",
            "--mean",
            "0.5",
            "--model-arg",
            "depth=2",
        ]
    )
    tune = from_args(FinetuneOptions, args)
    assert (tune.data, tune.max_steps, tune.batch_size, tune.weight_decay, tune.seed) == (
        "train/",
        3,
        4,
        0.1,
        7,
    )
    assert from_args(SelectionOptions, args).members == 2
    assert from_args(SelectionOptions, args).seed == 7
    assert from_args(FuseOptions, args).lowering == "bmm"
    load = from_args(LoadOptions, args)
    assert load.preprocessing == {"mean": [0.5]} and load.model_args == {"depth": 2}


def test_the_record_keeps_its_key_names():
    """member_{m}.json's settings keep the names a cache written before the groups has."""
    assert set(FinetuneOptions().record()) >= {  # a new option adds a key, none is renamed
        "epochs",
        "lr",
        "batch_size",
        "weight_decay",
        "seed",
        "max_steps",
        "warmup_steps",
        "shared_parts",
        "shared_layers",
    }
    record = FinetuneOptions(epochs=2, lr=1e-3, batch_size=8, max_steps=None).record()
    assert record["epochs"] == 2.0 and isinstance(record["epochs"], float)
    assert isinstance(record["batch_size"], int) and isinstance(record["lr"], float)


def test_an_older_record_without_a_newer_setting_still_matches():
    from hydra_deploy.pruning.finetune import _differences

    current = {"heads": [[0]], **FinetuneOptions().record(), "backbone": "b", "data": "d"}
    older = {k: v for k, v in current.items() if k not in ("shared_parts", "shared_layers")}
    assert _differences(older, current) == []
    changed = {**current, "lr": 0.5}
    assert _differences(changed, current) == ["lr=0.5 -> 0.0001"]


@pytest.mark.parametrize(
    ("make", "library", "command"),
    [
        (
            lambda: FinetuneOptions(max_steps=0),
            "max_steps must be None or an int >= 1, got 0",
            "--finetune-steps must be None or an int >= 1, got 0",
        ),
        (
            lambda: FinetuneOptions(batch_size=0),
            "batch_size must be an int >= 1, got 0",
            "--finetune-batch-size must be an int >= 1, got 0",
        ),
        (
            lambda: SelectionOptions(keep_ratio=1.5),
            "keep_ratio must be within (0, 1] (the fraction of each layer's heads a member "
            "keeps; 1 keeps all), got 1.5",
            "--keep-ratio must be within (0, 1] (the fraction of each layer's heads a member "
            "keeps; 1 keeps all), got 1.5",
        ),
        (
            lambda: FuseOptions(lowering="fft"),
            "lowering must be one of 'bmm', 'loop', 'dense', 'conv1d', 'einsum', got 'fft'",
            "--lowering must be one of 'bmm', 'loop', 'dense', 'conv1d', 'einsum', got 'fft'",
        ),
    ],
)
def test_groups_check_their_fields(make, library, command):
    with pytest.raises(ParameterError) as caught:
        make()
    assert str(caught.value) == library
    assert caught.value.for_command(PARAMETER_FLAGS) == command


def test_fine_tuning_errors_stay_finetune_errors():
    with pytest.raises(FinetuneError, match="lr must be a positive"):
        FinetuneOptions(lr=0)


def test_build_hydra_takes_the_groups_or_their_keywords():
    import torch

    from hydra_deploy.pipeline import build_hydra

    tiny = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 4}
    grouped = build_hydra(
        "vit_tiny_patch16_224",
        load=LoadOptions(model_args=tiny),
        select=SelectionOptions(members=2, heads_per_member=2, seed=3),
        fuse=FuseOptions(lowering="bmm"),
    )
    keywords = build_hydra(
        "vit_tiny_patch16_224",
        model_args=tiny,
        members=2,
        heads_per_member=2,
        seed=3,
        lowering="bmm",
    )
    assert grouped.spec == keywords.spec
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(grouped.hydra(x), keywords.hydra(x), rtol=0, atol=0)
    with pytest.raises(ParameterError, match="members is set by select too"):
        build_hydra("vit_tiny_patch16_224", select=SelectionOptions(), members=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_steps'"):
        build_hydra("vit_tiny_patch16_224", max_steps=2)


# --- the runtime commands' groups ------------------------------------------------------------------
def test_runner_options_parse_providers_once_and_check_their_fields():
    from hydra_deploy.options import RunnerOptions

    assert RunnerOptions(providers="cuda, cpu").providers == ["cuda", "cpu"]
    assert RunnerOptions(providers=("cpu",)).providers == ["cpu"]
    for bad, message in (
        (dict(providers="cpu,,cuda"), "providers must name ONNX Runtime providers"),
        (dict(batch_size=0), "batch_size must be at least 1, got 0"),
        (dict(threads=1.5), "threads must be an int, got 1.5"),
        (dict(providers="cpu", engine="m.engine"), "providers are ONNX Runtime's"),
    ):
        with pytest.raises(ParameterError, match=message):
            RunnerOptions(**bad)


def test_calibration_options_are_hydra_calibrate_flags():
    from hydra_deploy.cli import calibrate as command
    from hydra_deploy.decisions import SET_METHODS
    from hydra_deploy.options import CalibrationOptions, flag_of

    parser = command.build_parser()
    flags = {s for action in parser._actions for s in action.option_strings}
    assert {
        flag_of(CalibrationOptions, f.name) for f in dataclasses.fields(CalibrationOptions)
    } <= flags
    sets = next(a for a in parser._actions if "--sets" in a.option_strings)
    assert tuple(sets.choices) == (*SET_METHODS, "none")  # follows the registry
    argv = ["EXPORT", "--data", "d.npz", "--risk", "0.05", "--sets", "none", "--ood-alpha", "0"]
    options = from_args(CalibrationOptions, parser.parse_args(argv))
    assert options == CalibrationOptions(risk=0.05, sets="none", ood_alpha=None)
    kwargs = options.fit_kwargs()
    assert kwargs["alpha"] is None and kwargs["ood_alpha"] is None and kwargs["risk"] == 0.05
    assert from_args(CalibrationOptions, parser.parse_args(["E", "--data", "d"])) == (
        CalibrationOptions()
    )
    with pytest.raises(ParameterError) as caught:
        CalibrationOptions(sets="none", class_conditional=True)
    assert caught.value.for_command() == (
        "--class-conditional needs prediction sets; drop --sets none"
    )


def test_calibrate_takes_the_group_or_its_keywords_not_both():
    from hydra_deploy.evaluation.calibrate import calibrate
    from hydra_deploy.options import CalibrationOptions

    with pytest.raises(ParameterError, match=r"not both .*risk beside options"):
        calibrate(None, None, CalibrationOptions(), risk=0.1)  # refused before anything runs


def test_command_line_writes_a_group_back():
    from hydra_deploy.options import CalibrationOptions, command_line

    parser = argparse.ArgumentParser()
    add_options(parser, CalibrationOptions)
    options = CalibrationOptions(risk=0.05, sets="aps", class_conditional=True, seed=3)
    argv = command_line(options)
    assert argv == ["--sets", "aps", "--class-conditional", "--risk", "0.05", "--seed", "3"]
    assert from_args(CalibrationOptions, parser.parse_args(argv)) == options


def test_a_prefix_spells_every_flag_under_it():
    from hydra_deploy.options import BatchingOptions, ServeSettingError, spelling

    parser = argparse.ArgumentParser()
    add_options(parser, BatchingOptions, prefix="triton-", only=("model_name", "instances"))
    flags = {s for action in parser._actions for s in action.option_strings}
    assert {"--triton-name", "--triton-instances"} <= flags and "--model-name" not in flags
    args = parser.parse_args(["--triton-name", "m", "--triton-instances", "2"])
    assert from_args(BatchingOptions, args, prefix="triton-") == BatchingOptions(
        model_name="m", instances=2
    )
    with pytest.raises(ServeSettingError) as caught:
        BatchingOptions(instances=0)
    assert caught.value.for_command(spelling(BatchingOptions, "triton-")) == (
        "--triton-instances must be an integer >= 1, got 0"
    )
