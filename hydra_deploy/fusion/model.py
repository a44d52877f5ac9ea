"""HydraModel: M members in one network, and ``fuse`` which builds it from a backbone and a spec."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.backbones.base import MustMatch, random_pixel_values
from hydra_deploy.errors import BackboneError, FusionError, SpecError, counted
from hydra_deploy.families import get_family
from hydra_deploy.fusion.grouped import DEFAULT_LOWERING
from hydra_deploy.fusion.layers import FusedBlock, LayerStack, embeddings_shared, fused_layer
from hydra_deploy.specs import HydraSpec

#: block roles whose weights must match in every member for a layer to join the shared trunk
#: (with ``mlp_merge="grouped"`` the MLP's ``fc1`` and ``fc2`` too)
_TRUNK_ROLES = ("norm1", "norm2", "ls1", "ls2")


def check_same_architecture(members: Sequence[BackboneAdapter]) -> None:
    """Members must be one architecture (they may differ in weight values only).

    Compares every member's architecture signature, as its family declares it (the registry's
    ``architecture``: {what: value}), with member 0's; the first entry that differs is named in
    the error, with the keys that differ when it is a mapping (config entries, weight names).
    """
    family = get_family(members[0].family)
    signature = family.resolve("architecture")
    reference = signature(members[0])
    for index, member in enumerate(members[1:], start=1):
        for what, value in signature(member).items():
            expected = reference.get(what)
            fix = f"members must be copies of one {family.name} backbone that differ only in weight values"
            if isinstance(value, MustMatch):
                fix, value = value.fix, value.value
                expected = expected.value if isinstance(expected, MustMatch) else expected
            if not _same(value, expected):
                raise FusionError(
                    f"member {index} is not the same architecture as member 0: its {what} "
                    f"differ{_differing_keys(value, expected)}; {fix}"
                )


def _same(a: Any, b: Any) -> bool:
    """Equality of signature values: tensors by shape, dtype and values, containers by entry."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _differing_keys(value: Any, expected: Any) -> str:
    """`` (key, key, ...)``: the first entries two mappings differ in ("" for other values)."""
    if not (isinstance(value, Mapping) and isinstance(expected, Mapping)):
        return ""
    keys = [k for k in value if k not in expected or not _same(value[k], expected[k])]
    keys += [k for k in expected if k not in value]
    return f" ({', '.join(map(str, keys[:4]))})"


class HydraModel(nn.Module):
    """Base of the fused networks: forward(...) -> member logits [B, M, C].

    Attributes every family sets: ``spec`` (the HydraSpec it implements), ``family``,
    ``num_members``, ``num_classes``, ``trunk_layers`` (leading layers computed once), ``merge``
    (how non-attention weights were merged, per component) and the analytic multiply-accumulate
    counts in ``macs`` ("hydra", "single", "deep_ensemble"; per example).

    A family's fused model fills in :meth:`_fuse`, with the steps below (:meth:`_fuse_embeddings`,
    :meth:`_fuse_layers` from the family registry's block layout, :meth:`_count_macs`); members
    are checked by :func:`check_same_architecture` against the family's declared signature, and
    this constructor does the rest.
    """

    spec: HydraSpec
    family: str
    num_members: int
    num_classes: int
    trunk_layers: int
    merge: dict[str, Any]
    macs: dict[str, int]

    def __init__(
        self,
        members: Sequence[BackboneAdapter],
        spec: HydraSpec,
        lowering: str = DEFAULT_LOWERING,
        shared_trunk: bool = True,
    ) -> None:
        """Fuse ``members`` (adapters of this family; :func:`fuse` builds them) as ``spec`` says;
        ``lowering`` and ``shared_trunk`` as in :func:`fuse`."""
        super().__init__()
        self.check_members(members)
        self.spec = spec
        self.num_members = spec.num_members
        self.num_classes = members[0].num_classes
        self.lowering = lowering
        self._fuse(members, shared_trunk)
        self.eval()

    #: raise FusionError unless the members can be fused (one architecture, what they share)
    check_members = staticmethod(check_same_architecture)

    def _fuse(self, members: Sequence[BackboneAdapter], shared_trunk: bool) -> None:
        """Build the family's components from the members (``spec``, ``lowering`` are set)."""
        raise NotImplementedError

    # --- the steps of a family's _fuse, in this order -----------------------------------------------
    def _fuse_embeddings(
        self,
        sources: Sequence[Any],
        tensors: Callable[[Any], Sequence[torch.Tensor | None]],
        embedding: Callable[[Any], nn.Module],
    ) -> bool:
        """``embed``: one ``embedding(source)`` when every member's embedding ``tensors(source)`` are
        equal, else ``member_embeds``: one per member. Returns whether they are shared."""
        shared = embeddings_shared([tensors(source) for source in sources])
        self.embed = embedding(sources[0]) if shared else None
        self.member_embeds = None if shared else nn.ModuleList(embedding(s) for s in sources)
        return shared

    def _fuse_layers(
        self,
        members: Sequence[BackboneAdapter],
        shared_trunk: bool,
        block_class: Callable[..., nn.Module] = FusedBlock,
    ) -> LayerStack:
        """``trunk`` (leading layers every member shares, computed once), then ``blocks`` (M
        streams) of ``block_class`` (:func:`~hydra_deploy.fusion.layers.fused_layer`), from the
        layers and their parts the family registry declares (``member_layout``)."""
        layout = get_family(self.family).member_layout
        parts: Mapping[str, str] = layout["block_parts"]
        spec, lowering = self.spec, self.lowering
        identical = [parts[role] for role in _TRUNK_ROLES if role in parts]
        if spec.mlp_merge == "grouped":
            identical += [parts["fc1"], parts["fc2"]]
        stack = LayerStack(
            members,
            spec,
            layer_blocks=lambda layer: [
                member.module.get_submodule(layout["block"].format(layer)) for member in members
            ],
            identical_modules=identical,
            fused_block=lambda blocks, weights, heads: fused_layer(
                blocks, weights, heads, parts, spec.mlp_merge, lowering, block_class
            ),
            shared_trunk=shared_trunk,
        )
        self.trunk, self.blocks = stack.trunk, stack.blocks
        self.trunk_layers = len(stack.trunk)
        return stack

    def _count_macs(
        self,
        member: BackboneAdapter,
        stack: LayerStack,
        embed_shared: bool,
        final_streams: int,
    ) -> None:
        """``macs`` per example: the fused model's, one member's and M members' run one by one."""
        single = member.macs()
        embed_streams = 1 if embed_shared else self.num_members
        self.macs = {
            "hydra": member.macs(stack.layer_heads, embed_streams, final_streams),
            "single": single,
            "deep_ensemble": self.num_members * single,
        }

    # --- forward ------------------------------------------------------------------------------------
    def encode(self, *embed_inputs: torch.Tensor, **block_kwargs: Any) -> torch.Tensor:
        """Embeddings (shared, or one per member), the shared trunk once, then the members' streams.

        Returns the hidden states [S, B, N, D]: S = M after the split, 1 when every layer and the
        final components are shared. ``block_kwargs`` go to every block (BERT's padding mask).
        """
        M = self.num_members
        if self.embed is not None:
            x = self.embed(*embed_inputs).unsqueeze(0)  # [1, B, N, D]
        else:
            x = torch.stack([embed(*embed_inputs) for embed in self.member_embeds])  # [M, B, N, D]
        for block in self.trunk:  # computed once for all members
            x = block(x, **block_kwargs)
        if x.shape[0] != M and (self.blocks or not self.final_shared):
            x = x.expand(M, -1, -1, -1)  # the members split here
        for block in self.blocks:
            x = block(x, **block_kwargs)  # [M, B, N, D]
        return x

    def example_inputs(self, batch_size: int = 2, seed: int = 0) -> Any:
        """Vision models: random ``pixel_values`` [batch, *input_size] (seeded), for tracing and
        validation (a text model gives its own inputs)."""
        return random_pixel_values(batch_size, seed, self.input_size)

    def check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        """Vision models: ``pixel_values`` must be [batch, *input_size]."""
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != self.input_size:
            raise FusionError(
                f"pixel_values must be [batch, {', '.join(map(str, self.input_size))}], got "
                f"{list(pixel_values.shape)}; resize the images to the backbone's input size"
            )

    def num_parameters(self) -> int:
        """Stored parameters (padding zeros of heads included)."""
        return sum(p.numel() for p in self.parameters())

    def per_member_parts(self) -> list[str]:
        """The components of ``merge`` stored once per member (the rest are stored once)."""
        return [k for k, v in self.merge.items() if isinstance(v, str) and "per-member" in v]

    def parameters_line(self) -> str:
        """Parameters, their ratio to one member's, and what is stored per member."""
        line = f"{self.num_parameters():,} parameters"
        single = getattr(self, "single_parameters", None)
        if single:
            line += f" ({self.num_parameters() / single:.2f} x the single model's {single:,})"
        per_member = self.per_member_parts()
        return line + (f"; per member: {', '.join(per_member)}" if per_member else "")

    def summary(self) -> str:
        macs = self.macs
        members = f"{self.num_members} member{'s' * (self.num_members != 1)}"
        lines = [
            f"HydraModel ({self.family}, {self.spec.backbone}): {members}, "
            f"{counted(self.num_classes, 'class')}, shared trunk of "
            f"{counted(self.trunk_layers, 'layer')}",
            "merge: " + ", ".join(f"{k}={v}" for k, v in self.merge.items()),
            f"parameters: {self.parameters_line()}",
            f"GMACs per example: hydra {macs['hydra'] / 1e9:.3f}, single {macs['single'] / 1e9:.3f} "
            f"({macs['hydra'] / macs['single']:.2f} x), deep ensemble {macs['deep_ensemble'] / 1e9:.3f} "
            f"({macs['deep_ensemble'] / macs['single']:.2f} x)",
        ]
        return "\n".join(lines)


def fuse(
    backbone_or_members: BackboneAdapter | nn.Module | str | Sequence[BackboneAdapter | nn.Module],
    spec: HydraSpec,
    mlp_merge: str | None = None,
    *,
    lowering: str = DEFAULT_LOWERING,
    shared_trunk: bool = True,
) -> HydraModel:
    """Fuse M members into one network whose forward returns member logits [B, M, C].

    ``backbone_or_members``: one backbone (every member starts from its weights) or a sequence of M
    members (e.g. fine-tuned separately; weights may differ everywhere), each an adapter or a
    module ``load_backbone`` wraps. ``spec`` says which heads each member keeps. ``mlp_merge``
    (default: the spec's): ``"average"`` shares one MLP holding the members' mean weights,
    ``"grouped"`` keeps every member's own MLP (the exact ensemble). ``lowering`` picks how the
    grouped projections run (see :mod:`hydra_deploy.fusion.grouped`); ``shared_trunk`` computes
    leading layers where all members are identical once.
    """
    if not isinstance(spec, HydraSpec):
        raise SpecError(
            f"fuse expects a HydraSpec, got {type(spec).__name__}; see HydraSpec.from_json"
        )
    mlp_merge = spec.mlp_merge if mlp_merge is None else mlp_merge
    if mlp_merge not in ("average", "grouped"):
        raise FusionError(f"unknown mlp_merge {mlp_merge!r}; choose 'average' or 'grouped'")
    if mlp_merge != spec.mlp_merge:
        spec = spec.replace(mlp_merge=mlp_merge)

    if isinstance(backbone_or_members, (list, tuple)):
        members = [load_backbone(m) for m in backbone_or_members]
        if len(members) != spec.num_members:
            raise FusionError(
                f"got {counted(len(members), 'member model')} but the spec has "
                f"{counted(spec.num_members, 'member')}; "
                "pass one model per member, or a single backbone shared by all"
            )
    else:
        members = [load_backbone(backbone_or_members)] * spec.num_members
    families = {m.family for m in members}
    if len(families) != 1:
        raise FusionError(f"members come from different families {sorted(families)}")
    members[0].check_spec(spec, "fuse")

    family = families.pop()
    try:
        fused_class = get_family(family).resolve("fused_class")
    except BackboneError as err:
        raise FusionError(f"fusion is not implemented for the {family!r} family: {err}") from None
    hydra = fused_class(members, spec, lowering=lowering, shared_trunk=shared_trunk)
    hydra.single_parameters = members[0].num_parameters()  # the plain model, for the ratio
    return hydra
