"""CLIP's zero-shot classifier: class weights from prompts, and the logits they give.

For every class, the prompts made from the templates ("a photo of a {}.") are encoded by the text
tower, normalised, averaged over templates and normalised again, giving class weights W [C, E].
Then

    logits = logit_scale.exp() * normalize(image_features) @ W.T  (+ logit_bias, SigLIP models)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.errors import BackboneError

#: The prompt templates used when none are given: the 7 templates OpenAI selected for ImageNet
#: ("Prompt_Engineering_for_ImageNet.ipynb"; open_clip's ``SIMPLE_IMAGENET_TEMPLATES``).
DEFAULT_TEMPLATES: tuple[str, ...] = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)


def zero_shot_logits(
    features: torch.Tensor,
    class_weights: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logit_scale.exp() * normalize(features) @ class_weights.T (+ logit_bias)``: [..., E] -> [..., C]."""
    # F.normalize written out: it exports as ReduceL2, whose opset-18 form does not convert to 17
    norm = (features * features).sum(dim=-1, keepdim=True).clamp_min(1e-24).sqrt()  # max(|x|, eps)
    logits = logit_scale.exp() * (features / norm) @ class_weights.T
    return logits if logit_bias is None else logits + logit_bias


class ZeroShotClassifier(nn.Module):
    """An OpenCLIP image tower and fixed text-derived class weights: images -> class logits.

    ``class_weights`` [C, E] (rows L2-normalised), ``logit_scale`` (log of the temperature, as
    open_clip stores it) and ``logit_bias`` (SigLIP; None otherwise) are buffers: they are saved in
    the state dict but never trained.
    """

    def __init__(
        self,
        visual: nn.Module,
        class_weights: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | float | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.visual = visual
        dtype = class_weights.dtype
        self.register_buffer("class_weights", class_weights.detach().clone())
        self.register_buffer("logit_scale", torch.as_tensor(logit_scale, dtype=dtype).reshape(()))
        bias = None if logit_bias is None else torch.as_tensor(logit_bias, dtype=dtype).reshape(())
        self.register_buffer("logit_bias", None if bias is None else bias.detach().clone())
        self.class_names = None if class_names is None else [str(c) for c in class_names]

    @property
    def num_classes(self) -> int:
        return int(self.class_weights.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Image features [B, E] (before normalisation) -> logits [B, C]."""
        return zero_shot_logits(features, self.class_weights, self.logit_scale, self.logit_bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.visual(pixel_values)  # open_clip's own image-tower forward
        if isinstance(features, tuple):  # output_tokens=True: (pooled, tokens)
            features = features[0]
        return self.logits(features)


def read_names(value: str | os.PathLike | Sequence[str] | None, what: str) -> list[str]:
    """A list of names, or a text file with one per line (blank lines skipped) -> names."""
    option = "--classes names.txt" if what == "classes" else "--templates templates.txt"
    if value is None:
        raise BackboneError(
            f"an OpenCLIP zero-shot classifier needs {what}: pass {what}=[...] or a text file with "
            f"one entry per line ({option})"
        )
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise BackboneError(
                f"{what} file {str(path)!r} does not exist; pass a text file with one entry per "
                f"line ({option}) or a list"
            )
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise BackboneError(f"cannot read the {what} file {str(path)!r}: {err}") from err
        names = [line.strip() for line in lines if line.strip()]
        source = f"{what} file {str(path)!r}"
    else:
        names = [str(v).strip() for v in value]
        source = f"the {what} list"
        if any(not n for n in names):
            raise BackboneError(f"{source} holds empty entries")
    if not names:
        raise BackboneError(f"{source} is empty; give at least one entry ({option})")
    return names


def check_templates(templates: Sequence[str]) -> None:
    """Every template must place the class name with ``{}`` or ``{c}`` (``str.format``)."""
    for template in templates:
        try:
            filled = template.format("\0", c="\0")
        except (IndexError, KeyError, ValueError) as err:
            raise BackboneError(
                f"prompt template {template!r} is not a format string with one {{}} or {{c}} "
                f"placeholder: {err}"
            ) from err
        if "\0" not in filled:
            raise BackboneError(
                f"prompt template {template!r} has no placeholder; write it like 'a photo of a {{}}.'"
            )


@torch.no_grad()
def class_weights_from_text(
    clip: nn.Module,
    tokenizer: Callable[[list[str]], torch.Tensor],
    classes: Sequence[str],
    templates: Sequence[str],
    batch_size: int = 256,
) -> torch.Tensor:
    """Zero-shot class weights [C, E]: normalize(mean over templates of normalised text embeddings).

    The same recipe as ``open_clip.build_zero_shot_classifier`` (which returns the transpose).
    """
    check_templates(templates)
    prompts = [t.format(c, c=c) for c in classes for t in templates]  # class-major
    device = next(clip.parameters()).device
    was_training = clip.training
    clip.eval()
    try:
        embeddings = []
        for start in range(0, len(prompts), batch_size):
            tokens = tokenizer(prompts[start : start + batch_size]).to(device)
            embeddings.append(clip.encode_text(tokens, normalize=True))
    except (IndexError, RuntimeError) as err:
        raise BackboneError(
            f"the text tower cannot encode the tokenizer's output ({type(err).__name__}: "
            f"{str(err)[:200]}); does the tokenizer match the model?"
        ) from err
    finally:
        clip.train(was_training)
    per_prompt = torch.cat(embeddings).reshape(len(classes), len(templates), -1)  # [C, T, E]
    return F.normalize(per_prompt.mean(dim=1), dim=-1)  # [C, E]
