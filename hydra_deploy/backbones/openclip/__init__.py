"""OpenCLIP models used zero-shot: the image tower plus a text-derived classifier.

The classifier is the one of CLIP's zero-shot recipe: for every class, the prompts made from the
templates ("a photo of a {}.") are encoded by the text tower, normalised, averaged over templates
and normalised again, giving class weights W [C, E]. Then

    logits = logit_scale.exp() * normalize(image_features) @ W.T  (+ logit_bias, SigLIP models)

The text side is computed once, when the adapter is built, and stored as a buffer; Hydra members
share it and differ only in the image tower's attention heads. The module the adapter exposes
(:class:`ZeroShotClassifier`) holds the image tower and that classifier only.

Head gates: an image tower's ``nn.MultiheadAttention`` modules are replaced, in place, by
:class:`GatedMultiheadAttention` sharing their parameters, so the heads' outputs can be scaled
(:mod:`.attention` says why and how).

Modules: :mod:`.attention` (the gate-able attention), :mod:`.zero_shot` (the classifier and its
class weights), :mod:`.adapter` (support checks, the adapter), :mod:`.loading` (building one).
"""

from hydra_deploy.backbones.openclip.adapter import OpenClipAdapter, check_supported
from hydra_deploy.backbones.openclip.attention import GatedMultiheadAttention, install_gates
from hydra_deploy.backbones.openclip.loading import (
    build_visual,
    load_openclip,
    rebuild_openclip,
    wrap_openclip,
)
from hydra_deploy.backbones.openclip.zero_shot import (
    DEFAULT_TEMPLATES,
    ZeroShotClassifier,
    class_weights_from_text,
    zero_shot_logits,
)

__all__ = [
    "DEFAULT_TEMPLATES",
    "GatedMultiheadAttention",
    "OpenClipAdapter",
    "ZeroShotClassifier",
    "build_visual",
    "check_supported",
    "class_weights_from_text",
    "install_gates",
    "load_openclip",
    "rebuild_openclip",
    "wrap_openclip",
    "zero_shot_logits",
]
