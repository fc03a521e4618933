"""A tiny random Llama, Qwen2 or Qwen3 (HF format) + matching Apple-format drafter, for tests and demos. No
downloads.

Layout written under DIR:
    base/      config.json, model.safetensors (fp32), generation_config.json, tokenizer files
               (byte-level BPE trained in-process on Python standard-library docstrings)
    drafter/   config.json (model_type recurrent_drafting_drafter), model.safetensors (Apple tensor names)
    make_tiny.json   the sizes used

Deterministic: the same sizes and seed give byte-identical safetensors files. The base's weights are random
(`LlamaForCausalLM(LlamaConfig(...))` under a fixed seed, RMSNorm gains perturbed away from 1 so sharding mix-ups
show); the drafter's are scaled so its logits are spread out rather than uniform.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import save_file

from ..config import ConfigBase, option
from ..errors import UserError
from ..families import FAMILIES
from ..fsutil import atomic_output_dir, write_json
from ..log import get_logger
from .tokenizer_files import save_tokenizer

log = get_logger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, Llama's order for unk/bos/eos
BYTE_TOKENS = 256  # a byte-level vocabulary always holds every byte
# standard-library modules whose docstrings make the tokenizer's training text (present on any CPython)
CORPUS_MODULES = ("argparse", "collections", "csv", "dataclasses", "decimal", "email.message", "functools",
                  "itertools", "json", "logging", "pathlib", "random", "re", "statistics", "string", "textwrap",
                  "typing", "unittest")


@dataclass
class TinyConfig(ConfigBase):
    """Sizes of the tiny pair (recipe section `make_tiny:`); defaults keep CPU tests fast."""

    SECTION: ClassVar[str] = "make_tiny"

    seed: int = option(0, help="random seed of weights (same seed, same bytes)")
    vocab_size: int = option(384, help="vocabulary size V (>= 260: 256 bytes + 4 special tokens)")
    hidden_size: int = option(64, help="hidden size H")
    num_layers: int = option(2, help="decoder layers")
    num_heads: int = option(4, help="query heads")
    num_kv_heads: int = option(2, help="key/value heads")
    intermediate_size: int = option(128, help="MLP inner size")
    max_position_embeddings: int = option(512, help="context length")
    drafter_layers: int = option(1, help="drafter ResBlocks")
    exit_dim: int = option(0, help="drafter ResBlock width; 0 means 2*hidden_size (no input_proj)")
    rnn: bool = option(True, help="recurrent drafter (rnn_u/rnn_w)")
    tie_word_embeddings: bool = option(False, help="lm_head shares the embedding matrix")
    family: str = option("llama", help="the base's family: llama, qwen2 (q/k/v biases) or qwen3 (per-head q/k "
                                       "norms)", choices=tuple(f.model_type for f in FAMILIES))

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        for n in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                  "max_position_embeddings"):
            v = getattr(self, n)
            if not isinstance(v, int) or v <= 0:
                raise UserError(f"{s}.{n}: expected a positive integer, got {v!r}.")
        if self.vocab_size < BYTE_TOKENS + len(SPECIAL_TOKENS):
            raise UserError(f"{s}.vocab_size: expected at least {BYTE_TOKENS + len(SPECIAL_TOKENS)} (every byte plus "
                            f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}.")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise UserError(f"{s}: num_heads={self.num_heads} must divide hidden_size={self.hidden_size} and "
                            f"num_kv_heads={self.num_kv_heads} must divide num_heads.")
        if (self.hidden_size // self.num_heads) % 2:
            raise UserError(f"{s}: head size hidden_size/num_heads must be even for RoPE.")
        if self.drafter_layers < 0 or self.exit_dim < 0:
            raise UserError(f"{s}: drafter_layers and exit_dim must be >= 0.")

    @property
    def resolved_exit_dim(self) -> int:
        return self.exit_dim or 2 * self.hidden_size


def _corpus() -> list[str]:
    """Docstrings of a fixed list of stdlib modules and their public members, in a fixed order. Members that are
    modules are left out: a package holds a submodule as an attribute only once something in the process imported
    it (`collections.abc`, `unittest.mock`, `logging.handlers`), so with them the bytes depended on what ran before."""
    texts = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        texts.append(inspect.getdoc(mod) or "")
        for attr in sorted(a for a in dir(mod) if not a.startswith("_")):
            with warnings.catch_warnings():  # e.g. typing.io warns when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                member = getattr(mod, attr, None)
                doc = None if inspect.ismodule(member) else inspect.getdoc(member)
            if doc:
                texts.append(doc)
    return [t for t in texts if t]


def build_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """A byte-level BPE `PreTrainedTokenizerFast` of exactly `vocab_size` tokens trained on `texts` (default: a few
    KB of this interpreter's stdlib docstrings), bos added like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(_corpus() if texts is None else texts, trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # the corpus ran out of merges: fill with never-produced tokens so V is exact
        tok.add_tokens([f"<extra_{i}>" for i in range(short)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)


def build_base_model(t: TinyConfig):
    """The family's HF causal LM (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`) with random fp32
    weights drawn under `t.seed`."""
    import transformers

    family = next(f for f in FAMILIES if f.model_type == t.family)
    kw = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
              num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
              max_position_embeddings=t.max_position_embeddings, rms_norm_eps=1e-6, initializer_range=0.1,
              tie_word_embeddings=t.tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if family.qk_layernorm:
        kw["head_dim"] = t.hidden_size // t.num_heads
    name = family.architecture.removesuffix("ForCausalLM")
    cfg = getattr(transformers, f"{name}Config")(**kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        model = getattr(transformers, family.architecture)(cfg).to(torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):  # gains != 1 so a misplaced norm is visible
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape))
                elif pname.endswith("_proj.bias"):  # HF starts biases at 0: random, so a lost bias is visible
                    p.copy_(0.5 * torch.randn(p.shape))
    return model.eval()


def build_drafter_tensors(t: TinyConfig) -> dict[str, torch.Tensor]:
    """Apple drafter tensors (nn.Linear [out, in]); fan-in scaling keeps activations O(1)."""
    g = torch.Generator().manual_seed(t.seed + 1)
    h, e, v = t.hidden_size, t.resolved_exit_dim, t.vocab_size

    def lin(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * (gain / math.sqrt(inp))

    def bias(n: int) -> torch.Tensor:
        return 0.02 * torch.randn(n, generator=g)

    w: dict[str, torch.Tensor] = {}
    if e != 2 * h:
        w["input_proj.weight"], w["input_proj.bias"] = lin(e, 2 * h), bias(e)  # [e, 2H], [e]
    for j in range(t.drafter_layers):
        w[f"lm_head.{j}.linear.weight"], w[f"lm_head.{j}.linear.bias"] = lin(e, e, 0.5), bias(e)  # [e, e], [e]
    w[f"lm_head.{t.drafter_layers}.weight"] = lin(v, e, 3.0)  # [V, e]: logit std ~3, far from uniform
    if t.rnn:
        w["rnn_u.weight"], w["rnn_u.bias"], w["rnn_w.weight"] = lin(h, h), bias(h), lin(h, h)  # [H, H], [H], [H, H]
    return {k: x.contiguous() for k, x in w.items()}


def drafter_config_json(t: TinyConfig) -> dict:
    return {"model_type": "recurrent_drafting_drafter", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
            "exit_dim": t.resolved_exit_dim, "num_draft_layers": t.drafter_layers, "num_lookback_tokens": -1,
            "rnn": t.rnn, "torch_dtype": "float32"}


def make_tiny(output: str | Path, t: TinyConfig | None = None, force: bool = False) -> Path:
    """Write the tiny base + drafter pair under `output` (atomically)."""
    t = t or TinyConfig()
    t.validate()
    output = Path(output)
    tokenizer = build_tokenizer(t.vocab_size)
    model = build_base_model(t)
    drafter = build_drafter_tensors(t)
    with atomic_output_dir(output, force=force, what="make-tiny output") as tmp:
        model.save_pretrained(tmp / "base")
        save_tokenizer(tokenizer, tmp / "base")  # transformers 4.5x and 5.x
        (tmp / "drafter").mkdir()
        with open(tmp / "drafter" / "config.json", "w") as f:
            json.dump(drafter_config_json(t), f, indent=2)
        save_file(drafter, str(tmp / "drafter" / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "make_tiny.json", t.to_dict())
    log.info("wrote tiny %s + drafter to %s (V=%d, H=%d, %d layers)", t.family, output, t.vocab_size, t.hidden_size,
             t.num_layers)
    return output
