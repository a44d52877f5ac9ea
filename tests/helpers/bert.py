"""Tiny random BERTs (transformers) with discriminative weights, and a tiny BERT export."""

from __future__ import annotations

import torch
import transformers

from hydra_deploy.backbones import load_backbone
from hydra_deploy.backbones.hf_bert import HfBertAdapter

from .members import random_spec

TINY_BERT = {
    "segments": dict(num_hidden_layers=3, type_vocab_size=2, num_labels=5, hidden_act="gelu"),
    "one_segment": dict(
        num_hidden_layers=2,
        type_vocab_size=1,
        num_labels=3,
        hidden_act="gelu_new",
        layer_norm_eps=1e-5,
    ),
}


def bert_config(**overrides) -> transformers.BertConfig:
    base = dict(
        vocab_size=100,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    return transformers.BertConfig(**{**base, **overrides})


def scramble_bert(module: torch.nn.Module, seed: int, gain: float = 1.5) -> torch.nn.Module:
    """Weights that make attention peaky and every head matter (HF's std-0.02 init hides bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "embeddings" in name and param.dim() == 2:
                param.copy_(noise)
            elif param.dim() == 2:
                param.copy_(noise * gain / param.shape[1] ** 0.5)
            elif "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.3 * noise)
    return module


def tiny_bert(config: str = "segments", seed: int = 0) -> HfBertAdapter:
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(bert_config(**TINY_BERT[config]))
    return load_backbone(scramble_bert(model.eval(), seed))


def word_tokenizer(words: list[str], folder) -> None:
    """A WordLevel tokenizer of ``words`` (``[PAD] [UNK] [CLS] [SEP]`` first) saved as
    ``folder / "tokenizer.json"``: whitespace split, ``[CLS] text [SEP]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))


def tiny_text_export(root, batch=(1, 2, 4)):
    """A tiny BERT export (vocabulary 100) with a 12-word WordLevel tokenizer in tokenizer/, written
    to ``root / "export"``; returns that folder."""
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse

    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "dog",
        "ran",
    ]
    source = root / "tokenizer-source"
    word_tokenizer(words, source)
    backbone = tiny_bert("segments")
    spec = random_spec(backbone, members=2, heads_per_member=2, seed=0)
    hydra = fuse(backbone, spec)
    hydra.tokenizer_dir = str(source)
    export_onnx(hydra, root / "export", batch=batch, validate=False)
    return root / "export"
