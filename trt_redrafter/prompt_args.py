"""The prompts and stop token of `trt-redrafter run`, on either backend: --prompt texts (with --chat, each one user
message in the model's chat template), or --prompt-ids; --tokenizer (default ENGINE/tokenizer), --end-id,
--ignore-eos."""

from __future__ import annotations

from pathlib import Path

from .chat import encode_prompt
from .errors import UserError


def load_prompts(args) -> tuple[object, list[list[int]]]:
    """(tokenizer or None, prompt token ids) from --prompt texts (with --chat: each one user message in the
    model's chat template) or --prompt-ids."""
    if args.chat and args.prompt is None:
        raise UserError("--chat templates --prompt texts; --prompt-ids are decoded as given, so drop one of them.")
    tokenizer = _load_tokenizer(args)
    if args.prompt is None:
        return tokenizer, _parse_ids(args.prompt_ids)
    if tokenizer is None:
        raise UserError(f"--prompt needs a tokenizer but {args.engine} has none; pass --tokenizer DIR or use --prompt-ids.")
    return tokenizer, [encode_prompt(tokenizer, t, chat=args.chat) for t in args.prompt]


def resolve_end_id(args, tokenizer) -> int | None:
    """The stop token: --end-id, else the tokenizer's EOS; None with --ignore-eos or when neither exists."""
    if args.ignore_eos:
        return None
    return args.end_id if args.end_id is not None else (tokenizer.eos_token_id if tokenizer else None)


def _load_tokenizer(args):
    path = Path(args.tokenizer) if args.tokenizer else Path(args.engine) / "tokenizer"
    if not path.is_dir():
        if args.tokenizer:
            raise UserError(f"--tokenizer {path} is not a directory.")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path}: {e}") from e


def _parse_ids(texts: list[str]) -> list[list[int]]:
    out = []
    for t in texts:
        try:
            ids = [int(x) for x in t.replace(" ", ",").split(",") if x]
        except ValueError as e:
            raise UserError(f"--prompt-ids {t!r} is not a comma-separated list of integers.") from e
        if not ids:
            raise UserError("--prompt-ids got an empty prompt; give at least one token id.")
        out.append(ids)
    return out
