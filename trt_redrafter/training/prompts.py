"""Where distillation prompts come from: text windows, a user's JSONL of prompts or conversations, or the base
itself (Magpie: the chat template's user-turn prefix alone, sampled, gives user prompts).

Each source answers `prompts_for(shard)` with the token ids of that shard's prompts, deterministically from
(seed, shard), so a shard regenerated after an interruption is the same shard.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import torch

from ..chat import chat_ids  # noqa: F401  (the template decision, shared with run/bench/serving)
from ..errors import UserError

MAGPIE_MARK = "\x00MAGPIE-USER-TURN\x00"
MAGPIE_MAX_TOKENS = 96  # user prompts are cut here
MAGPIE_TOP_P = 0.95
EVAL_NGRAM = 8  # a prompt sharing this many consecutive words with an evaluation question is left out


def _conversation(row, where: str) -> list[dict]:
    """One JSONL row -> messages ending with a user turn. Accepts {"prompt": str} (or {"text": str}), MT-Bench
    {"turns": [...]} (the first turn), {"messages": [{"role", "content"}]} and ShareGPT
    {"conversations": [{"from", "value"}]} (up to the last user turn)."""
    for key in ("prompt", "text"):
        if isinstance(row, dict) and isinstance(row.get(key), str) and row[key]:
            return [{"role": "user", "content": row[key]}]
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": str(row["turns"][0])}]
    msgs = row.get("messages") if isinstance(row, dict) else None
    if msgs is None and isinstance(row, dict) and isinstance(row.get("conversations"), list):
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
        msgs = [{"role": roles.get(m.get("from"), m.get("from")), "content": m.get("value")}
                for m in row["conversations"] if isinstance(m, dict)]
    if isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
        if last_user is not None:
            return [{"role": m["role"], "content": m["content"]} for m in msgs[:last_user + 1]]
    raise UserError(f"{where}: expected {{\"prompt\": str}} (or \"text\"), MT-Bench {{\"turns\": [...]}}, "
                    f"{{\"messages\": [...]}} or ShareGPT {{\"conversations\": [...]}} with a user turn.")


def read_conversations(path: str | Path, missing: str) -> list[list[dict]]:
    """Every row of a JSONL file of prompts or conversations (`_conversation`'s forms) as messages ending with a user
    turn; `missing`: the error when the file does not exist (may name {path})."""
    from ..datasets import read_jsonl as rows

    return [_conversation(row, where) for where, row in rows(Path(path), missing)]


def read_jsonl(path: str | Path) -> list[list[dict]]:
    convs = read_conversations(path, "--prompts {path} does not exist; pass a JSONL file of prompts or conversations.")
    if len(convs) < 2:
        raise UserError(f"--prompts {path} holds {len(convs)} conversation(s); need at least 2 (one is held out).")
    return convs


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class EvalGuard:
    """Keeps evaluation prompts out of a training corpus: a prompt that shares EVAL_NGRAM consecutive words with any
    turn of an evaluation question (or all of a shorter one's words, in order) is refused. The default guards
    MT-Bench, the set this project measures drafters on (`datasets.mt_bench_path`)."""

    def __init__(self, name: str, texts: list[str]):
        self.name = name
        self.ngrams: set[tuple[str, ...]] = set()
        for t in texts:
            w = _words(t)
            self.ngrams.update(tuple(w[i:i + EVAL_NGRAM]) for i in range(max(1, len(w) - EVAL_NGRAM + 1)))

    @classmethod
    def mt_bench(cls) -> "EvalGuard":
        from ..datasets import read_jsonl as rows

        turns = [t for _, row in rows("mt-bench", "{path} is missing") for t in row["turns"]]
        return cls("mt-bench", turns)

    def __contains__(self, text: str) -> bool:
        w = _words(text)
        return any(tuple(w[i:i + EVAL_NGRAM]) in self.ngrams for i in range(max(1, len(w) - EVAL_NGRAM + 1)))

    def conversation(self, conv: list[dict]) -> bool:
        """Whether any user turn of `conv` is an evaluation prompt."""
        return any(m["role"] == "user" and m["content"] in self for m in conv)


def split_held_out(convs: list[list[dict]], n_eval: int, seed: int) -> tuple[list, list]:
    """(training, held-out): a seeded shuffle, the last `n_eval` (at most a quarter) held out."""
    order = torch.randperm(len(convs), generator=torch.Generator().manual_seed(seed)).tolist()
    k = max(1, min(n_eval, len(convs) // 4))
    return [convs[i] for i in order[:-k]], [convs[i] for i in order[-k:]]


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (system prompt included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("--magpie needs a chat model: the base's tokenizer has no chat template; pass --prompts "
                        "FILE.jsonl or --data instead.")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MAGPIE_MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if MAGPIE_MARK not in text:
        raise UserError("--magpie: the chat template does not show the user's message verbatim; use --prompts.")
    return tokenizer(text[:text.index(MAGPIE_MARK)], add_special_tokens=False)["input_ids"]


def hf_sampler(model, device: torch.device, pad_id: int) -> Callable:
    """A Magpie sampler over HF `generate` (the whole batch seeded once by `seed`)."""

    @torch.no_grad()
    def sample(prompts: list[list[int]], max_new: int, temperature: float, top_p: float, seed: int,
               stop_ids: Optional[list[int]]) -> list[list[int]]:
        torch.manual_seed(seed)
        ids = torch.tensor(prompts, device=device)  # Magpie's prompts are one prefix repeated: no padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                             top_p=top_p, top_k=0, max_new_tokens=max_new, eos_token_id=stop_ids,
                             pad_token_id=pad_id)
        return out[:, ids.shape[1]:].tolist()
    return sample


def magpie_user_prompts(sample: Callable, tokenizer, n: int, seed: int, guard: Optional[EvalGuard] = None
                        ) -> list[str]:
    """`n` user prompts the base writes itself: sampled continuations of the user-turn prefix (temperature 1,
    top-p 0.95), ended by the end of its turn; empty or repeated ones are dropped and drawn again.

    `sample(prompts, max_new, temperature, top_p, seed, stop_ids)` -> continuations: the corpus engine's
    (generation.EngineGenerator.sample) or HF `generate`'s (`hf_sampler`). A prompt `guard` refuses (an evaluation
    question) is drawn again too."""
    prefix = user_turn_prefix(tokenizer)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    got: list[str] = []
    attempt = 0
    while len(got) < n:
        if attempt == 4:
            raise UserError(f"--magpie: the base wrote only {len(got)} distinct non-empty user prompts of {n} asked; "
                            f"pass --prompts FILE.jsonl instead.")
        m = n - len(got) + max(2, (n - len(got)) // 4)
        for row in sample([prefix] * m, MAGPIE_MAX_TOKENS, 1.0, MAGPIE_TOP_P, seed * 1000003 + attempt, stop):
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            if text and text not in got and (guard is None or text not in guard):
                got.append(text)
        attempt += 1
    return got[:n]
