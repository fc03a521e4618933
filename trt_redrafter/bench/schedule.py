"""What a benchmark point sends and when: prompts from a JSONL dataset and Poisson arrival times.

Both depend only on the seed, so AR and ReDrafter (and every TP size) get the same prompts at the same offsets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..errors import UserError

# FastChat's "vicuna_v1.1" conversation template (the one Vicuna and the ReDrafter paper's MT-Bench runs use).
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
CHAT_TEMPLATES = ("auto", "vicuna", "none")


def vicuna_prompt(user: str) -> str:
    return f"{VICUNA_SYSTEM} USER: {user} ASSISTANT:"


def load_prompts(path: str | Path, chat_template: str = "auto") -> list[str]:
    """Prompts of a JSONL file: MT-Bench `question.jsonl` rows (first turn) or the project's {"prompt": ...} rows.

    `auto` wraps MT-Bench questions in the Vicuna v1.1 template and leaves {"prompt": ...} rows as they are;
    `vicuna` / `none` force one or the other for every row.
    """
    if chat_template not in CHAT_TEMPLATES:
        raise UserError(f"--chat-template must be one of {', '.join(CHAT_TEMPLATES)}, got {chat_template!r}.")
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset {path} does not exist; pass a JSONL file of MT-Bench questions or {{\"prompt\": ...}}.")
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno} is not JSON ({e.msg}).") from e
            if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
                text, chat = str(row["turns"][0]), chat_template in ("auto", "vicuna")
            elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
                text, chat = row["prompt"], chat_template == "vicuna"
            else:
                raise UserError(f"{path}:{lineno} has neither 'turns' (MT-Bench) nor a string 'prompt'.")
            prompts.append(vicuna_prompt(text) if chat else text)
    if not prompts:
        raise UserError(f"dataset {path} holds no prompts.")
    return prompts


def pick_prompts(prompts: list[str], n: int, seed: int) -> list[str]:
    """n prompts: the dataset shuffled with `seed`, repeated as often as needed."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(n)]


def poisson_offsets(n: int, qps: float, seed: int) -> list[float]:
    """Arrival times (s) of n requests of a Poisson process at `qps` requests/s; the first arrives at 0.

    Gaps are exponential with mean 1/qps (vLLM's request generator with burstiness 1); qps = inf sends all at once.
    """
    if qps <= 0:
        raise UserError(f"QPS must be positive, got {qps}.")
    rng = random.Random(f"poisson-{seed}")  # a string seed: independent of the prompt shuffle's stream
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += 0.0 if qps == float("inf") else rng.expovariate(qps)
    return out
