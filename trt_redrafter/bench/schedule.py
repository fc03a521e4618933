"""What a benchmark point sends and when: prompts from a JSONL dataset and Poisson arrival times.

Both depend only on the seed, so AR and ReDrafter (and every TP size) get the same prompts at the same offsets.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..chat import TOKENIZER, VICUNA, chat_template_for, encode_prompt, has_chat_template, vicuna_prompt
from ..errors import UserError

# auto: MT-Bench rows get the model's template (the tokenizer's, else Vicuna v1.1), {"prompt"} rows stay raw;
# tokenizer / vicuna / none: that template for every row
CHAT_TEMPLATES = ("auto", TOKENIZER, VICUNA, "none")


@dataclass(frozen=True)
class Prompt:
    """One prompt as a client sends it, and the chat template that prompts it.

    The tokenizer's template is applied where the tokenizer lives, in the server's preprocessing (the request's
    `apply_chat_template` input), so its BOS is tokenized as `apply_chat_template` does; Vicuna v1.1 is plain text
    and is applied here, so a stock TensorRT-LLM ensemble, which has no such input, still gets the paper's prompts.
    """

    text: str  # text_input: the user message (template "tokenizer") or the whole prompt
    template: str = "none"  # "tokenizer" (applied by the server), "vicuna" (already in text) or "none"
    category: str = field(default="", compare=False)  # the dataset row's category (MT-Bench: writing, math, ...)
    schema: Optional[str] = field(default=None, compare=False)  # a JSON schema the answer follows (structured output)

    @property
    def chat(self) -> bool:
        """Sent with `apply_chat_template`: the server prompts `text` in the model's chat template."""
        return self.template == TOKENIZER

    def ids(self, tokenizer) -> list[int]:
        """Token ids as the preprocessing model makes them."""
        return encode_prompt(tokenizer, self.text, self.chat)


def resolve_chat_template(chat_template: str, tokenizer=None) -> str:
    """The template `chat_template` gives chat rows: `auto` resolved with the model's tokenizer (None: not known, as
    for a server given by URL alone, so Vicuna v1.1, as before chat templates were read)."""
    if chat_template not in CHAT_TEMPLATES:
        raise UserError(f"--chat-template must be one of {', '.join(CHAT_TEMPLATES)}, got {chat_template!r}.")
    if chat_template == TOKENIZER:
        if tokenizer is None:
            raise UserError("--chat-template tokenizer needs the served model's tokenizer; pass engine dirs, or "
                            "--tokenizer DIR with --url.")
        if not has_chat_template(tokenizer):
            raise UserError(f"--chat-template tokenizer: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} "
                            f"has no chat template; use auto (Vicuna v1.1 for it) or vicuna.")
    if chat_template == "auto":
        return VICUNA if tokenizer is None else chat_template_for(tokenizer)
    return chat_template


def applied_template(prompts: list[Prompt]) -> str:
    """The chat template the prompts were given ("none" when no row was templated): what results record, and
    what the gate compares between runs."""
    return next((p.template for p in prompts if p.template != "none"), "none")


STRUCTURED = "structured"  # the dataset name of bench-structured's tasks (bench/structured.py)


def load_prompts(path: str | Path, chat_template: str = "auto", tokenizer=None) -> list[Prompt]:
    """Prompts of a JSONL file: MT-Bench `question.jsonl` rows (first turn) or the project's {"prompt": ...} rows;
    either may carry a "schema" (a JSON schema its answer follows: structured output).

    `auto` prompts MT-Bench questions in the model's chat template (the tokenizer's if it has one, else Vicuna v1.1;
    `resolve_chat_template`) and leaves {"prompt": ...} rows as they are; `tokenizer` / `vicuna` / `none` force
    one template, or none, for every row. `path` may name a dataset: `mt-bench` (datasets.py fetches and caches it)
    or `structured` (bench-structured's tasks, each with its schema, as user turns).
    """
    from ..datasets import read_jsonl, resolve_dataset

    if str(path) == STRUCTURED:
        from .structured import TASKS

        rows = [(f"{STRUCTURED}:{t['name']}", {"turns": [t["prompt"]], "category": t["name"], "schema": t["schema"]})
                for t in TASKS]
    else:
        path = resolve_dataset(path)
        rows = read_jsonl(path, "dataset {path} does not exist; pass a JSONL file of MT-Bench questions or "
                                "{{\"prompt\": ...}}.")
    template = resolve_chat_template(chat_template, tokenizer)
    prompts = []
    for where, row in rows:
        if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            text, chat = str(row["turns"][0]), True
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            text, chat = row["prompt"], chat_template != "auto"
        else:
            raise UserError(f"{where} has neither 'turns' (MT-Bench) nor a string 'prompt'.")
        prompt = chat_prompt(text, template) if chat else Prompt(text)
        schema = row.get("schema")
        if schema is not None and not isinstance(schema, (dict, bool)):
            raise UserError(f"{where}: 'schema' must be a JSON schema (an object), got {type(schema).__name__}.")
        prompts.append(replace(prompt, category=str(row.get("category") or ""),
                               schema=json.dumps(schema) if schema is not None else None))
    if not prompts:
        raise UserError(f"dataset {path} holds no prompts.")
    return prompts


def chat_prompt(user: str, template: str) -> Prompt:
    """`user` as one user message under `template` (tokenizer | vicuna | none)."""
    if template == VICUNA:
        return Prompt(vicuna_prompt(user), VICUNA)
    return Prompt(user, template)


PROMPT_ORDERS = ("categories", "file")


def first_prompts(prompts: list[Prompt], n: int, order: str = "categories") -> list[Prompt]:
    """The first n prompts, in the file's order or spread over its categories.

    `categories` takes the first prompt of every category (in the order the categories first appear), then the
    second of every category, and so on; prompts without a category keep their place after those. MT-Bench lists
    its 80 questions category by category, so its first 8 rows are all `writing`, the category a drafter predicts
    worst; its first 8 spread over categories are one question of each of the 8.
    """
    if order not in PROMPT_ORDERS:
        raise UserError(f"--prompt-order must be one of {', '.join(PROMPT_ORDERS)}, got {order!r}.")
    if order == "categories":
        by_category: dict[str, list[Prompt]] = {}
        for p in prompts:
            if p.category:
                by_category.setdefault(p.category, []).append(p)
        rounds = max(map(len, by_category.values()), default=0)
        spread = [c[i] for i in range(rounds) for c in by_category.values() if i < len(c)]
        prompts = spread + [p for p in prompts if not p.category]
    return prompts[:n]


def pick_prompts(prompts: list, n: int, seed: int) -> list:
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
