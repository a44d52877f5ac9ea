"""The docs run: every fenced command and snippet of README.md and docs/*.md (issue 20).

As Polygraphy's ``tests/test_examples.py`` runs the commands of its example READMEs, this runs every
fenced ``bash``/``sh``/``console``/``python`` block of the README and the manual, page by page in
document order, each page in a temporary folder of its own (nothing is written into the repository)
that holds tiny stand-ins under the names the docs use (see :func:`docs_world`). A block passes when
it exits 0 and the files its commands promise (``--out``, ``--save-spec``, ``--json FILE``, ...)
exist. Blocks of other languages (``text``, ``json``) show output or reference and are not run.

What a block needs is said by HTML comments directly above its fence (the rendered page hides them):

- ``<!-- docs-test: skip REASON -->``: not run; reported as a pytest skip with REASON.
- ``<!-- docs-test: omit "TEXT" REASON -->``: the commands containing TEXT are not run; each is
  reported as a pytest skip with REASON, and the rest of the block runs.
- ``<!-- docs-test: sub "OLD" "NEW" -->``: OLD replaced by NEW before running (a cheaper stand-in).
- ``<!-- docs-test: continues -->``: a python block that runs after the page's previous python block,
  in the same interpreter (it uses that block's names).

Besides, :data:`SUBSTITUTIONS` makes every ``vit_b16`` that ``hydra-export``, ``hydra-fuse`` and
``load_backbone`` build the tiny ViT of ``vit_b16.safetensors``. A directive that is unknown, not
directly above a fence, or whose text is not in its block fails :func:`test_directives_are_valid`,
so a stale directive cannot hide a change. docs/development.md describes this for contributors.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # the environment's console scripts (not resolved: a venv)
SHELL_LANGUAGES = {"bash", "sh", "console"}
RUN_LANGUAGES = SHELL_LANGUAGES | {"python"}
TIMEOUT_S = 600  # per block; the slowest, the README's digits Hydra trained from scratch, takes
# about 90 s alone on 2 cores (several minutes beside other jobs); the others under 20 s
README_MAX_BYTES = 12_000  # the README is a landing page; the manual lives in docs/

#: The tiny stand-in for ViT-B/16: its 12 heads (so `--heads-per-member 4` still means 4 of 12),
#: two layers of width 48 at 16x16 pixels, timm's 1000 classes.
TINY_VIT_B16 = {"img_size": 16, "patch_size": 8, "embed_dim": 48, "depth": 2}
_MODEL_ARGS = " ".join(f"--model-arg {key}={value}" for key, value in TINY_VIT_B16.items())
_KWARGS = ", ".join(f"{key}={value}" for key, value in TINY_VIT_B16.items())

#: (language kind, command filter, pattern, replacement) applied to every block after its own
#: ``sub`` directives. Shell patterns apply per command, to the commands the filter matches.
SUBSTITUTIONS = [
    (
        "shell",
        r"hydra-(export|fuse)\b",
        r"--backbone vit_b16(?=\s|$)",
        f"--backbone vit_b16 {_MODEL_ARGS}",
    ),
    ("python", "", r'load_backbone\("vit_b16"', f'load_backbone("vit_b16", {_KWARGS}'),
    ("python", "", r"\b3, 224, 224\b", "3, 16, 16"),
]

DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
QUOTED = r'"((?:[^"\\]|\\.)*)"'
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


@dataclass
class Block:
    """A fenced block of a page and what its directives say."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    skip: str | None = None
    omits: list[tuple[str, str]] = field(default_factory=list)  # (text, reason)
    subs: list[tuple[str, str]] = field(default_factory=list)
    continues: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_directive(body: str, block: Block, errors: list[str], where: str) -> None:
    if body.startswith("skip "):
        block.skip = body[len("skip ") :].strip()
    elif match := re.fullmatch(rf"omit\s+{QUOTED}\s+(.+)", body):
        block.omits.append((_unquote(match[1]), match[2].strip()))
    elif match := re.fullmatch(rf"sub\s+{QUOTED}\s+{QUOTED}", body):
        block.subs.append((_unquote(match[1]), _unquote(match[2])))
    elif body == "continues":
        block.continues = True
    else:
        errors.append(f"{where}: unknown docs-test directive {body!r}")


def parse_page(page: Path, errors: list[str]) -> list[Block]:
    """Every fenced block of ``page`` with the directives directly above it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, pending = [], []  # pending: (line number, directive body) awaiting their fence
    index = 0
    while index < len(lines):
        line, number = lines[index], index + 1
        where = f"{page.relative_to(ROOT)}:{number}"
        directive, fence = DIRECTIVE.match(line), FENCE.match(line)
        if directive:
            pending.append((number, directive["body"]))
            index += 1
            continue
        if not fence:
            if pending:
                errors.append(f"{where}: a docs-test directive must sit directly above a fence")
                pending = []
            index += 1
            continue
        marker = fence["fence"]
        closing = re.compile(rf"^ {{0,3}}{re.escape(marker[0])}{{{len(marker)},}}\s*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        block = Block(page, number, fence["info"].lower(), "\n".join(lines[index + 1 : end]) + "\n")
        for at, body in pending:
            parse_directive(body, block, errors, f"{page.relative_to(ROOT)}:{at}")
        if pending and block.language not in RUN_LANGUAGES:
            errors.append(
                f"{where}: docs-test directives above a {block.language or 'plain'} block"
            )
        pending = []
        blocks.append(block)
        index = end + 1
    if pending:
        errors.append(f"{page.relative_to(ROOT)}: docs-test directive at the end of the page")
    return blocks


def shell_commands(block: Block) -> list[str]:
    """The block's commands: backslash-continued lines joined; for console, the ``$ `` lines."""
    commands, current = [], ""
    for raw in block.source.splitlines():
        if block.language == "console" and not current:
            if not raw.startswith("$ "):
                continue  # output
            raw = raw[2:]
        current += raw
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            commands.append(current)
        current = ""
    if current.strip():
        commands.append(current)
    return commands


def global_substitute(kind: str, text: str) -> str:
    for language, command_filter, pattern, replacement in SUBSTITUTIONS:
        if language == kind and re.search(command_filter, text):
            text = re.sub(pattern, lambda _, r=replacement: r, text)
    return text


def substitute(block: Block, texts: list[str], errors: list[str]) -> list[str]:
    """The block's own ``sub`` directives (each must occur), then :data:`SUBSTITUTIONS`."""
    for old, new in block.subs:
        if not any(old in text for text in texts):
            errors.append(f"{block.where}: sub {old!r} does not occur in what the block runs")
        texts = [text.replace(old, new) for text in texts]
    kind = "python" if block.language == "python" else "shell"
    return [global_substitute(kind, text) for text in texts]


@dataclass
class Item:
    """One pytest case: a block to run (or skip), or one omitted command reported as a skip."""

    block: Block
    name: str  # the pytest id: ``page:line``, or ``page:line:omitted-k`` for an omitted command
    skip: str | None
    commands: list[str] = field(default_factory=list)  # shell: what runs, substituted
    python: str = ""  # python: the source, substituted, with the blocks it continues


def collect() -> tuple[list[Item], list[str]]:
    errors: list[str] = []
    items: list[Item] = []
    for page in PAGES:
        last_python: Item | None = None
        for block in parse_page(page, errors):
            skip = block.skip and f"{block.where}: {block.skip}"
            if block.language == "python":
                (source,) = substitute(block, [block.source], errors)
                if not block.continues:
                    last_python = Item(block, block.where, skip, python=source)
                    items.append(last_python)
                elif last_python is None:
                    errors.append(f"{block.where}: 'continues' with no python block before it")
                else:
                    last_python.python += "\n" + source
                    last_python.skip = last_python.skip or skip
            elif block.language in SHELL_LANGUAGES:
                if block.continues:
                    errors.append(f"{block.where}: 'continues' applies to python blocks only")
                kept, used, dropped = [], set(), 0
                for command in shell_commands(block):
                    omitted = [(text, reason) for text, reason in block.omits if text in command]
                    used.update(text for text, _ in omitted)
                    if not omitted:
                        kept.append(command)
                        continue
                    short = " ".join(command.split(" #")[0].split())[:70]
                    reason = f"{block.where}: `{short}` not run: {omitted[0][1]}"
                    dropped += 1
                    items.append(Item(block, f"{block.where}:omitted-{dropped}", reason))
                for text, _ in block.omits:
                    if text not in used:
                        errors.append(f"{block.where}: omit {text!r} matches no command")
                items.append(
                    Item(block, block.where, skip, commands=substitute(block, kept, errors))
                )
    return items, errors


ITEMS, DIRECTIVE_ERRORS = collect()


# --- the folder the docs run in ------------------------------------------------------------------
def _save_state_dict(module, path: Path) -> None:
    from safetensors.torch import save_file

    state = {
        name: tensor.detach().contiguous().clone() for name, tensor in module.state_dict().items()
    }
    save_file(state, str(path))


def _images(root: Path) -> None:
    """train/, calib/, test/ (digit PNGs in class sub-folders 0..9), images/ and noise/, written
    by the command the README gives for them (scripts/digits_data.py)."""
    script = runpy.run_path(str(ROOT / "scripts" / "digits_data.py"))
    script["write_digits"](root)
    (root / "scripts").symlink_to(ROOT / "scripts", target_is_directory=True)


def _vit_checkpoints(root: Path) -> None:
    """vit_b16.safetensors (the tiny ViT-B/16 shape) and digits-vit/ (timm's hub layout)."""
    import timm
    import torch
    from helpers.vit import scramble

    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY_VIT_B16)
    _save_state_dict(scramble(vit.eval(), seed=0), root / "vit_b16.safetensors")
    model_args = {
        "img_size": 16,
        "patch_size": 4,
        "in_chans": 1,
        "embed_dim": 24,
        "depth": 2,
        "num_heads": 6,
        "mlp_ratio": 2.0,
    }
    digits = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, **model_args
    )
    (root / "digits-vit").mkdir()
    _save_state_dict(scramble(digits.eval(), seed=1), root / "digits-vit" / "model.safetensors")
    config = {
        "architecture": "vit_tiny_patch16_224",
        "num_classes": 10,
        "model_args": model_args,
        "pretrained_cfg": {
            "mean": [0.5],
            "std": [0.5],
            "interpolation": "bilinear",
            "crop_pct": 1.0,
        },
    }
    (root / "digits-vit" / "config.json").write_text(json.dumps(config))


def _text_checkpoints(root: Path) -> None:
    """checkpoints/wordnet-bert (a BERT classifier with class names) and checkpoints/minilm (an
    encoder only), both 12 heads wide with a word-level tokenizer; .tsv and .txt files."""
    import torch
    import transformers
    from helpers.bert import bert_config
    from helpers.text_data import ID2LABEL, KEYWORDS, VOCAB, sentences, write_tsv

    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    shape = dict(
        vocab_size=len(VOCAB),
        hidden_size=48,
        num_attention_heads=12,
        num_hidden_layers=2,
        intermediate_size=48,
    )
    torch.manual_seed(0)
    labels = dict(id2label=ID2LABEL, label2id={name: i for i, name in ID2LABEL.items()})
    for name, model in (
        (
            "wordnet-bert",
            transformers.BertForSequenceClassification(bert_config(**shape, **labels)),
        ),
        ("minilm", transformers.BertModel(bert_config(**shape))),
    ):
        model.eval().save_pretrained(root / "checkpoints" / name)
        tokenizer.save_pretrained(root / "checkpoints" / name)
    write_tsv(root / "train.tsv", sentences(48, seed=1, classes=list(KEYWORDS)))
    write_tsv(root / "test.tsv", sentences(18, seed=2, classes=["act", "animal", "food"]))
    (root / "verbs.txt").write_text("run very fast\nthrow the ball\nswim and jump\n")
    (root / "glosses.txt").write_text("a big dog\nsome hot soup\nan old oak tree\n")


def _clip_checkpoint(root: Path) -> None:
    """checkpoints/tiny-clip (open_clip's local-dir layout), clip.safetensors, names.txt."""
    from helpers.openclip import TEXT_CFG, TINY_CLIP, tiny_clip

    folder = root / "checkpoints" / "tiny-clip"
    folder.mkdir(parents=True)
    config = {"model_cfg": {"embed_dim": 16, "vision_cfg": TINY_CLIP["tok"], "text_cfg": TEXT_CFG}}
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    _save_state_dict(tiny_clip("tok"), root / "clip.safetensors")
    (root / "names.txt").write_text("cat\ndog\ncar\n")


def _vit_export(root: Path) -> None:
    """export/vit_b16-m3: what the README's main job writes, from the tiny ViT."""
    from hydra_deploy import HydraSpec, export_onnx, fuse, load_backbone

    backbone = load_backbone("vit_b16", checkpoint=root / "vit_b16.safetensors", **TINY_VIT_B16)
    spec = HydraSpec.random(
        backbone.name,
        backbone.num_layers,
        backbone.num_heads,
        backbone.head_dim,
        members=3,
        heads_per_member=4,
        seed=0,
    )
    export_onnx(fuse(backbone, spec), root / "export" / "vit_b16-m3", validate=False)


#: what the world's export/digits-scratch shortens of the README's command that trains it (fewer
#: steps: about 75% accurate, against 92% after 600; docs/decisions.md asks for a risk of 0.3)
DIGITS_STAND_IN = ("--finetune-steps 600", "--finetune-steps 200")


def _digits_export(root: Path) -> None:
    """export/digits-scratch: the README's command that trains it, with fewer steps."""
    (command,) = [
        c
        for item in ITEMS
        if item.block.page.name == "README.md"
        for c in item.commands
        if "--out export/digits-scratch" in c
    ]
    assert DIGITS_STAND_IN[0] in command, (
        "the README's digits export changed: update DIGITS_STAND_IN"
    )
    command = command.replace(*DIGITS_STAND_IN).replace(".venv/bin/", "")
    done = subprocess.run(
        ["bash", "-c", f"{command} --no-validate --quiet"],
        cwd=root,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"export/digits-scratch for the docs: {done.stdout}{done.stderr}"


@pytest.fixture(scope="session")
def docs_world(tmp_path_factory) -> Path:
    """The files the docs name, tiny: built once, copied into each page's folder."""
    root = tmp_path_factory.mktemp("docs-world")
    rng = np.random.default_rng(0)
    _images(root)
    np.savez(
        root / "val.npz",
        x=rng.standard_normal((12, 3, 16, 16), dtype=np.float32),
        y=rng.integers(0, 10, 12),
    )
    np.savez(root / "ood.npz", x=rng.standard_normal((12, 3, 16, 16), dtype=np.float32) * 3)
    _vit_checkpoints(root)
    _text_checkpoints(root)
    _clip_checkpoint(root)
    _vit_export(root)
    _digits_export(root)
    (root / "vit.plan").write_bytes(b"a stand-in for an engine trtexec built on the serving GPU\n")
    return root


@pytest.fixture(scope="session")
def page_folders(docs_world, tmp_path_factory):
    """page -> its folder (a copy of the world, with .venv pointing at this environment)."""
    folders: dict[Path, Path] = {}

    def folder_for(page: Path) -> Path:
        if page not in folders:
            folder = tmp_path_factory.mktemp(f"docs-{page.stem}") / "work"
            shutil.copytree(docs_world, folder, symlinks=True)
            (folder / ".venv").symlink_to(BIN.parent, target_is_directory=True)
            folders[page] = folder
        return folders[page]

    return folder_for


def _environment() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
    }


PROMISING_OPTIONS = {
    "--out",
    "--save-spec",
    "--write-baseline",
    "--triton",
    "--finetune-dir",
    "--plot",
}
FILE_OUTPUTS = {"--json": ".json", "--csv": ".csv"}  # only when a file name follows


def promised_files(command: str) -> list[str]:
    """The paths a command says it writes (so their absence fails the block)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    return [
        value
        for option, value in itertools.pairwise(words)
        if (option in PROMISING_OPTIONS and not value.startswith("-"))
        or (option in FILE_OUTPUTS and value.endswith(FILE_OUTPUTS[option]))
    ]


def _run(argv: list[str], folder: Path, item: Item) -> None:
    try:
        done = subprocess.run(
            argv, cwd=folder, env=_environment(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{item.block.where}: did not finish in {TIMEOUT_S} s\n{error.stderr}")
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{item.block.where} exited {done.returncode}:\n{output}"


@pytest.mark.parametrize("item", ITEMS, ids=[item.name for item in ITEMS])
def test_block_runs(item: Item, page_folders):
    if item.skip:
        pytest.skip(reason=item.skip)
    folder = page_folders(item.block.page)
    if item.block.language == "python":
        _run([sys.executable, "-c", item.python], folder, item)
        return
    assert item.commands, f"{item.block.where}: no command left to run; skip the block instead"
    script = "\n".join(["set -euo pipefail -x", *item.commands])
    _run(["bash", "-c", script], folder, item)
    missing = [p for c in item.commands for p in promised_files(c) if not (folder / p).exists()]
    assert not missing, f"{item.block.where}: the commands did not write {missing}"


def test_directives_are_valid():
    assert not DIRECTIVE_ERRORS, "\n".join(DIRECTIVE_ERRORS)


# --- links ---------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def without_fences(page: Path) -> str:
    """The page without its fenced blocks, whose headings and links are not headings and links."""
    text = page.read_text(encoding="utf-8")
    return re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.S | re.M)


def prose(page: Path) -> str:
    """The page without fenced blocks and inline code."""
    return re.sub(r"`+[^`]*`+", "", without_fences(page))


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercase, punctuation dropped, '-' for spaces)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_fences(page), flags=re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
        kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
        slug, suffix = kept.replace(" ", "-"), 0
        while (slug if not suffix else f"{slug}-{suffix}") in anchors:
            suffix += 1
        anchors.add(slug if not suffix else f"{slug}-{suffix}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve_inside_the_repository(page: Path):
    text = page.read_text(encoding="utf-8")
    assert "ARCHITECTURE.md" not in text and "../shared" not in text, (
        f"{page.name} refers outside the repository; the design the user needs is docs/design.md"
    )
    broken = []
    links = LINK.findall(prose(page))
    for target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_docs_pages_are_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in PAGES[1:] if p.name != "index.md" and f"]({p.name}" not in index]
    assert not unlinked, f"docs/index.md does not link {unlinked}"


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= README_MAX_BYTES, (
        f"README.md is {len(readme.encode())} bytes; keep it a landing page (at most "
        f"{README_MAX_BYTES}) and put the manual in docs/"
    )
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)[1]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == [
        "bash scripts/setup.sh",
        ".venv/bin/hydra-export --backbone vit_b16 --overwrite",
        ".venv/bin/python -m pytest -q",
    ]
