"""Text <-> token ids for the pre/postprocessing models and the OpenAI frontend. The engine never sees text.

Streaming detokenization: a byte-level BPE token can end in the middle of a UTF-8 character, and decoding
tokens one response at a time would print broken characters. Each response therefore carries the tokens sent
before it, and the new text is the suffix that decoding all of them adds to decoding the earlier ones, holding
back a trailing incomplete character (U+FFFD) until a later token completes it. The OpenAI frontend sees every
token itself and decodes them one at a time (`IncrementalDecoder`), with the same hold-back.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np

from ..chat import encode_prompt
from ..errors import UserError

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def load_tokenizer(path: str | Path):
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"tokenizer directory {path} does not exist; pass --tokenizer DIR to make-repo.")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path}: {e}") from e


class TextCodec:
    def __init__(self, tokenizer_dir: str | Path, skip_special_tokens: bool = True):
        self.tok = load_tokenizer(tokenizer_dir)
        self.skip_special_tokens = skip_special_tokens

    @property
    def end_id(self) -> int:
        return -1 if self.tok.eos_token_id is None else int(self.tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        return -1 if pad is None else int(pad)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """The prompt's ids exactly as `trt-redrafter run --prompt` encodes it: plain text with special tokens, or
        with chat=True (`run --chat`, the `apply_chat_template` input) one user message in the model's chat
        template (trt_redrafter/chat.py decides which)."""
        return encode_prompt(self.tok, text, chat)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)

    @functools.lru_cache(maxsize=1 << 16)
    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for on its own (OpenAI's logprobs `bytes`): a byte-level BPE token's bytes
        (which may be part of a UTF-8 character), a SentencePiece byte token's byte, else its piece as UTF-8 with
        SentencePiece's word marker as a space; a special token is its own text."""
        piece = self.tok.convert_ids_to_tokens(int(token))
        if piece is None:
            return b""
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._byte_level and int(token) not in self.tok.all_special_ids:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token: int) -> str:
        """One token as text (OpenAI's logprobs `token`): its bytes, an incomplete character as U+FFFD."""
        return self.token_bytes(token).decode(errors="replace")

    @functools.cached_property
    def _byte_level(self) -> bool:
        """The tokenizer decodes with a byte-level decoder (GPT-2's byte <-> character table)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:
            return False
        return "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))

    def decode_delta(self, preceding: list[int], new: list[int]) -> str:
        """The text `new` adds after `preceding` (incomplete trailing characters held back)."""
        before = self.decode(preceding).rstrip(REPLACEMENT) if preceding else ""
        after = self.decode(list(preceding) + list(new)).rstrip(REPLACEMENT)
        if after.startswith(before):
            return after[len(before):]
        n = 0  # decoding is not prefix-stable for this tokenizer here: emit from the first difference
        while n < min(len(before), len(after)) and before[n] == after[n]:
            n += 1
        return after[n:]

    def words_to_list(self, words: list[str]) -> np.ndarray:
        """TensorRT-LLM's word-list format [2, L]: row 0 the words' ids back to back, row 1 each word's end
        offset, padded with -1 (`to_word_list_format` in TensorRT-LLM's preprocessing model)."""
        ids, offsets = [], []
        for w in words:
            if not w:
                continue
            wid = self.tok.encode(w, add_special_tokens=False)
            if wid:
                ids += wid
                offsets.append(len(ids))
        if not ids:
            return np.array([[0], [-1]], dtype=np.int32)
        out = np.full((2, len(ids)), -1, dtype=np.int32)
        out[0] = ids
        out[1, :len(offsets)] = offsets
        return out


class IncrementalDecoder:
    """One output's text, token by token (the OpenAI frontend streams it). Each new token is decoded together with
    the tokens of the previous emitted piece, for context (SentencePiece drops a leading space when a decode starts
    at a word, and a byte-level token may need the bytes before it), and the piece it adds is emitted; a piece that
    ends in an incomplete character waits for the next token. The pieces add up to `codec.decode(all ids)`."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.start = 0  # ids[start:read] is the previous emitted piece: context for decoding the next tokens
        self.read = 0  # ids[read:] are not emitted yet

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.codec.decode(self.ids[self.start:self.read])
        after = self.codec.decode(self.ids[self.start:])
        if after.endswith(REPLACEMENT):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return _added(before, after)

    def flush(self) -> str:
        """What is held back at the end of the output (it ends inside a character)."""
        before = self.codec.decode(self.ids[self.start:self.read])
        after = self.codec.decode(self.ids[self.start:])
        self.start = self.read = len(self.ids)
        return _added(before, after)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves, every other
    byte for the character 256 + its rank among them (GPT-2's `bytes_to_unicode`, which ByteLevel decoders use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _added(before: str, after: str) -> str:
    """The text `after` adds to `before`; from the first difference where decoding is not prefix-stable."""
    if after.startswith(before):
        return after[len(before):]
    n = 0
    while n < min(len(before), len(after)) and before[n] == after[n]:
        n += 1
    return after[n:]

def pad_rows(rows, fill) -> np.ndarray:
    """Token rows of different lengths -> int32 [len(rows), longest], each padded with `fill` (one value, or one per
    row as [B, 1]): a batch of prompts, outputs or word lists as TensorRT-LLM's Triton models pass them."""
    out = np.empty((len(rows), max((len(r) for r in rows), default=0)), dtype=np.int32)
    out[:] = fill
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def list_to_words(word_list: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Inverse of `words_to_list`: [2, L] -> one id tuple per word."""
    assert word_list.ndim == 2 and word_list.shape[0] == 2, word_list.shape
    ids, offsets = word_list[0].tolist(), word_list[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if end > start:
            words.append(tuple(ids[start:end]))
        start = end
    return tuple(words)
