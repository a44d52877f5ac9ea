"""build_hydra, the model-building pipeline as a library call (hydra_deploy.pipeline): what
hydra-fuse and hydra-export run, with keyword arguments; its errors name parameters, and the
commands spell them as their flags."""

from __future__ import annotations

import pytest
import torch

from hydra_deploy.cli import model_options
from hydra_deploy.cli.fuse import build_parser
from hydra_deploy.errors import HydraError, ParameterError, SpecError
from hydra_deploy.pipeline import Built, build_hydra, resolve_members

TINY = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 4}
FLAGS = [f"--model-arg={k}={v}" for k, v in TINY.items()]


def test_the_library_call_builds_what_the_command_builds():
    built = build_hydra(
        "vit_tiny_patch16_224", model_args=TINY, members=2, heads_per_member=2, seed=3
    )
    assert isinstance(built, Built) and built.spec.num_members == 2
    assert built.members is built.backbone  # nothing fine-tuned
    args = build_parser().parse_args(
        [
            "--backbone",
            "vit_tiny_patch16_224",
            *FLAGS,
            "-m",
            "2",
            "--heads-per-member",
            "2",
            "--seed",
            "3",
        ]
    )
    _, spec, _, hydra = model_options.build_hydra(args, progress=False)
    assert spec == built.spec
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hydra(x), built.hydra(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "library", "command"),
    [
        (
            lambda: build_hydra("vit_tiny_patch16_224", model_args=TINY, members=0),
            "members must be at least 1, got 0",
            "--members must be at least 1, got 0",
        ),
        (
            lambda: resolve_members(["a.pt", "b.pt", "c.pt"], members=2),
            "members 2 disagrees with the 3 checkpoints given (one member per checkpoint); leave "
            "members out or give as many checkpoints",
            "--members 2 disagrees with the 3 checkpoints given (one member per checkpoint); "
            "leave --members out or give as many checkpoints",
        ),
        (
            lambda: build_hydra("hf:some/folder", model_args={"depth": 2}),
            "model_args and preprocessing apply to timm ViT backbones",
            "--model-arg and the image preprocessing flags (--mean, --std, --interpolation, "
            "--crop-pct, --crop-mode) apply to timm ViT backbones",
        ),
        (
            lambda: build_hydra("vit_tiny_patch16_224", model_args=TINY, importance="taylor"),
            "importance taylor needs calib (an image folder or .npz; text: .tsv or .npz)",
            "--importance taylor needs --calib (an image folder or .npz; text: .tsv or .npz)",
        ),
        (
            lambda: build_hydra("vit_tiny_patch16_224", model_args=TINY, finetune_steps=3),
            "finetune_steps, finetune_dir, warmup_steps and shared_parts need finetune DATA",
            "--finetune-steps, --finetune-dir, --warmup-steps and --shared-parts need --finetune "
            "DATA",
        ),
        (
            lambda: build_hydra("vit_ti16", classes=["cat", "dog"]),
            "classes apply to zero-shot OpenCLIP backbones (backbone openclip:<model name>)",
            "--classes apply to zero-shot OpenCLIP backbones (--backbone openclip:<model name>)",
        ),
    ],
)
def test_errors_name_parameters_and_commands_say_flags(call, library, command):
    with pytest.raises(ParameterError) as caught:
        call()
    assert str(caught.value) == library
    assert caught.value.for_command(model_options.FLAGS) == command


def test_a_spec_of_another_architecture_is_a_spec_error(tmp_path):
    from hydra_deploy.specs import HydraSpec

    path = tmp_path / "spec.json"
    path.write_text(
        HydraSpec.random("vit_b16", 12, 12, 64, members=2, heads_per_member=4).to_json()
    )
    with pytest.raises(SpecError, match=r"^spec .*spec.json does not fit backbone vit_tiny"):
        build_hydra("vit_tiny_patch16_224", model_args=TINY, spec=path)
    args = build_parser().parse_args(
        ["--backbone", "vit_tiny_patch16_224", *FLAGS, "--spec", str(path)]
    )
    with pytest.raises(HydraError, match=r"^--spec .*spec.json does not fit --backbone vit_tiny"):
        model_options.build_hydra(args, progress=False)
