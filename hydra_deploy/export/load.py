"""Rebuild the fused model from an export folder (hydra.json + weights.safetensors), no checkpoint.

The folder records the backbone's constructor arguments and the spec; the state dict's shapes say
which components are per member (embeddings, norms, LayerScale, MLP, classifier) and how many
leading layers form the shared trunk. ``load_export`` builds member copies that differ in exactly
those components, fuses them (so the fused structure is the same), loads the saved weights and
checks the result against the folder's ``model.onnx`` in ONNX Runtime.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from hydra_deploy.errors import ExportError


def load_export(export_dir: str | os.PathLike, *, check: bool = True):
    """The HydraModel saved in ``export_dir``; with ``check`` it must match ``model.onnx``."""
    from safetensors.torch import load_file

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.backbones.timm_vit import build_vit
    from hydra_deploy.export.exporter import FORMAT
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    folder = Path(export_dir)
    info_path, weights_path = folder / "hydra.json", folder / "weights.safetensors"
    for path in (info_path, weights_path):
        if not path.is_file():
            raise ExportError(f"{str(folder)!r} is not an export folder: {path.name} is missing")
    try:
        info = json.loads(info_path.read_text())
        weights = load_file(str(weights_path))
    except Exception as err:
        raise ExportError(f"cannot read the export in {str(folder)!r}: {err}") from err
    if info.get("format") != FORMAT or info.get("family") != "vit":
        raise ExportError(
            f"{info_path} has format {info.get('format')!r}, family {info.get('family')!r}; "
            f"this version reads {FORMAT!r} ViT exports"
        )
    if "backbone_kwargs" not in info:
        raise ExportError(f"{info_path} does not record the backbone's constructor arguments")
    spec = HydraSpec.from_dict(info["spec"])
    base = build_vit(info["backbone_kwargs"])
    members = [copy.deepcopy(base) for _ in range(spec.num_members)]
    _make_members_differ(members, weights)
    hydra = fuse([load_backbone(m) for m in members], spec, spec.mlp_merge)
    try:
        hydra.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ExportError(f"the saved weights do not fit the rebuilt model: {err}") from err
    hydra.merge = info["merge"]
    if check and (folder / "model.onnx").is_file():
        _check_against_onnx(hydra, folder / "model.onnx", info)
    return hydra


def _make_members_differ(members: list, weights: dict[str, torch.Tensor]) -> None:
    """Perturb, in members 1.., exactly the components the saved fused model keeps per member."""
    trunk = len({k.split(".")[1] for k in weights if k.startswith("trunk.")})
    blocks = len({k.split(".")[1] for k in weights if k.startswith("blocks.")})
    targets = []  # (module name in a timm ViT) for every per-member component
    if any(k.startswith("member_embeds.") for k in weights):
        targets += ["patch_embed", "norm_pre"]
        targets += [
            n for n in ("cls_token", "reg_token", "pos_embed") if f"member_embeds.0.{n}" in weights
        ]
    for j in range(blocks):
        layer = trunk + j
        targets.append(f"blocks.{layer}.attn")  # per stream anyway: keeps the trunk from growing
        for part in ("norm1", "norm2", "ls1", "ls2"):
            tensor = weights.get(
                f"blocks.{j}.{part}.weight", weights.get(f"blocks.{j}.{part}.gamma")
            )
            if tensor is not None and tensor.dim() == 2:
                targets.append(f"blocks.{layer}.{part}")
        if weights[f"blocks.{j}.mlp.fc1.weight"].dim() == 3:
            targets.append(f"blocks.{layer}.mlp")
    for part in ("norm", "fc_norm"):
        if part + ".weight" in weights and weights[part + ".weight"].dim() == 2:
            targets.append(part)
    if weights["head.weight"].dim() == 3:
        targets.append("head")
    with torch.no_grad():
        for index, member in enumerate(members[1:], start=1):
            for target in targets:
                owner = (
                    member.get_submodule(target)
                    if not target.endswith(("token", "pos_embed"))
                    else None
                )
                params = (
                    list(owner.parameters()) if owner is not None else [getattr(member, target)]
                )
                for param in params:
                    param.add_(index * 1e-3)


def _check_against_onnx(hydra, path: Path, info: dict) -> None:
    """The rebuilt model must compute what the folder's file computes (in the file's precision)."""
    from hydra_deploy.export.heads import WithEnsembleHead
    from hydra_deploy.export.validate import validate_onnx

    module = WithEnsembleHead(hydra) if info.get("uq_outputs") else hydra
    try:
        validate_onnx(path, module, hydra.example_inputs, [2],
                      precision=info.get("precision", "fp32"))  # fmt: skip
    except ExportError as err:
        raise ExportError(
            f"the model rebuilt from {path.parent} differs from its model.onnx ({err}); "
            "the folder's files do not belong together"
        ) from err
