"""The uncertainty benchmarks' protocol, tiny: a seeded timm ViT and a whole task (module-level, so
a worker process of ``benchmarks/uq_run.py`` can make it again)."""

from __future__ import annotations

from typing import Any

import torch

from hydra_deploy.backbones import load_backbone


def tiny_timm_vit(seed: int, **kwargs: Any):
    """A tiny timm ViT (8x8 grey input, 3 classes), seeded: the protocol's model in these tests."""
    import timm

    torch.manual_seed(seed)
    return load_backbone(
        timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=8,
            patch_size=4,
            in_chans=1,
            embed_dim=16,
            depth=2,
            num_heads=4,
            mlp_ratio=1.0,
            num_classes=3,
            **kwargs,
        )
    )


def _dropout_vit(seed: int):
    return tiny_timm_vit(seed, proj_drop_rate=0.1)


def tiny_recipe():
    import uq_task

    return uq_task.Recipe(
        base_steps=3,
        base_lr=1e-3,
        finetune_steps=2,
        finetune_lr=1e-3,
        batch_size=8,
        warmup_steps=1,
        heads_per_member=2,
        mc_samples=3,
        taylor_examples=16,
        circuit_examples=16,
        eval_batch=16,
        latency_batch=4,
        latency_rounds=2,
        eval_batch_fused=8,
        calibration_temperature=5,
        calibration_quantile=10,
        splits=4,
    )


def tiny_protocol_task(args: Any = None, *, recipe: Any = None):
    """Every row of the protocol on random 8x8 images, 3 classes: 24 training, 20 test (also the
    "shifted" set), 10 noise OOD and 12 OOD-validation examples, the same on every call."""
    import uq_task

    rng = torch.Generator().manual_seed(0)

    def data(n):
        return torch.randn(n, 1, 8, 8, generator=rng), torch.randint(0, 3, (n,), generator=rng)

    train, test, noise = data(24), data(20), 3 * torch.randn(10, 1, 8, 8, generator=rng)
    return uq_task.Task(
        name="tiny",
        classes=list("abc"),
        train=train,
        test=test,
        shift=test,
        ood={"noise": noise},
        new_model=_dropout_vit,
        recipe=tiny_recipe() if recipe is None else recipe,
        description={
            "title": "tiny",
            "summary": "a tiny run",
            "shift": "none",
            "ood": {"noise": "noise"},
            "details": {"data": "random"},
        },
        ood_validation=("blobs", torch.randn(12, 1, 8, 8, generator=rng).abs() * 2),
        extra_quantile_parts=(8,),
    )
