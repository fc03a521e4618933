"""Tokenizer files that both transformers lines load: 4.5x (NVIDIA's TensorRT-LLM 1.0-1.2 containers, whose stock
preprocessing and postprocessing models call `AutoTokenizer.from_pretrained`) and 5.x.

transformers 5 saves a fast tokenizer as `"tokenizer_class": "TokenizersBackend"`, a class 4.x does not have
("Tokenizer class TokenizersBackend does not exist or is not currently imported."). 5.x still loads the 4.x name,
`PreTrainedTokenizerFast`, as the same tokenizer (same ids, special tokens and chat template; tested in
tests/test_transformers_compat.py under both lines), so every tokenizer this project writes or copies names that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PORTABLE_CLASS = "PreTrainedTokenizerFast"
V5_ONLY_CLASSES = ("TokenizersBackend",)


def make_portable(directory: str | os.PathLike) -> bool:
    """Rewrite `directory`/tokenizer_config.json to name PORTABLE_CLASS where it names a 5.x-only class (atomically);
    True if it changed."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") not in V5_ONLY_CLASSES:
        return False
    config["tokenizer_class"] = PORTABLE_CLASS
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return True


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained(directory)`, loadable by transformers 4.5x and 5.x."""
    tokenizer.save_pretrained(str(directory))
    make_portable(directory)
