"""Keyword sentences of four classes (the text user story's data, also the docs' text files)."""

from __future__ import annotations

import numpy as np

#: Class index -> name, deliberately not alphabetical (sorted, "act" would be 0 and "plant" 3).
ID2LABEL = {0: "plant", 1: "act", 2: "animal", 3: "food"}
KEYWORDS = {
    "plant": ["tree", "moss", "fern", "oak"],
    "act": ["run", "jump", "swim", "throw"],
    "animal": ["dog", "cat", "horse", "owl"],
    "food": ["bread", "soup", "rice", "cake"],
}
FILLER = ["the", "a", "of", "and", "some", "very", "big", "small"]
VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *FILLER,
    *(w for ws in KEYWORDS.values() for w in ws),
]


def sentences(n: int, seed: int, classes: list[str]) -> list[tuple[str, str]]:
    """``n`` (label, text) pairs: two keywords of the class among filler words."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        label = classes[i % len(classes)]
        words = list(rng.choice(FILLER, size=int(rng.integers(2, 5))))
        words[int(rng.integers(0, len(words)))] = str(rng.choice(KEYWORDS[label]))
        words.append(str(rng.choice(KEYWORDS[label])))
        out.append((label, " ".join(words)))
    return out


def write_tsv(path, pairs) -> None:
    path.write_text("".join(f"{label}\t{text}\n" for label, text in pairs), encoding="utf-8")
