"""Tokenizer files every transformers line the project supports loads: 4.5x (NVIDIA's TensorRT-LLM 1.0-1.2
containers, whose stock preprocessing calls AutoTokenizer) and 5.x. CI runs this file, with the checkpoint, Triton
and trtllm CPU tests, a second time under the oldest supported transformers (ci/transformers4.sh)."""

from __future__ import annotations

import json

import transformers
from transformers import AutoTokenizer

from trt_redrafter.backends.torch_build import copy_tokenizer
from trt_redrafter.checkpoint.tiny import TinyConfig, make_tiny
from trt_redrafter.checkpoint.tokenizer_files import PORTABLE_CLASS, V5_ONLY_CLASSES, make_portable

TEXT = "Hello wörld, def main(): return 42"


def test_make_tiny_writes_a_tokenizer_both_lines_load(tmp_path):
    make_tiny(tmp_path / "tiny", TinyConfig())
    config = json.loads((tmp_path / "tiny" / "base" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == PORTABLE_CLASS  # transformers 5 alone would write TokenizersBackend
    tok = AutoTokenizer.from_pretrained(tmp_path / "tiny" / "base")
    assert tok.decode(tok(TEXT)["input_ids"], skip_special_tokens=True).replace(" ", "") == TEXT.replace(" ", "")


def test_a_transformers_5_tokenizer_is_made_portable_with_the_same_ids(tmp_path):
    """A tokenizer directory as transformers 5 saves it (TokenizersBackend) -> copied into an engine by build-engine:
    the copy names PreTrainedTokenizerFast and gives the same ids, special tokens and chat template."""
    make_tiny(tmp_path / "tiny", TinyConfig())
    src = tmp_path / "tiny" / "base"
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = V5_ONLY_CLASSES[0]
    config["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    assert copy_tokenizer(src, tmp_path / "engine-tokenizer")
    copied = json.loads((tmp_path / "engine-tokenizer" / "tokenizer_config.json").read_text())
    assert copied["tokenizer_class"] == PORTABLE_CLASS
    assert {k: v for k, v in copied.items() if k != "tokenizer_class"} == \
        {k: v for k, v in config.items() if k != "tokenizer_class"}
    tok = AutoTokenizer.from_pretrained(tmp_path / "engine-tokenizer")
    ids = tok(TEXT)["input_ids"]
    if transformers.__version__ >= "5":  # the original loads only here; the copy must load as the same tokenizer
        orig = AutoTokenizer.from_pretrained(src)
        assert ids == orig(TEXT)["input_ids"] and tok.eos_token_id == orig.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<user>hi"
    assert not make_portable(tmp_path / "engine-tokenizer")  # already portable: left alone
