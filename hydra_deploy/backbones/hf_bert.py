"""Adapter over Hugging Face ``transformers`` BERT classifiers (``BertForSequenceClassification``).

A bare encoder (``BertModel``, e.g. the sentence-transformers MiniLM) becomes a classifier: a
``BertForSequenceClassification`` built from its config holds its weights and a new, seeded random
classifier (logged). Other encoders (RoBERTa, DistilBERT, ...) are refused with
:class:`UnsupportedModelError`: their position ids or module layout differ from BERT's.

Head gates: transformers v5 removed head masking, so the adapter owns its gates: a forward pre-hook
on each layer's ``attention.output.dense`` scales that projection's input, the concatenated head
outputs [B, N, H*hd], head by head (see :meth:`BackboneAdapter.head_gates`).

Inputs: a dict ``{"input_ids", "attention_mask"[, "token_type_ids"]}``, a tuple in that order, a
bare ``input_ids`` tensor [B, N] (no padding), or one stacked int64 tensor [B, 2 or 3, N] (the
three in that order; a tensor slices along the batch like an image batch does). Padding is marked
by ``attention_mask == 0`` and never changes the logits of the real tokens.

Loading never downloads: ``hf:<folder>`` must be a local folder (``model.save_pretrained(folder)``
or a hub snapshot already on disk).

Class names: the checkpoint's ``config.id2label`` (``adapter.class_names``; None when it holds
transformers' default ``LABEL_0, LABEL_1, ...``). The fused model and its export record them.

The adapter leaves its settings (name, weights source, tokenizer folder, ``seq_len``) on the module
(:data:`ADAPTER_SETTINGS`), so wrapping a copy of ``adapter.module`` again (a fine-tuned member,
``load_backbone(copy.deepcopy(adapter.module))``) gives an adapter with the same settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hydra_deploy.backbones.base import AttentionWeights, BackboneAdapter, weight_shapes
from hydra_deploy.backbones.checkpoint import load_into, read_state_dict
from hydra_deploy.errors import (
    BackboneError,
    CheckpointError,
    FinetuneError,
    UnsupportedModelError,
    counted,
    spelled,
)
from hydra_deploy.families import get_family
from hydra_deploy.labels import class_names_from_id2label
from hydra_deploy.optional import lazy_module

transformers = lazy_module(
    "transformers", purpose="the bert family (Hugging Face BERT models)", error=BackboneError
)

logger = logging.getLogger("hydra_deploy")

#: ``config.model_type`` values the adapter (and the fused model) implement: the bert family's
#: ``model_types`` in the registry (a folder of one of them is loaded by this module).
SUPPORTED_MODEL_TYPES = get_family("bert").model_types
#: Sequence length ``macs()`` counts (and ``example_inputs`` uses) unless told otherwise.
DEFAULT_SEQ_LEN = 128
#: Files of a tokenizer that an export copies beside the model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
#: Keyword arguments ``load_bert`` / ``wrap_bert`` accept.
LOAD_KWARGS = ("seq_len", "seed", "tokenizer_dir", "new_classifier")
#: The module attribute where an adapter leaves its settings for the next wrap of (a copy of) it.
ADAPTER_SETTINGS = "hydra_adapter_settings"

TextInputs = Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor
#: the inputs of a BERT, in their order (a stacked tensor's channels, a tuple's items)
TEXT_INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


def check_text_keys(inputs: Mapping[str, Any], error: type[Exception], where: str = "") -> None:
    """Refuse (with ``error``, ``where`` before the message) a mapping of text inputs without
    ``input_ids`` or with other keys than :data:`TEXT_INPUT_NAMES`."""
    unknown = sorted(set(inputs) - set(TEXT_INPUT_NAMES))
    if unknown or "input_ids" not in inputs:
        raise error(
            f"{where}text inputs need 'input_ids' (and optionally 'attention_mask', "
            f"'token_type_ids'); got keys {sorted(inputs)}"
        )


# --- loading ---------------------------------------------------------------------------------------
def load_bert(
    source: str | os.PathLike,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    **kwargs: Any,
) -> HfBertAdapter:
    """A BERT classifier from a local Hugging Face folder (``config.json`` + weights).

    ``checkpoint``: optional weights (a ``.safetensors``/``.bin`` state dict or a folder) loaded
    over the folder's. ``num_classes``: the classifier's size; required when the folder holds a
    bare encoder (which then gets a new, seeded random classifier). A folder holding a classifier
    keeps it: a ``num_classes`` other than its size is refused unless ``new_classifier=True``,
    which replaces it by a new random one of ``num_classes`` classes (its class names dropped).
    Keyword arguments: ``seq_len`` (the length ``macs()`` counts, default 128), ``seed`` (of a
    new random classifier, default 0), ``tokenizer_dir`` (default: the folder, when it holds one),
    ``new_classifier`` (default False).
    """
    _check_kwargs(kwargs)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        given_as = spelled("load_backbone('hf:<folder>')", "--backbone hf:<folder>")
        raise BackboneError(
            f"hf:{source} is not a local folder; hydra-deploy never downloads models. Save the model "
            "first (model.save_pretrained(folder), or `hf download <name> --local-dir folder`) and "
            f"pass {given_as}, or pass a transformers module"
        )
    if not (folder / "config.json").is_file():
        raise BackboneError(
            f"folder {str(folder)!r} is not a Hugging Face model folder: it has no config.json. Pass "
            "the folder that model.save_pretrained() wrote (config.json + model.safetensors)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # unknown model_type, malformed JSON, ...
        raise BackboneError(
            f"cannot read {str(folder / 'config.json')!r} as a transformers config "
            f"({type(err).__name__}: {str(err)[:200]}); pass a folder written by save_pretrained()"
        ) from err
    _check_model_type(config, str(folder))
    module = _load_folder(
        folder, config, num_classes, kwargs.get("seed", 0), bool(kwargs.get("new_classifier"))
    )
    if checkpoint is not None:
        _load_checkpoint(module, checkpoint)
    tokenizer_dir = kwargs.get("tokenizer_dir")
    if tokenizer_dir is None and any((folder / name).is_file() for name in TOKENIZER_FILES):
        tokenizer_dir = str(folder)
    weights = str(checkpoint) if checkpoint is not None else str(folder)
    return HfBertAdapter(
        module,
        name=f"hf:{source}",
        weights=weights,
        tokenizer_dir=tokenizer_dir,
        seq_len=kwargs.get("seq_len"),
    )


def wrap_bert(
    module: nn.Module,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    **kwargs: Any,
) -> HfBertAdapter:
    """An adapter over a built transformers model (``BertForSequenceClassification`` or
    ``BertModel``; a ``BertModel`` needs ``num_classes`` and gets a seeded random classifier).

    The module given is used as is (not copied) when it is already a classifier, unless
    ``new_classifier=True`` (with ``num_classes``): then its encoder gets a new random classifier.
    A module an adapter was made over (or a copy of it) keeps that adapter's name, weights source,
    tokenizer folder and ``seq_len`` unless the keyword arguments say otherwise.
    """
    _check_kwargs(kwargs)
    config = getattr(module, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} has no transformers config; pass a BertForSequenceClassification"
        )
    _check_model_type(config, type(module).__name__)
    new_classifier = bool(kwargs.get("new_classifier"))
    if isinstance(module, transformers.BertForSequenceClassification) and new_classifier:
        _need_num_classes(num_classes)
        model = _classifier_from_encoder(
            module.bert, num_classes, kwargs.get("seed", 0), keep_names=False
        )
    elif isinstance(module, transformers.BertForSequenceClassification):
        if num_classes is not None and num_classes != module.num_labels:
            raise BackboneError(
                f"the model's classifier has {module.num_labels} classes, not "
                f"num_classes={num_classes}; leave num_classes None to keep it, or pass "
                "new_classifier=True for a new random classifier of num_classes classes"
            )
        model = module
    elif isinstance(module, transformers.BertModel):
        model = _classifier_from_encoder(module, num_classes, kwargs.get("seed", 0))
    else:
        raise UnsupportedModelError(
            f"{type(module).__name__} is not supported: the bert family takes "
            "BertForSequenceClassification, or a BertModel with num_classes"
        )
    # the settings of the adapter this module (or the module it was copied from) was wrapped in
    settings = dict(getattr(module, ADAPTER_SETTINGS, None) or {}) if model is module else {}
    weights = settings.get("weights", "module")
    if checkpoint is not None:
        _load_checkpoint(model, checkpoint)
        weights = str(checkpoint)
    name = settings.get("name") or (
        getattr(config, "_name_or_path", "") or (config.architectures or [type(module).__name__])[0]
    )
    tokenizer_dir = kwargs.get("tokenizer_dir", settings.get("tokenizer_dir"))
    seq_len = kwargs.get("seq_len", settings.get("seq_len"))
    return HfBertAdapter(
        model, name=name, weights=weights, tokenizer_dir=tokenizer_dir, seq_len=seq_len
    )


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(LOAD_KWARGS))
    if unknown:
        raise BackboneError(
            f"unknown keyword arguments {unknown} for a BERT backbone; accepted: {', '.join(LOAD_KWARGS)}"
        )


def _check_model_type(config: Any, what: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedModelError(
            f"{what}: model_type {model_type!r} (architectures: {archs}) is not supported; the bert "
            f"family implements model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))} "
            "(BertForSequenceClassification or BertModel)"
        )


def _check_num_classes(num_classes: Any) -> int:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise BackboneError(f"num_classes must be a positive integer, got {num_classes!r}")
    return num_classes


def _need_num_classes(num_classes: Any) -> None:
    if num_classes is None:
        raise BackboneError(
            spelled("new_classifier=True needs num_classes", "--new-head needs --num-classes N")
            + " (the new classifier's size)"
        )


def _load_folder(
    folder: Path, config: Any, num_classes: int | None, seed: int, new_classifier: bool = False
) -> nn.Module:
    """The folder's model as a classifier (its own, or a new one over its encoder)."""
    if new_classifier:
        _need_num_classes(num_classes)
    if num_classes is not None:
        _check_num_classes(num_classes)
    archs = getattr(config, "architectures", None) or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if is_classifier and not new_classifier and num_classes not in (None, config.num_labels):
        raise BackboneError(
            f"{str(folder)!r} holds a classifier of {counted(config.num_labels, 'class')}, not "
            f"{spelled(f'num_classes={num_classes}', f'--num-classes {num_classes}')}; leave "
            f"{spelled('num_classes', '--num-classes')} out to keep the trained classifier, or "
            f"pass {spelled('new_classifier=True', '--new-head')} to replace it by a new random "
            f"one of {counted(num_classes, 'class')}"
        )
    try:
        if is_classifier and not new_classifier:
            classifier = transformers.BertForSequenceClassification
            return _from_pretrained(classifier, folder).eval()
        encoder = _from_pretrained(transformers.BertModel, folder)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"cannot load the weights of {str(folder)!r} ({type(err).__name__}: {str(err)[:300]}); "
            "does the folder hold model.safetensors or pytorch_model.bin?"
        ) from err
    if num_classes is None:
        raise BackboneError(
            f"{str(folder)!r} holds a {archs[0] if archs else 'BERT'} without a sequence classifier; "
            "pass num_classes to add a (random) classifier"
        )
    return _classifier_from_encoder(encoder, num_classes, seed, keep_names=not is_classifier)


def _from_pretrained(cls: Any, folder: Path) -> nn.Module:
    """``cls.from_pretrained(folder)`` without transformers' "Loading weights" progress bar and its
    load-report table: weights the checkpoint lacks (left random) are one warning line, weights
    it holds beyond the model one info line."""
    hf_logging = transformers.utils.logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model, info = cls.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    if missing:
        logger.warning(
            "%s: %d weights are not in the checkpoint and stay random (%s%s)",
            folder,
            len(missing),
            ", ".join(missing[:4]),
            ", ..." if len(missing) > 4 else "",
        )
    if unexpected:
        logger.info(
            "%s: %d checkpoint weights are not used by %s (%s%s)",
            folder,
            len(unexpected),
            cls.__name__,
            ", ".join(unexpected[:4]),
            ", ..." if len(unexpected) > 4 else "",
        )
    return model


def _classifier_from_encoder(
    encoder: nn.Module, num_classes: int | None, seed: int, keep_names: bool = True
) -> nn.Module:
    """``BertForSequenceClassification`` holding ``encoder``'s weights and a seeded random head.

    ``keep_names``: keep the class names of the encoder's config (an encoder-only folder may name
    its classes in ``id2label``); False when the encoder's classifier is being replaced.
    """
    if num_classes is None:
        raise BackboneError(
            f"{type(encoder).__name__} has no classifier; pass num_classes to add a random one"
        )
    _check_num_classes(num_classes)
    config = type(encoder.config).from_dict(encoder.config.to_dict())
    config.num_labels = num_classes  # keeps id2label only when it has num_classes entries
    if not keep_names:  # the names of the classifier being replaced
        config.id2label = {i: f"LABEL_{i}" for i in range(num_classes)}
        config.label2id = {name: i for i, name in config.id2label.items()}
    config.architectures = ["BertForSequenceClassification"]
    model = transformers.BertForSequenceClassification(config)
    missing, _ = model.bert.load_state_dict(encoder.state_dict(), strict=False)
    if missing:  # a BertModel built with add_pooling_layer=False has no pooler
        logger.warning("%s: no weights for %s; they stay random", type(encoder).__name__, missing)
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        weight = model.classifier.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * std)
        model.classifier.bias.zero_()
    logger.warning(
        "%s: a new random classifier with %d classes (seed %d); fine-tune it or load a checkpoint",
        getattr(config, "_name_or_path", "") or type(encoder).__name__,
        num_classes,
        seed,
    )
    return model.to(next(encoder.parameters()).dtype).eval()


def _load_checkpoint(model: nn.Module, checkpoint: str | os.PathLike) -> None:
    """Load a classifier's or an encoder's state dict (with or without the ``bert.`` prefix)."""
    state_dict = read_state_dict(checkpoint)
    own = model.state_dict()
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("position_ids")}
    if not any(k.startswith("bert.") for k in state_dict):  # an encoder's keys
        state_dict = {(k if k in own else f"bert.{k}"): v for k, v in state_dict.items()}
        kept = [k for k in own if k not in state_dict and k.startswith("classifier.")]
        if kept:
            logger.warning("checkpoint %s has no classifier; it stays as it is", checkpoint)
            state_dict.update({k: own[k] for k in kept})
    load_into(model, state_dict, str(checkpoint))


def rebuild_bert(backbone_kwargs: Mapping[str, Any]) -> HfBertAdapter:
    """An adapter of a recorded architecture (``HydraBert.backbone_kwargs``), placeholder weights.

    For reloading an export folder: build, fuse, then load the saved state dict.
    """
    try:
        config = transformers.BertConfig.from_dict(dict(backbone_kwargs["config"]))
    except (KeyError, TypeError, ValueError) as err:
        raise BackboneError(
            f"cannot rebuild a BERT from {str(backbone_kwargs)[:200]}: {err}"
        ) from err
    _check_model_type(config, "the recorded backbone")
    torch_dtype = getattr(torch, str(backbone_kwargs.get("dtype", "float32")), torch.float32)
    model = transformers.BertForSequenceClassification(config).to(torch_dtype)
    return HfBertAdapter(
        model,
        name=backbone_kwargs.get("name"),
        weights="export",
        seq_len=backbone_kwargs.get("seq_len"),
    )


def check_supported(model: nn.Module) -> None:
    """Raise UnsupportedModelError naming what the fused BERT cannot express in ``model``."""
    if not isinstance(model, transformers.BertForSequenceClassification):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a BertForSequenceClassification; use load_backbone / "
            "wrap_bert, which turn a BertModel into one"
        )
    config = model.config
    problems = []
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        problems.append("decoder / cross-attention (is_decoder=True)")
    if model.bert.pooler is None:
        problems.append("no pooler (add_pooling_layer=False)")
    position = getattr(config, "position_embedding_type", None)
    if position not in (None, "absolute"):
        problems.append(f"position_embedding_type={position!r} (only absolute)")
    for index, layer in enumerate(model.bert.encoder.layer):
        attn = layer.attention.self
        self_attention = transformers.models.bert.modeling_bert.BertSelfAttention
        if type(attn) is not self_attention or hasattr(attn, "distance_embedding"):
            problems.append(f"layer {index}: attention {type(attn).__name__} is not BERT's")
        if getattr(layer, "crossattention", None) is not None:
            problems.append(f"layer {index}: cross-attention")
    if config.problem_type not in (None, "single_label_classification"):
        problems.append(f"problem_type={config.problem_type!r} (only single-label classification)")
    if problems:
        raise UnsupportedModelError(
            "this BERT uses features the fused Hydra BERT does not implement: "
            + "; ".join(problems)
        )


# --- the adapter -----------------------------------------------------------------------------------
class HfBertAdapter(BackboneAdapter):
    """A transformers ``BertForSequenceClassification`` seen through the common adapter interface.

    ``module`` is the transformers model itself (so ``load_backbone(copy.deepcopy(adapter.module))``
    gives the same adapter again); the adapter's :meth:`forward` returns logits [B, C].

    The hidden states between :meth:`embed`, :meth:`run_layers` and :meth:`classify` are one float
    tensor [B, N, D + 1]: the token states and, in the last channel, the attention mask (1.0 =
    token, 0.0 = padding), so slicing and concatenating it along the batch keeps both together.
    """

    family = "bert"
    shared_parameter_prefixes = ("bert.embeddings.", "bert.pooler.", "classifier.")
    embedding_parameter_prefixes = ("bert.embeddings.",)
    layer_parameter_prefix = "bert.encoder.layer.{}."

    def __init__(
        self,
        model: nn.Module,
        name: str | None = None,
        weights: str = "module",
        tokenizer_dir: str | os.PathLike | None = None,
        seq_len: int | None = None,
    ) -> None:
        check_supported(model)
        self.module = model.eval()
        config = model.config
        self.config = config
        self.name = name or getattr(config, "_name_or_path", "") or type(model).__name__
        self.weights = weights
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.embed_dim = config.hidden_size
        self.head_dim = self.embed_dim // self.num_heads
        self.num_classes = int(model.classifier.out_features)
        self.mlp_hidden = config.intermediate_size
        self.vocab_size = config.vocab_size
        self.max_position = config.max_position_embeddings
        self.type_vocab_size = config.type_vocab_size
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.seq_len = min(DEFAULT_SEQ_LEN, self.max_position) if seq_len is None else int(seq_len)
        if not 1 <= self.seq_len <= self.max_position:
            raise BackboneError(
                f"seq_len={seq_len} is outside 1..{self.max_position} (max_position_embeddings)"
            )
        self.num_tokens = self.seq_len  # tokens per example that Taylor importance averages over
        self.tokenizer_dir = None if tokenizer_dir is None else str(tokenizer_dir)
        #: class names by index from ``config.id2label`` (None: transformers' default LABEL_i)
        self.class_names = class_names_from_id2label(config.id2label, self.num_classes)
        self.input_names: tuple[str, ...] = ("input_ids", "attention_mask")
        if self.type_vocab_size > 1:
            self.input_names += ("token_type_ids",)
        # for the next wrap of this module or of a copy (fine-tuned members): see wrap_bert
        setattr(
            model,
            ADAPTER_SETTINGS,
            {
                "name": self.name,
                "weights": self.weights,
                "tokenizer_dir": self.tokenizer_dir,
                "seq_len": self.seq_len,
            },
        )

    def backbone_kwargs(self) -> dict[str, Any]:
        """What :func:`rebuild_bert` needs to rebuild this architecture (JSON-able)."""
        dtype = str(next(self.module.parameters()).dtype).removeprefix("torch.")
        return {
            "config": self.config.to_dict(),
            "name": self.name,
            "seq_len": self.seq_len,
            "dtype": dtype,
        }

    # --- inputs ------------------------------------------------------------------------------------
    def text_inputs(self, inputs: TextInputs) -> dict[str, torch.Tensor]:
        """Any accepted input form -> {"input_ids", "attention_mask", "token_type_ids"} [B, N]."""
        names = TEXT_INPUT_NAMES
        if isinstance(inputs, Mapping):
            check_text_keys(inputs, BackboneError)
            given = {k: v for k, v in inputs.items() if v is not None}
        elif isinstance(inputs, torch.Tensor) and inputs.dim() == 3:
            if inputs.shape[1] not in (2, 3):
                raise BackboneError(
                    f"a stacked text tensor is [batch, 2 or 3, seq], got {list(inputs.shape)}"
                )
            given = dict(zip(names, inputs.unbind(1), strict=False))
        elif isinstance(inputs, torch.Tensor):
            given = {"input_ids": inputs}
        elif isinstance(inputs, Sequence) and 1 <= len(inputs) <= 3:
            given = {k: v for k, v in zip(names, inputs, strict=False) if v is not None}
        else:
            raise BackboneError(
                f"cannot read text inputs from {type(inputs).__name__}; pass a dict with "
                "'input_ids', 'attention_mask'[, 'token_type_ids'] or a tuple in that order"
            )
        ids = torch.as_tensor(given["input_ids"])
        if ids.dim() != 2 or ids.dtype.is_floating_point:
            raise BackboneError(
                f"input_ids must be integer [batch, seq], got {ids.dtype} {list(ids.shape)}"
            )
        if ids.shape[1] > self.max_position:
            raise BackboneError(
                f"sequences of {ids.shape[1]} tokens exceed the model's {self.max_position} "
                "positions; truncate them (tokenizer(..., truncation=True, max_length=...))"
            )
        out = {"input_ids": ids.long()}
        for key in names[1:]:
            value = given.get(key)
            if value is None:  # no mask: every token is real; no token types: all segment 0
                fill = torch.ones_like if key == "attention_mask" else torch.zeros_like
                value = fill(out["input_ids"])
            value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(ids.shape):
                raise BackboneError(
                    f"{key} has shape {list(value.shape)}, input_ids {list(ids.shape)}; they must match"
                )
            out[key] = value.long()
        return out

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, inputs: TextInputs, head_mask: Any = None) -> torch.Tensor:
        """Logits [B, C]; with ``head_mask`` [L, H] the masked heads are off (member run alone)."""
        kwargs = self.text_inputs(inputs)
        if head_mask is None:
            return self.module(**kwargs).logits
        with self.head_gates(head_mask):
            return self.module(**kwargs).logits

    __call__ = forward

    def _gate_targets(self) -> list[nn.Module]:
        return [layer.attention.output.dense for layer in self.module.bert.encoder.layer]

    def embed(self, inputs: TextInputs) -> torch.Tensor:
        """Inputs -> packed hidden [B, N, D + 1] (embeddings, then the attention mask as 0/1)."""
        kwargs = self.text_inputs(inputs)
        states = self.module.bert.embeddings(
            input_ids=kwargs["input_ids"], token_type_ids=kwargs["token_type_ids"]
        )
        mask = kwargs["attention_mask"].to(states.dtype).unsqueeze(-1)
        return torch.cat([states, mask], dim=-1)

    @staticmethod
    def _unpack(hidden: torch.Tensor | tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(hidden, tuple):
            states, mask = hidden
            return states, mask.long()
        return hidden[..., :-1], hidden[..., -1].long()

    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Packed hidden entering layer ``start`` -> packed hidden leaving layer ``stop - 1``."""
        states, mask = self._unpack(hidden)
        extended = transformers.masking_utils.create_bidirectional_mask(
            config=self.config, inputs_embeds=states, attention_mask=mask
        )
        for layer in self.module.bert.encoder.layer[start:stop]:
            out = layer(states, extended)
            states = out[0] if isinstance(out, tuple) else out
        return torch.cat([states, mask.to(states.dtype).unsqueeze(-1)], dim=-1)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Packed hidden after the last layer -> logits (pooler on token 0, then classifier)."""
        states, _ = self._unpack(hidden)
        return self.module.classifier(self.module.bert.pooler(states))

    # --- weights in canonical layout ---------------------------------------------------------------
    def attention_weights(self, layer: int) -> AttentionWeights:
        attention = self.module.bert.encoder.layer[layer].attention
        H, hd, D = self.num_heads, self.head_dim, self.embed_dim

        def heads(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            bias = None if linear.bias is None else linear.bias.detach().view(H, hd)
            return linear.weight.detach().view(H, hd, D), bias

        (q, q_b), (k, k_b), (v, v_b) = (
            heads(attention.self.query),
            heads(attention.self.key),
            heads(attention.self.value),
        )
        dense = attention.output.dense
        return AttentionWeights(
            q=q,
            k=k,
            v=v,
            q_bias=q_b,
            k_bias=k_b,
            v_bias=v_b,
            proj=dense.weight.detach().view(D, H, hd),
            proj_bias=None if dense.bias is None else dense.bias.detach(),
        )

    def example_inputs(
        self, batch_size: int = 2, seed: int = 0, seq_len: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Random int64 text inputs [batch, seq] with padding (seeded).

        Row 0 fills the sequence; the other rows (or the only one) are shorter, padded at the end
        (``attention_mask`` 0, ``input_ids`` the pad id). ``token_type_ids`` (two segments) when the
        model uses them. ``seq_len`` defaults to the adapter's ``seq_len``.
        """
        return example_text_inputs(self, batch_size, seed, seq_len)

    # --- cost --------------------------------------------------------------------------------------
    def macs(
        self,
        layer_heads: Sequence[Sequence[int]] | None = None,
        embed_streams: int = 1,
        head_streams: int = 1,
        seq_len: int | None = None,
    ) -> int:
        """Multiply-accumulates per example of ``seq_len`` tokens (default: ``self.seq_len``).

        The layers' (:meth:`encoder_macs`, ``layer_heads``) and ``head_streams`` classifier heads,
        each its pooler (D x D) and classifier (D x C). Embeddings are lookups (no MACs;
        ``embed_streams`` is accepted for symmetry with the ViT).
        """
        del embed_streams
        D = self.embed_dim
        total = head_streams * (D * D + D * self.num_classes)
        tokens = self.seq_len if seq_len is None else seq_len
        return int(total) + self.encoder_macs(layer_heads, tokens)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", seq_len={self.seq_len})"


def example_text_inputs(
    model: Any, batch_size: int, seed: int, seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """:func:`random_text_inputs` for a BERT adapter or fused BERT ``model`` (its ``seq_len``,
    ``vocab_size``, ``pad_token_id``; token types when its ``type_vocab_size`` is over 1)."""
    return random_text_inputs(
        batch_size,
        seed=seed,
        seq_len=model.seq_len if seq_len is None else seq_len,
        vocab_size=model.vocab_size,
        pad_token_id=model.pad_token_id,
        with_token_types=model.type_vocab_size > 1,
    )


def random_text_inputs(
    batch_size: int,
    *,
    seed: int,
    seq_len: int,
    vocab_size: int,
    pad_token_id: int = 0,
    with_token_types: bool = True,
) -> dict[str, torch.Tensor]:
    """Seeded random token ids with per-row lengths; every row but the first is padded when
    ``batch_size > 1`` (the only row, when 1), unless ``seq_len`` is 1."""
    if batch_size < 1 or seq_len < 1:
        raise BackboneError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max(seq_len, 2), (batch_size,), generator=generator).clamp(
        max=seq_len
    )
    if batch_size > 1:
        lengths[0] = seq_len
    positions = torch.arange(seq_len).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)).long()
    low = 1 if vocab_size > 1 else 0
    ids = torch.randint(low, vocab_size, (batch_size, seq_len), generator=generator)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_token_id))
    out = {"input_ids": ids, "attention_mask": mask}
    if with_token_types:
        split = (torch.rand(batch_size, 1, generator=generator) * lengths.unsqueeze(1)).long()
        out["token_type_ids"] = ((positions >= split) & mask.bool()).long()
    return out


# --- what the bert family declares (hydra_deploy.families) ------------------------------------------
#: config entries that name, label or place a model rather than shape it
_NOT_ARCHITECTURE = (
    "_name_or_path",
    "transformers_version",
    "architectures",
    "id2label",
    "label2id",
    "torch_dtype",
    "dtype",
    "problem_type",
    "_attn_implementation_autoset",
    "_attn_implementation",
)


def architecture_signature(adapter: BackboneAdapter) -> dict[str, Any]:
    """What members of the bert family must share to be fused (the family registry's
    ``architecture``): the config (less names, labels and dtype) and the weights' shapes."""
    config = adapter.module.config.to_dict()
    for key in _NOT_ARCHITECTURE:
        config.pop(key, None)
    return {"configs": config, "weights' shapes or dtypes": weight_shapes(adapter.module)}


def head_views(module: nn.Module) -> tuple[int, list[list[tuple[torch.Tensor, int]]]]:
    """(heads per layer, per layer the views of every weight holding one slice per head): a BERT's
    ``attention.self.query/key/value`` weight/bias [H, hd, ...] and ``attention.output.dense
    .weight`` [D, H, hd], detached views sharing the parameters' storage (the registry's
    ``head_views``)."""
    encoder = getattr(getattr(module, "bert", None), "encoder", None)
    if encoder is None:
        raise FinetuneError(
            f"{type(module).__name__} has no .bert.encoder: it is not a transformers BERT "
            "classifier; fine-tuning takes the models of a family that declares its head_views "
            "(hydra_deploy.families)"
        )
    H = module.config.num_attention_heads
    hd = module.config.hidden_size // H
    views = []
    for block in encoder.layer:
        attention = block.attention
        layer = []
        for linear in (attention.self.query, attention.self.key, attention.self.value):
            layer.append((linear.weight.detach().view(H, hd, -1), 0))
            if linear.bias is not None:
                layer.append((linear.bias.detach().view(H, hd), 0))
        dense = attention.output.dense.weight.detach()
        layer.append((dense.view(dense.shape[0], H, hd), 1))
        views.append(layer)
    return H, views
