"""The fused Hydra BERT: M head-pruned BERT classifiers (maybe fine-tuned) in one network.

BERT is post-LayerNorm: ``h = LN1(h + attn(h)); h = LN2(h + mlp(h))``. Every member has its own
residual stream ([S, B, N, D], see :mod:`hydra_deploy.fusion.layers`); all streams' kept heads run
as one attention call under the same key-padding mask (padded keys get no weight, exactly as in
transformers' eager and SDPA attention), so padding never changes the logits of the real tokens.
Embeddings (word + position + token type, LayerNorm), the pooler (dense + tanh on token 0) and the
classifier are shared when the members' weights are equal, per member otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from hydra_deploy.backbones import BackboneAdapter
from hydra_deploy.backbones.hf_bert import example_text_inputs
from hydra_deploy.errors import FusionError
from hydra_deploy.fusion.grouped import GroupedLinear
from hydra_deploy.fusion.layers import FusedAttention, all_equal
from hydra_deploy.fusion.model import HydraModel


class BertEmbedding(nn.Module):
    """Word + absolute position + token-type embeddings, then LayerNorm (inference semantics)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.word_embeddings = copy.deepcopy(embeddings.word_embeddings)
        self.position_embeddings = copy.deepcopy(embeddings.position_embeddings)
        self.token_type_embeddings = copy.deepcopy(embeddings.token_type_embeddings)
        self.norm = copy.deepcopy(embeddings.LayerNorm)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # [1, N]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.norm(x + self.position_embeddings(positions))  # [B, N, D]


class FusedPostNormBlock(nn.Module):
    """Post-norm Transformer layer over S streams: x = norm1(x + attn(x)); norm2(x + mlp(x))."""

    def __init__(
        self, attn: FusedAttention, norm1: nn.Module, mlp: nn.Module, norm2: nn.Module
    ) -> None:
        super().__init__()
        self.attn, self.norm1, self.mlp, self.norm2 = attn, norm1, mlp, norm2

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:  # [S, B, N, D]
        x = self.norm1(x + self.attn(x, key_mask))
        return self.norm2(x + self.mlp(x))


class StreamLinear(nn.Module):
    """A linear map [S, ..., in] -> [S, ..., out], shared by all streams or one per stream."""

    def __init__(self, linears: Sequence[nn.Linear], lowering: str) -> None:
        super().__init__()
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        self.per_stream = not (all_equal(weights) and all_equal(biases))
        if self.per_stream:
            bias = None if biases[0] is None else torch.stack([b.detach() for b in biases])
            weight = torch.stack([w.detach() for w in weights]).transpose(1, 2)  # [S, in, out]
            self.linear = GroupedLinear.from_weights(weight, bias, lowering)
        else:
            self.linear = copy.deepcopy(linears[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def padding_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive key-padding mask [B, N]: 0 for tokens, the dtype's most negative value for padding.

    Added to the attention scores before the softmax it gives padded keys exactly zero weight (as
    transformers' masks do). An additive float mask, not a boolean one, keeps the exported graph
    MatMul -> Add -> Softmax -> MatMul (a boolean mask makes the exporter add a NaN guard after the
    Softmax); a row with no token at all gets uniform weights instead of NaN.
    """
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(attention_mask == 0, torch.finfo(dtype).min)


def _tracing() -> bool:
    """True while torch.jit traces or torch.export / torch.compile capture the forward."""
    compiler = torch.compiler
    return bool(
        torch.jit.is_tracing()
        or compiler.is_compiling()
        or (hasattr(compiler, "is_exporting") and compiler.is_exporting())
    )


def _embedding_tensors(embeddings: nn.Module) -> list[torch.Tensor]:
    return [
        embeddings.word_embeddings.weight,
        embeddings.position_embeddings.weight,
        embeddings.token_type_embeddings.weight,
        *embeddings.LayerNorm.parameters(),
    ]


class HydraBert(HydraModel):
    """Fused Hydra BERT.

    ``forward(input_ids, attention_mask=None, token_type_ids=None)`` (all [B, N] integers; no mask
    means no padding, no token types means segment 0) -> member logits [B, M, C].
    """

    family = "bert"

    def _fuse(self, members: Sequence[BackboneAdapter], shared_trunk: bool) -> None:
        M, lowering = self.num_members, self.lowering
        first_adapter = members[0]
        models = [member.module for member in members]
        first = models[0]
        self.input_names = tuple(first_adapter.input_names)
        self.dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in self.input_names}
        self.preprocessing = None
        self.tokenizer_dir = first_adapter.tokenizer_dir
        self.class_names = first_adapter.class_names  # config.id2label (None: LABEL_i defaults)
        self.backbone_config = first.config.to_dict()
        self.backbone_kwargs = first_adapter.backbone_kwargs()  # rebuild_bert(backbone_kwargs)
        self.max_position = first_adapter.max_position
        self.seq_len = first_adapter.seq_len
        self.vocab_size = first_adapter.vocab_size
        self.pad_token_id = first_adapter.pad_token_id
        self.type_vocab_size = first_adapter.type_vocab_size

        # embeddings shared when every member has the same weights; a shared trunk while all
        # members' layers are identical, then M streams
        embeddings = [model.bert.embeddings for model in models]
        embed_shared = self._fuse_embeddings(embeddings, _embedding_tensors, BertEmbedding)
        stack = self._fuse_layers(members, shared_trunk and embed_shared, FusedPostNormBlock)

        # pooler (dense + tanh on token 0) and classifier
        self.pooler = StreamLinear([model.bert.pooler.dense for model in models], lowering)
        self.classifier = StreamLinear([model.classifier for model in models], lowering)
        head_per_member = self.pooler.per_stream or self.classifier.per_stream
        self.final_shared = not head_per_member
        final_streams = M if (self.blocks or head_per_member) else 1

        self.merge = {
            **stack.merge(embed_shared),
            "pooler": "per-member" if self.pooler.per_stream else "shared",
            "classifier": "per-member" if self.classifier.per_stream else "shared",
        }
        self._count_macs(first_adapter, stack, embed_shared, final_streams)
        self.macs_seq_len = first_adapter.seq_len  # the sequence length the MACs are counted at

    # ---------------------------------------------------------------------------------------------
    def example_inputs(
        self, batch_size: int = 2, seed: int = 0, seq_len: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Random int64 inputs in ``input_names`` order, with padding (seeded), for tracing.

        ``seq_len`` defaults to the backbone's ``seq_len`` (the length the MACs count).
        """
        inputs = example_text_inputs(self, batch_size, seed, seq_len)
        return tuple(inputs[name] for name in self.input_names)

    def _check_inputs(self, input_ids, attention_mask, token_type_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else "?"
            raise FusionError(f"input_ids must be a [batch, seq] integer tensor, got {shape}")
        if input_ids.shape[1] > self.max_position:
            raise FusionError(
                f"sequences of {input_ids.shape[1]} tokens exceed the model's {self.max_position} "
                "positions; truncate them"
            )
        for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if value is not None and value.shape != input_ids.shape:
                raise FusionError(
                    f"{name} has shape {list(value.shape)}, input_ids {list(input_ids.shape)}; "
                    "they must match"
                )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not _tracing():  # shape checks would become guards on the dynamic axes
            self._check_inputs(input_ids, attention_mask, token_type_ids)
        M = self.num_members
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        dtype = (self.embed or self.member_embeds[0]).word_embeddings.weight.dtype
        key_mask = None if attention_mask is None else padding_bias(attention_mask, dtype)
        x = self.encode(input_ids, token_type_ids, key_mask=key_mask)  # [S, B, N, D]
        pooled = torch.tanh(self.pooler(x[:, :, 0]))  # [S, B, D]: token 0
        logits = self.classifier(pooled)  # [S, B, C]
        if logits.shape[0] != M:
            logits = logits.expand(M, -1, -1)
        return logits.transpose(0, 1)  # [B, M, C]
