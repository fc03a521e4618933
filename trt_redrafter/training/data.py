"""Offline text: the running interpreter's standard-library sources, split into training and held-out modules.

Files are the top-level `*.py` of `sysconfig.get_paths()['stdlib']` in sorted order (deterministic for one Python
version). `HELD_OUT_MODULES` never enter training (tokenizer, base model or drafter); their text gives held-out
evaluation windows and prompts.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from ..checkpoint import tiny
from ..checkpoint.tiny import SPECIAL_TOKENS  # noqa: F401  (ids 0..3; re-exported for scripts/train_base.py)
HELD_OUT_MODULES = ("bisect", "colorsys", "fractions", "heapq", "queue", "sched", "shlex", "textwrap")
SKIP_MODULES = ("this", "antigravity", "__phello__.foo")  # not source-like text


def stdlib_files(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): top-level stdlib `*.py`, sorted by name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file() and p.stem not in SKIP_MODULES)
    held = [p for p in files if p.stem in HELD_OUT_MODULES]
    return [p for p in files if p.stem not in HELD_OUT_MODULES], held


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build_tokenizer(vocab_size: int, files: list[Path]):
    """A byte-level BPE `PreTrainedTokenizerFast` of exactly `vocab_size` tokens trained on `files`; adds bos."""
    return tiny.build_tokenizer(vocab_size, read_texts(files))


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files tokenized (no bos) and joined by eos: a 1-D long tensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(read_texts(files), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def text_files(source: str | None) -> tuple[list[Path], list[Path]]:
    """The training/held-out files for a `--data` source: None/'stdlib', a directory, or a single text file.

    A directory gives its `*.py`, `*.txt` and `*.md` files (recursively, sorted); every 10th file is held out.
    """
    if source in (None, "", "stdlib"):
        return stdlib_files()
    from ..errors import UserError

    path = Path(source)
    if path.is_file():
        return [path], [path]
    if not path.is_dir():
        raise UserError(f"--data {source}: expected 'stdlib', a directory of text files or a text file.")
    files = sorted(p for ext in ("*.py", "*.txt", "*.md") for p in path.rglob(ext) if p.is_file())
    if not files:
        raise UserError(f"--data {source}: the directory holds no *.py, *.txt or *.md files.")
    held = files[9::10] or files[:1]
    train = [p for p in files if p not in held] or held
    return train, held
