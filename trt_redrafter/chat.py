"""The prompt a chat model gets for one user message: its tokenizer's chat template, else FastChat's Vicuna v1.1.

The one place that decides, for `run --chat`, the preprocessing model's `apply_chat_template` input (what
`generate --chat` sends), `bench`, `bench-engine` and the OpenAI frontend's /v1/chat/completions (whole
conversations: `chat_ids`). A model that ships a chat template
(`tokenizer.chat_template`, Hugging Face's `apply_chat_template`) is prompted the way it was tuned; Vicuna's
tokenizer ships none, and Vicuna gets the template its MT-Bench runs (and the ReDrafter paper's) used.

BOS: templates usually write the BOS text themselves (Llama 2/3: `{{ bos_token }}...`), and encoding that text
with special tokens would put a second BOS before it. Templated text is therefore tokenized as
`apply_chat_template(tokenize=True)` does, without added special tokens; the Vicuna text is plain text and is
encoded like any prompt, with the tokenizer's own BOS.

Imported by the pre/postprocessing models of a generated Triton repository (serving/repo.py TEXT_MODULES): keep it
free of torch and of other trt_redrafter modules but `errors`.
"""

from __future__ import annotations

from .errors import UserError

# FastChat's "vicuna_v1.1" conversation template (the one Vicuna and the ReDrafter paper's MT-Bench runs use).
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
TOKENIZER = "tokenizer"  # the tokenizer's own chat template
VICUNA = "vicuna"  # FastChat's Vicuna v1.1


def vicuna_prompt(user: str) -> str:
    return f"{VICUNA_SYSTEM} USER: {user} ASSISTANT:"


def vicuna_conversation(messages: list[dict]) -> str:
    """A whole conversation in FastChat's vicuna_v1.1 layout: the system text (a system message's, else
    VICUNA_SYSTEM), then `USER: u` turns followed by " " and `ASSISTANT: a` turns by "</s>", ending with
    `ASSISTANT:` for the reply. One user message gives exactly `vicuna_prompt(user)`."""
    system = " ".join(m["content"] for m in messages if m.get("role") == "system") or VICUNA_SYSTEM
    text = system + " "
    for m in messages:
        if m.get("role") == "user":
            text += f"USER: {m['content']} "
        elif m.get("role") == "assistant":
            text += f"ASSISTANT: {m['content']}</s>"
    return text + "ASSISTANT:"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_template_for(tokenizer) -> str:
    """Which template a user message to this tokenizer's model gets: TOKENIZER when it has one, else VICUNA."""
    return TOKENIZER if has_chat_template(tokenizer) else VICUNA


def chat_prompt_ids(tokenizer, user: str) -> list[int]:
    """Token ids of `user` as the one user turn of a new chat, the assistant's reply to follow."""
    return chat_ids(tokenizer, [{"role": "user", "content": user}])


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ending with a user turn, the assistant's reply to follow (Vicuna: the
    conversation in FastChat's layout, `vicuna_conversation`)."""
    if chat_template_for(tokenizer) == VICUNA:
        return list(tokenizer.encode(vicuna_conversation(messages)))
    # what a broken template raises: transformers renders chat templates with jinja2
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as e:
        raise UserError(f"the tokenizer's chat template failed on a user message ({type(e).__name__}: {e}); fix "
                        f"chat_template in its tokenizer_config.json / chat_template.jinja.") from e
    return [int(i) for i in ids]


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """A prompt's ids: `text` as one user message of a chat (chat=True), else plain text with the tokenizer's BOS."""
    return chat_prompt_ids(tokenizer, text) if chat else list(tokenizer.encode(text))
