"""Rebuild the fused model from an export folder (hydra.json + weights.safetensors), no checkpoint.

The folder records the backbone's constructor arguments and the spec; the state dict's shapes say
which components are per member (embeddings, norms, LayerScale, MLP, classifier) and how many
leading layers form the shared trunk. ``load_export`` builds member copies that differ in exactly
those components, fuses them (so the fused structure is the same), loads the saved weights and
checks the result against the folder's ``model.onnx`` in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import ExportError, HydraError
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.export.validate import check_int8_against_model, validate_onnx
from hydra_deploy.export_folder import (
    DECISION_OUTPUTS,
    WEIGHTS_FILE,
    ExportInfo,
    default_preprocessing_warning,
    read_info,
)
from hydra_deploy.families import get_family
from hydra_deploy.fusion import fuse
from hydra_deploy.optional import lazy_module
from hydra_deploy.specs import HydraSpec

onnx = lazy_module(
    "onnx", purpose="checking a rebuilt model against its model.onnx", error=ExportError
)
# imports onnx at its top: for folders with in-graph decisions only
decision_graph = lazy_module("hydra_deploy.export.decision_graph")
safetensors_torch = lazy_module(
    "safetensors.torch", purpose="reading an export's weights", error=ExportError
)

logger = logging.getLogger("hydra_deploy")


def _rebuild_base(info: ExportInfo):
    """One member of the recorded architecture (weights to be replaced), as a module."""
    built = get_family(info.family).resolve("rebuild")(info.backbone_kwargs)
    return built.module if isinstance(built, BackboneAdapter) else built


def load_export(
    export_dir: str | os.PathLike, *, check: bool = True, warn_preprocessing: bool = True
):
    """The HydraModel saved in ``export_dir``; with ``check`` it must match ``model.onnx``.

    An image export whose preprocessing came from timm's default (the checkpoint recorded none)
    is warned about, as when the checkpoint was loaded (``warn_preprocessing=False``: the caller
    corrects the record first, then calls :func:`warn_default_preprocessing`)."""
    folder = Path(export_dir)
    if not folder.exists():
        raise ExportError(
            f"{str(folder)!r} does not exist; give the folder hydra-export wrote (--out DIR)"
        )
    checked = read_info(folder)
    info_path = checked.path
    if not checked.weights_path.is_file():
        raise ExportError(
            f"{str(folder)!r} is not an export folder: {WEIGHTS_FILE} is missing; give the "
            "folder hydra-export wrote (--out DIR)"
        )
    try:
        weights = safetensors_torch.load_file(str(checked.weights_path))
    except Exception as err:
        raise ExportError(
            f"cannot read the export in {str(folder)!r}: {err}; restore its files or export the "
            "model again with hydra-export"
        ) from err
    family = get_family(checked.family)  # known: read_info checks it against the registry
    if not isinstance(checked.backbone_kwargs, dict) or not checked.backbone_kwargs:
        raise ExportError(f"{info_path} does not record the backbone's constructor arguments")
    merge = checked.merge_record
    if merge is None:
        raise ExportError(f"{info_path} has no 'merge' record; restore it or re-export the model")
    tokenizer = checked.tokenizer_entry
    spec = HydraSpec.from_dict(checked.spec)
    try:
        base = _rebuild_base(checked)
    except HydraError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ExportError(
            f"{info_path}: its backbone_kwargs do not rebuild the backbone ({err!r}); restore the "
            "file or re-export the model"
        ) from err
    members = [copy.deepcopy(base) for _ in range(spec.num_members)]
    _make_members_differ(members, weights, family.member_layout)
    hydra = fuse([load_backbone(m) for m in members], spec, spec.mlp_merge)
    try:
        hydra.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ExportError(f"the saved weights do not fit the rebuilt model: {err}") from err
    hydra.merge = merge.to_dict()
    if isinstance(checked.preprocessing, dict):  # the export's, not the rebuilt ViT's default
        hydra.preprocessing = checked.preprocessing  # as written (a re-export writes it again)
    if checked.class_names is not None:  # a re-export keeps them (hydra.json's, checked)
        hydra.class_names = list(checked.class_names)
    if tokenizer:  # a re-export copies the folder's own tokenizer
        hydra.tokenizer_dir = str(folder / tokenizer.dir)
    if check and checked.onnx_path.is_file():
        _check_against_onnx(hydra, checked.onnx_path, checked)
    if warn_preprocessing:
        warn_default_preprocessing(hydra, folder)
    return hydra


def warn_default_preprocessing(hydra, export_dir: str | os.PathLike) -> None:
    """The default-preprocessing warning of a re-exported model, once (the words of a load)."""
    preprocessing = getattr(hydra, "preprocessing", None)
    message = isinstance(preprocessing, dict) and default_preprocessing_warning(
        f"the export {export_dir}", preprocessing
    )
    if message:
        logger.warning("%s", message)


def _make_members_differ(members: list, weights: dict[str, torch.Tensor], layout: dict) -> None:
    """Perturb, in members 1.., exactly the components the saved fused model keeps per member.

    ``fuse`` shares a component when all members' weights are equal and stacks it otherwise; the
    saved state dict's shapes (a leading member axis, ``member_embeds.*``, the ``trunk.*`` layers)
    say which were stacked, so members that differ in exactly those fuse to the same structure.
    """
    trunk = len({k.split(".")[1] for k in weights if k.startswith("trunk.")})
    blocks = len({k.split(".")[1] for k in weights if k.startswith("blocks.")})
    targets = []  # module or parameter names in one member
    if any(k.startswith("member_embeds.") for k in weights):
        params = layout["embed_params"]
        targets += [
            t
            for t in layout["embeds"]
            if t.rsplit(".", 1)[-1] not in params
            or f"member_embeds.0.{t.rsplit('.', 1)[-1]}" in weights
        ]
    for j in range(blocks):
        block = layout["block"].format(trunk + j)
        parts = layout["block_parts"]
        targets.append(f"{block}.{parts['attn']}")  # per stream anyway: keeps the trunk short
        for part in ("norm1", "norm2", "ls1", "ls2"):
            tensor = weights.get(
                f"blocks.{j}.{part}.weight", weights.get(f"blocks.{j}.{part}.gamma")
            )
            if tensor is not None and tensor.dim() == 2:
                targets.append(f"{block}.{parts[part]}")
        if weights[f"blocks.{j}.mlp.fc1.weight"].dim() == 3:
            targets.append(f"{block}.{parts['mlp']}")
    for fused, (source, per_member_dims) in layout["final"].items():
        tensor = weights.get(f"{fused}.weight")
        if tensor is not None and tensor.dim() == per_member_dims:
            targets.append(source)
    with torch.no_grad():
        for index, member in enumerate(members[1:], start=1):
            for target in targets:
                for param in _parameters(member, target):
                    param.add_(index * 1e-3)


def _parameters(module: torch.nn.Module, name: str) -> list[torch.Tensor]:
    """The parameters of submodule ``name``, or the parameter ``name`` itself."""
    try:
        return list(module.get_submodule(name).parameters())
    except AttributeError:
        return [module.get_parameter(name)]


def _check_against_onnx(hydra, path: Path, info: ExportInfo) -> None:
    """The rebuilt model must compute what the folder's file computes (in the file's precision)."""
    module = WithEnsembleHead(hydra) if info.uq_outputs else hydra
    try:  # ONNX Runtime reports an unreadable file as "system error number 13"
        path.open("rb").close()
    except OSError as err:
        raise ExportError(
            f"cannot read {path}: {err.strerror or err}; check the file's permissions"
        ) from err
    outputs = _onnx_output_names(path)
    in_graph = info.decisions is not None and info.decisions.in_graph
    expected = ["member_logits", *(UQ_OUTPUTS if info.uq_outputs else ())]
    if outputs is not None and in_graph:
        # hydra-calibrate --in-graph outputs come after the model's own: checked without them
        expected += [name for name in outputs if name in DECISION_OUTPUTS]
    if outputs is not None and outputs != expected:
        raise ExportError(
            f"hydra.json and model.onnx in {path.parent} disagree about the uncertainty outputs: "
            f"hydra.json has uq_outputs={info.uq_outputs!r} (outputs {expected}), model.onnx "
            f"has outputs {outputs}; the folder's files do not belong together: restore them or "
            "export the model again with hydra-export"
        )
    try:
        with _without_decisions(path, in_graph) as checked:
            if info.precision == "int8":  # approximate by design: within the INT8 tolerances
                _check_int8(checked, module, hydra.example_inputs)
            else:
                validate_onnx(checked, module, hydra.example_inputs, [2], precision=info.precision)
    except ExportError as err:
        raise ExportError(
            f"the model rebuilt from {path.parent} differs from its model.onnx ({err}); "
            "the folder's files do not belong together"
        ) from err
    except Exception as err:  # ONNX Runtime's own errors: a truncated or foreign model.onnx
        raise ExportError(
            f"ONNX Runtime cannot load {path} ({type(err).__name__}: {str(err).strip()}); is the "
            "file complete? restore it or export the model again with hydra-export"
        ) from err


def _check_int8(path: Path, module, example_inputs) -> None:
    """An INT8 file has no exact float twin: it must stay within parity's INT8 tolerances of the
    rebuilt FP32 model on its example inputs (weights from another model are far outside)."""
    report = check_int8_against_model(path, module, example_inputs)
    if not report.passed:
        raise ExportError(
            "the int8 file is beyond the int8 tolerances of the saved weights: "
            + "; ".join(report.failures()[:3])
        )


@contextlib.contextmanager
def _without_decisions(path: Path, in_graph: bool) -> Iterator[Path]:
    """``path``, or with ``in_graph`` a temporary copy of it without the decisions
    ``hydra-calibrate --in-graph`` added (the rebuilt model computes none)."""
    if not in_graph:
        yield path
        return
    with tempfile.TemporaryDirectory() as folder:
        stripped = Path(folder) / path.name
        onnx.save(decision_graph.remove_decisions(onnx.load(str(path))), str(stripped))
        yield stripped


def _onnx_output_names(path: Path) -> list[str] | None:
    """The graph's output names; None when the file does not parse (ONNX Runtime reports it)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a truncated or foreign file: the session below says what is wrong
        return None
    return [output.name for output in model.graph.output]
