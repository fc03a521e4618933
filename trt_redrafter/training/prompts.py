"""Where distillation prompts come from: text windows, a user's JSONL of prompts or conversations, or the base
itself (Magpie: the chat template's user-turn prefix alone, sampled, gives user prompts).

Each source answers `prompts_for(shard)` with the token ids of that shard's prompts, deterministically from
(seed, shard), so a shard regenerated after an interruption is the same shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..chat import chat_ids  # noqa: F401  (the template decision, shared with run/bench/serving)
from ..errors import UserError

MAGPIE_MARK = "\x00MAGPIE-USER-TURN\x00"
MAGPIE_MAX_TOKENS = 96  # user prompts are cut here
MAGPIE_TOP_P = 0.95


def _conversation(row, where: str) -> list[dict]:
    """One JSONL row -> messages ending with a user turn. Accepts {"prompt": str}, MT-Bench {"turns": [...]}
    (the first turn), {"messages": [{"role", "content"}]} and ShareGPT {"conversations": [{"from", "value"}]}
    (up to the last user turn)."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
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
    raise UserError(f"{where}: expected {{\"prompt\": str}}, MT-Bench {{\"turns\": [...]}}, {{\"messages\": [...]}} or "
                    f"ShareGPT {{\"conversations\": [...]}} with a user turn.")


def read_jsonl(path: str | Path) -> list[list[dict]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path} does not exist; pass a JSONL file of prompts or conversations.")
    convs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno} is not JSON ({e.msg}).") from e
            convs.append(_conversation(row, f"{path}:{lineno}"))
    if len(convs) < 2:
        raise UserError(f"--prompts {path} holds {len(convs)} conversation(s); need at least 2 (one is held out).")
    return convs


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


@torch.no_grad()
def magpie_user_prompts(model, tokenizer, n: int, seed: int, device: torch.device) -> list[str]:
    """`n` user prompts the base writes itself: sampled continuations of the user-turn prefix (temperature 1,
    top-p 0.95), ended by the end of its turn; empty or repeated ones are dropped and drawn again."""
    prefix = torch.tensor([user_turn_prefix(tokenizer)], device=device)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    got: list[str] = []
    attempt = 0
    while len(got) < n:
        if attempt == 4:
            raise UserError(f"--magpie: the base wrote only {len(got)} distinct non-empty user prompts of {n} asked; "
                            f"pass --prompts FILE.jsonl instead.")
        torch.manual_seed(seed * 1000003 + attempt)
        m = n - len(got) + max(2, (n - len(got)) // 4)
        out = model.generate(prefix.expand(m, -1), attention_mask=torch.ones(m, prefix.shape[1], dtype=torch.long,
                                                                               device=device),
                             do_sample=True, temperature=1.0, top_p=MAGPIE_TOP_P, top_k=0,
                             max_new_tokens=MAGPIE_MAX_TOKENS, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        for row in out[:, prefix.shape[1]:].tolist():
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            if text and text not in got:
                got.append(text)
        attempt += 1
    return got[:n]
