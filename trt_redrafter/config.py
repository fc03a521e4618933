"""Typed configuration: one dataclass per concern, JSON/YAML round trip, validation that names the field.

Terms used across the project (the one place they are defined):
    bs   batch size (requests in a step)
    nb   num_beams           = Apple `beam_width`   = TensorRT-LLM `redrafter_num_beams`
    dl   draft_len_per_beam  = TensorRT-LLM `redrafter_draft_len_per_beam` (drafted tokens per beam)
    bl   beam length         = dl + 1 = Apple `beam_length` (it counts the "true" token each beam starts with)
    H    hidden size, V vocabulary size, Vp vocabulary padded to a multiple of tp
    tp   tensor-parallel size

CLI flags are derived from these fields (kebab-case), so a flag and a recipe key are always the same thing.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Sequence, get_args

import yaml

from .errors import UserError
from .families import ARCHITECTURES

DTYPES = ("float16", "bfloat16", "float32")


class DecodingMode(str, enum.Enum):
    """How a request is decoded: with draft trees (TREE; "redrafter" on the wire, TensorRT-LLM's name), or one token
    per step (AR). Requests arrive with the wire names; the engine parses them into these (`DecodingMode(name)`)."""

    TREE = "redrafter"
    AR = "ar"

    def __str__(self) -> str:
        return self.value


class AcceptanceRule(str, enum.Enum):
    """How drafted tokens are accepted (decoding/acceptance.py): a request asks for one (SamplingConfig.acceptance),
    and a batch's step runs one (apple where any request asks for it, greedy where every request is greedy, else
    exact, whose counter-based draws give greedy rows their argmax)."""

    GREEDY = "greedy"
    EXACT = "exact"
    APPLE = "apple"

    def __str__(self) -> str:
        return self.value


# The vocabularies of mode strings, named once.
DrafterSemantics = Literal["apple", "trtllm-0.13"]  # see model/drafter.py
CompileMode = Literal["auto", "off", "inductor", "cudagraphs", "inductor+cudagraphs"]
KernelChoice = Literal["auto", "triton", "cpu", "torch"]
LinearChoice = Literal["auto", "torch", "onednn", "avx512"]  # see model/linear.py
ProposerName = Literal["redrafter", "ngram", "mixed"]  # what fills a speculative request's draft tree
DECODING_MODES: tuple[str, ...] = tuple(m.value for m in DecodingMode)
ACCEPTANCE_RULES: tuple[str, ...] = tuple(r.value for r in AcceptanceRule)
DRAFTER_SEMANTICS: tuple[str, ...] = get_args(DrafterSemantics)
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
KERNEL_CHOICES: tuple[str, ...] = get_args(KernelChoice)
LINEAR_CHOICES: tuple[str, ...] = get_args(LinearChoice)
PROPOSERS: tuple[str, ...] = get_args(ProposerName)
class GuideType(str, enum.Enum):
    """What constrains a request's output (runtime/grammar.py), in TensorRT-LLM's Triton names
    (`guided_decoding_guide_type`): any JSON value's object (JSON, no source), a JSON schema, a regular expression, an
    EBNF grammar (GBNF, as xgrammar and llama.cpp write it) or an xgrammar structural tag (JSON)."""

    JSON = "json"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf_grammar"
    STRUCTURAL_TAG = "structural_tag"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Guide:
    """A request's output constraint: its type and source (a schema's JSON text, a regex, a grammar; "" for JSON)."""

    kind: GuideType
    source: str = ""

    @classmethod
    def parse(cls, kind: str, source: str = "") -> "Guide":
        """From the wire's names; one sentence naming the accepted ones otherwise."""
        try:
            guide_type = GuideType(kind)
        except ValueError:
            raise UserError(f"guided decoding type must be one of {', '.join(t.value for t in GuideType)}, got "
                            f"{kind!r}.") from None
        if guide_type is not GuideType.JSON and not source.strip():
            raise UserError(f"guided decoding type {guide_type} needs its source (the schema, regex or grammar); "
                            f"got an empty one.")
        return cls(guide_type, source)


NGRAM_WHEN = ("auto", "always", "matched")  # ProposerConfig.ngram_when


def torch_dtype(name: str):
    """The torch dtype named by one of DTYPES (torch is imported only when needed)."""
    import torch

    assert name in DTYPES, (name, DTYPES)
    return getattr(torch, name)


def option(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, cli: bool = True,
           negative_aliases: tuple[str, ...] = (), **kw):
    """A dataclass field carrying its CLI flag's help text and choices (`cli=False`: no flag; `negative_aliases`:
    more flags that set a bool field false)."""
    md = {"help": help, "choices": choices, "cli": cli, "negative_aliases": negative_aliases}
    if default is dataclasses.MISSING and "default_factory" not in kw:
        return field(metadata=md, **kw)
    return field(default=default, metadata=md, **kw) if default is not dataclasses.MISSING else field(metadata=md, **kw)


def bad_value(section: str, name: str, expected: str, got: Any) -> UserError:
    return UserError(f"{section}.{name}: expected {expected}, got {got!r}.")


class ConfigBase:
    """Shared behaviour: dict/JSON/YAML round trip, strict keys, type checks, CLI flags."""

    SECTION: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> "ConfigBase":
        if not isinstance(d, dict):
            raise UserError(f"{where or cls.SECTION}: expected a mapping, got {type(d).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UserError(
                f"{where or cls.SECTION}: unknown key(s) {', '.join(unknown)}; known keys are {', '.join(sorted(names))}."
            )
        kwargs = {k: _coerce(cls, k, v) for k, v in d.items()}
        try:
            obj = cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise UserError(f"{where or cls.SECTION}: {e}.") from e
        obj.validate()
        return obj

    def validate(self) -> None:
        """Raise UserError naming the first bad field: here, a field outside its option's `choices`. Subclasses
        extend it, calling it first."""
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and value not in choices and not (value is None and f.default is None):
                raise bad_value(self.SECTION, f.name, f"one of {', '.join(str(c) for c in choices if c != '')}",
                                value)

    def replace(self, **changes) -> "ConfigBase":
        obj = dataclasses.replace(self, **changes)
        obj.validate()
        return obj

    # ---- CLI ---------------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Add `--field-name` flags (default None, so a recipe value survives unless the flag is given). The parser
        remembers which fields they were: `from_sources` reads only those from the parsed namespace, so a flag of
        another config that happens to share a field name never sets this one."""
        hints = typing.get_type_hints(cls)
        added = []
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or (only is not None and f.name not in only):
                continue
            flag = "--" + f.name.replace("_", "-")
            typ = _base_type(hints[f.name])
            helptext = f.metadata.get("help", "")
            if typ is bool:
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                    help=helptext)
                for alias in f.metadata.get("negative_aliases", ()):
                    parser.add_argument(alias, dest=f.name, action="store_false", default=None,
                                        help=f"alias of --no-{flag[2:]}")
            elif typ in (int, float, str):
                parser.add_argument(flag, dest=f.name, type=typ, default=None, help=helptext,
                                    choices=f.metadata.get("choices"))
            else:
                continue
            added.append(f.name)
        key = cls._owned_key()
        parser.set_defaults(**{key: tuple(parser.get_default(key) or ()) + tuple(added)})

    @classmethod
    def _owned_key(cls) -> str:
        return f"_cli_fields_{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def from_sources(cls, recipe: dict | None, args: argparse.Namespace | None, base: dict | None = None,
                     flags: dict | None = None):
        """Merge, lowest priority first: `base` (e.g. values read from a model), the recipe's section, then the
        flags: this config's own (those `add_cli_args` added to the parser that made `args`) and `flags`, values
        the command maps from flags of its own (a None value is a flag not given)."""
        d: dict = dict(base or {})
        if recipe:
            sec = recipe.get(cls.SECTION, {})
            if not isinstance(sec, dict):
                raise UserError(f"recipe section '{cls.SECTION}' must be a mapping, got {type(sec).__name__}.")
            d.update(sec)
        given = dict(flags or {})
        if args is not None:
            given.update({name: getattr(args, name) for name in getattr(args, cls._owned_key(), ())})
        d.update({k: v for k, v in given.items() if v is not None})
        return cls.from_dict(d, where=cls.SECTION)


def _base_type(t):
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else object
    return t


def _coerce(cls, name: str, value: Any) -> Any:
    hints = typing.get_type_hints(cls)
    if name not in hints:
        return value
    t = _base_type(hints[name])
    if value is None:
        return value
    if t is bool and not isinstance(value, bool):
        raise bad_value(cls.SECTION, name, "true or false", value)
    if t is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_value(cls.SECTION, name, "an integer", value)
    if t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_value(cls.SECTION, name, "a number", value)
        return float(value)
    if t is str and not isinstance(value, str):
        raise bad_value(cls.SECTION, name, "a string", value)
    return value


def check_positive(section: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise bad_value(section, name, "a positive integer", value)


@dataclass
class ModelConfig(ConfigBase):
    """The base model (a Llama-family decoder: Llama/Vicuna, Qwen2, Qwen3), in TensorRT-LLM's vocabulary
    (`norm_epsilon`, `rotary_base`, `attn_bias`, ...)."""

    SECTION: ClassVar[str] = "model"

    vocab_size: int = option(help="vocabulary size V")
    hidden_size: int = option(help="hidden size H")
    intermediate_size: int = option(help="MLP inner size I")
    num_hidden_layers: int = option(help="decoder layers")
    num_attention_heads: int = option(help="query heads")
    num_key_value_heads: int = option(help="key/value heads (< num_attention_heads means grouped-query attention)")
    head_size: int = option(0, help="per-head size; 0 means hidden_size // num_attention_heads")
    max_position_embeddings: int = option(2048, help="context length the model was trained for")
    norm_epsilon: float = option(1e-6, help="RMSNorm epsilon (HF rms_norm_eps)")
    rotary_base: float = option(10000.0, help="RoPE theta (HF rope_theta)")
    rotary_scaling: Optional[dict] = option(None, help="RoPE scaling as TensorRT-LLM stores it ({'type': ..., 'factor': ...})",
                                        cli=False)
    hidden_act: str = option("silu", help="MLP activation")
    tie_word_embeddings: bool = option(False, help="lm_head shares the embedding matrix")
    dtype: str = option("float16", help="weight dtype", choices=DTYPES)
    architecture: str = option("LlamaForCausalLM", help="Hugging Face architecture of the base model (its family: "
                                                        "trt_redrafter/families.py)", choices=ARCHITECTURES)
    attn_bias: bool = option(False, help="q/k/v projections have a bias (Qwen2)")
    qk_layernorm: bool = option(False, help="RMSNorm over each head of q and k before RoPE (Qwen3)")

    def __post_init__(self):
        if not self.head_size and self.num_attention_heads:
            self.head_size = self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_size", "max_position_embeddings"):
            check_positive(s, n, getattr(self, n))
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad_value(s, "num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}",
                       self.num_key_value_heads)
        if self.hidden_act != "silu":
            raise bad_value(s, "hidden_act", "'silu' (Llama's gated MLP)", self.hidden_act)
        if self.rotary_scaling is not None:
            from .rope import validate_rotary_scaling
            validate_rotary_scaling(self.rotary_scaling, f"{s}.rotary_scaling")


@dataclass
class DrafterConfig(ConfigBase):
    """Apple's recurrent drafter (`DrafterConfig` of ml-recurrent-drafter)."""

    SECTION: ClassVar[str] = "drafter"

    vocab_size: int = option(help="drafter vocabulary (must equal the base model's)")
    hidden_size: int = option(help="must equal the base model's hidden size H")
    exit_dim: int = option(help="ResBlock width; 2*H means no input_proj")
    num_draft_layers: int = option(help="number of ResBlocks")
    rnn: bool = option(False, help="recurrent state SiLU(W e + U s); otherwise the cumulative embedding sum")
    draft_vocab_size: int = option(0, help="0: the head scores the whole vocabulary (Apple's and TensorRT-LLM's "
                                       "format); K: it scores only the K token ids of its `draft_vocab` tensor "
                                       "(a frequency-ranked draft vocabulary, FR-Spec; this project's runtime only)")
    replicated: bool = option(False, help="every TP rank holds the whole drafter and runs it alone, where the TP size does "
                                      "not divide its dimensions (draft TP 1, as vLLM runs draft models; this "
                                      "project's runtime only: TensorRT-LLM splits the drafter)", cli=False)

    def validate(self) -> None:
        super().validate()
        for n in ("vocab_size", "hidden_size", "exit_dim"):
            check_positive(self.SECTION, n, getattr(self, n))
        if not isinstance(self.num_draft_layers, int) or self.num_draft_layers < 0:
            raise bad_value(self.SECTION, "num_draft_layers", "a non-negative integer", self.num_draft_layers)
        k = self.draft_vocab_size
        if not isinstance(k, int) or isinstance(k, bool) or k < 0 or k > self.vocab_size:
            raise bad_value(self.SECTION, "draft_vocab_size", f"0 (the whole vocabulary) or 1..{self.vocab_size}", k)

    @property
    def head_rows(self) -> int:
        """Rows of the drafter's lm_head: the draft vocabulary's size, or the whole vocabulary's."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def has_input_proj(self) -> bool:
        return self.exit_dim != 2 * self.hidden_size


@dataclass
class ReDrafterConfig(ConfigBase):
    """The speculative-decoding shape, fixed when a checkpoint is converted (TensorRT-LLM unrolls it). Its defaults,
    5 x 5, are TensorRT-LLM's converter's (examples/redrafter/convert_checkpoint.py); `ReDrafterConfig.project()` is
    the tree this project's own engines default to."""

    SECTION: ClassVar[str] = "redrafter"

    num_beams: int = option(5, help="beams explored by the drafter (nb; Apple beam_width)")
    draft_len_per_beam: int = option(5, help="drafted tokens per beam (dl; Apple beam_length - 1)")
    greedy_search: bool = option(True, help="greedy verification engine (TensorRT-LLM redrafter_greedy_search; "
                                            "--no-greedy: its --redrafter_no_greedy_search)",
                                 negative_aliases=("--no-greedy",))

    def validate(self) -> None:
        super().validate()
        check_positive(self.SECTION, "num_beams", self.num_beams)
        check_positive(self.SECTION, "draft_len_per_beam", self.draft_len_per_beam)

    @classmethod
    def project(cls) -> "ReDrafterConfig":
        """4 beams x 4 drafted tokens: what an engine without a drafter (N-gram proposers) drafts and what
        train-drafter trains for (--draft-len), the shape of the committed drafters (docs/models.md)."""
        return cls(num_beams=4, draft_len_per_beam=4)

    @property
    def beam_length(self) -> int:
        """bl: Apple's beam length, which counts the true token."""
        return self.draft_len_per_beam + 1

    @property
    def max_draft_tokens(self) -> int:
        return self.num_beams * self.draft_len_per_beam

    @property
    def max_tree_tokens(self) -> int:
        """Most tokens one verify step feeds per request: the true token plus every drafted token."""
        return 1 + self.max_draft_tokens


@dataclass
class BuildConfig(ConfigBase):
    """Engine limits, named as `trtllm-build` names them."""

    SECTION: ClassVar[str] = "build"

    max_batch_size: int = option(8, help="most requests decoded together")
    max_input_len: int = option(1024, help="longest prompt in tokens")
    max_seq_len: int = option(2048, help="longest prompt + output in tokens")
    max_num_tokens: int = option(0, help="most tokens in one engine step; 0 derives it from the other limits")
    kv_block_size: int = option(64, help="tokens per paged KV-cache block (torch backend)")
    max_tokens_in_paged_kv_cache: int = option(0, help="KV-cache capacity in tokens (torch backend); 0 sizes it for "
                                                   "max_batch_size requests of max_seq_len tokens")
    dtype: str = option("", help="compute dtype; empty means the checkpoint's dtype", choices=DTYPES + ("",))
    drafter_semantics: str = option("apple", help="the drafter's math baked into the engine: apple (what Apple's trainer "
                                              "and train-drafter optimise, and what TensorRT-LLM >= 0.14's "
                                              "ReDrafterForLLaMALM graph computes: SiLU on the RNN state update, "
                                              "beam search over the top-50 warp) or trtllm-0.13 (the graph of "
                                              "TensorRT-LLM <= 0.13, which omits both; torch backend only); greedy "
                                              "output is the same either way, the drafts and so the speed are not "
                                              "(model/drafter.py)", choices=DRAFTER_SEMANTICS)

    def validate(self) -> None:
        super().validate()
        for n in ("max_batch_size", "max_input_len", "max_seq_len", "kv_block_size"):
            check_positive(self.SECTION, n, getattr(self, n))
        if self.max_input_len >= self.max_seq_len:
            raise bad_value(self.SECTION, "max_input_len", f"less than max_seq_len={self.max_seq_len}", self.max_input_len)
        if self.max_tokens_in_paged_kv_cache < 0:
            raise bad_value(self.SECTION, "max_tokens_in_paged_kv_cache", "0 (derive) or a positive integer",
                       self.max_tokens_in_paged_kv_cache)
        if self.max_num_tokens < 0:
            raise bad_value(self.SECTION, "max_num_tokens", "0 (derive) or a positive integer", self.max_num_tokens)

    def check_request(self, prompt: Sequence[int], max_tokens: int, vocab_size: int) -> None:
        """One request against the engine's limits (both backends, before it reaches an engine): one sentence on
        what is wrong and what to ask instead."""
        if not prompt:
            raise UserError("the prompt is empty; give at least one token.")
        if len(prompt) > self.max_input_len:
            raise UserError(f"the prompt has {len(prompt)} tokens but the engine's max_input_len is "
                            f"{self.max_input_len}; shorten it or rebuild with a larger --max-input-len.")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size}).")
        if max_tokens > self.max_seq_len - len(prompt):
            raise UserError(f"max_tokens={max_tokens} with a {len(prompt)}-token prompt exceeds the engine's "
                            f"max_seq_len={self.max_seq_len}; ask for at most {self.max_seq_len - len(prompt)} tokens.")

    def resolved_max_num_tokens(self, redrafter: ReDrafterConfig | None) -> int:
        """trtllm-build raises max_num_tokens to at least max_batch_size * (max_draft_len + 1)."""
        tree = redrafter.max_tree_tokens if redrafter else 1
        floor = self.max_batch_size * tree
        return max(self.max_num_tokens or max(self.max_input_len, 8192), floor)


@dataclass
class ProposerConfig(ConfigBase):
    """What drafts an engine's trees (build time; `run`, the Triton `proposer` input and `bench` override the
    proposer per request). See runtime/ngram.py for the learning-free proposers."""

    SECTION: ClassVar[str] = "proposer"

    proposer: str = option("", help="default drafts of a speculative request: redrafter (the trained drafter's beam "
                                "search), ngram (learning-free: context N-grams, then the base's own bigrams), "
                                "mixed (ReDrafter's beams, the lowest-ranked ones replaced by context N-gram "
                                "matches); empty: redrafter when the engine has a drafter, else ngram",
                       choices=("",) + PROPOSERS)
    ngram_beams: int = option(0, help="beams of a mixed tree that context N-gram matches may take (0: half of "
                                  "num_beams, at least 1)")
    ngram_min: int = option(1, help="shortest context match in tokens")
    ngram_max: int = option(4, help="longest context match in tokens (matches are tried longest first)")
    ngram_when: str = option("auto", help="what an N-gram request proposes: always (context matches, then the model's "
                                      "bigram drafts), matched (context matches only; with none, nothing: an AR "
                                      "step); auto: always on a GPU, where a few more verified tokens cost almost "
                                      "nothing, matched on a CPU",
                         choices=NGRAM_WHEN)
    mixed_min_match: int = option(3, help="shortest context match that may take a drafter beam's place in a mixed tree "
                                      "(short matches are right less often than a trained drafter)")
    model_ngrams: str = option("auto", help="precompute the base's bigram drafts from its weights at build time "
                                         "(ngrams.safetensors: one forward pass per vocabulary entry): on, off, or "
                                         "auto: on a GPU, or on a CPU when it takes minutes (a model of a few "
                                         "hundred million parameters; a 7B one would take hours). Without the "
                                         "table N-gram drafts come from the context alone",
                           choices=("auto", "on", "off"))

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        if not isinstance(self.ngram_beams, int) or self.ngram_beams < 0:
            raise bad_value(s, "ngram_beams", "0 (half the beams) or a positive integer", self.ngram_beams)
        check_positive(s, "ngram_min", self.ngram_min)
        check_positive(s, "ngram_max", self.ngram_max)
        if self.ngram_max < self.ngram_min:
            raise bad_value(s, "ngram_max", f"at least ngram_min={self.ngram_min}", self.ngram_max)
        check_positive(s, "mixed_min_match", self.mixed_min_match)

    def resolved(self, has_drafter: bool, num_beams: int) -> "ProposerConfig":
        """The default proposer and mixed split made explicit for an engine."""
        proposer = self.proposer or ("redrafter" if has_drafter else "ngram")
        if proposer != "ngram" and not has_drafter:
            raise UserError(f"--proposer {proposer} needs a drafter, and this engine has none; build with "
                            f"--drafter DIR, or use --proposer ngram.")
        k = self.ngram_beams or max(1, num_beams // 2)
        if k > num_beams:
            raise bad_value(self.SECTION, "ngram_beams", f"at most num_beams={num_beams}", self.ngram_beams)
        return self.replace(proposer=proposer, ngram_beams=k)


MAX_SEED = 2**63  # exclusive: a request's seed is kept in an int64 tensor


@dataclass
class SamplingConfig(ConfigBase):
    """Per-request decoding parameters."""

    SECTION: ClassVar[str] = "sampling"

    max_tokens: int = option(64, help="most new tokens to generate")
    temperature: float = option(0.0, help="0 means greedy")
    top_k: int = option(0, help="keep the k most likely tokens (0: all)")
    top_p: float = option(1.0, help="nucleus mass to keep (1.0: all)")
    seed: int = option(0, help="random seed of this request's sampler")
    acceptance: str = option("", help="greedy | exact | apple; empty picks greedy at temperature 0, else exact",
                         choices=("",) + ACCEPTANCE_RULES)
    logprobs: bool = option(False, help="return each output token's log-probability: the model's, log_softmax of its "
                                        "logits before temperature, top-k and top-p (decoding/logprobs.py)")
    top_logprobs: int = option(0, help="with each output token, the N most likely tokens there and their "
                                       "log-probabilities (up to the engine's max_logprobs; implies logprobs)")

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        check_positive(s, "max_tokens", self.max_tokens)
        if self.top_logprobs < 0:
            raise bad_value(s, "top_logprobs", "an integer >= 0", self.top_logprobs)
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise bad_value(s, "temperature", "a finite number >= 0", self.temperature)
        if self.top_k < 0:
            raise bad_value(s, "top_k", "an integer >= 0", self.top_k)
        if not 0.0 < self.top_p <= 1.0:
            raise bad_value(s, "top_p", "a number in (0, 1]", self.top_p)
        if not 0 <= self.seed < MAX_SEED:  # it lives in an int64 tensor (runtime/state.py); 2**63 would overflow it
            raise bad_value(s, "seed", "an integer in [0, 2**63)", self.seed)
        if self.acceptance == "greedy" and self.temperature > 0:
            raise bad_value(s, "acceptance", "exact or apple when temperature > 0", self.acceptance)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def resolved_acceptance(self) -> AcceptanceRule:
        if self.acceptance:
            return AcceptanceRule(self.acceptance)
        return AcceptanceRule.GREEDY if self.greedy else AcceptanceRule.EXACT


@dataclass
class RuntimeConfig(ConfigBase):
    """How this process runs an engine (torch backend); `run`, `serve` (engine-model parameters) and `bench` take
    the same fields. Nothing here changes the tokens an engine produces."""

    SECTION: ClassVar[str] = "runtime"

    device: str = option("auto", help="auto (CUDA when visible), cpu or cuda", choices=("auto", "cpu", "cuda"))
    dtype: str = option("", help="compute dtype; empty means the engine's", choices=DTYPES + ("",))
    drafter_dtype: str = option("", help="the drafter's compute dtype; empty: bfloat16 for a float32 engine on a CPU "
                                     "with AVX512-BF16 and the avx512 linear layers, else the model's. The drafter "
                                     "only proposes and the model verifies every token, so it changes how many tokens "
                                     "a step accepts, not which (greedy); bfloat16 halves a float32 engine's drafter "
                                     "reads", choices=DTYPES + ("",))
    drafter_weights: str = option("auto", help="int8: the drafter's linear layers as int8 weights, one scale per "
                                         "output channel (quantized at load, computed in its dtype), half the bytes a "
                                         "drafted token reads in bfloat16; w8a8: the same weights, and each layer's "
                                         "input quantized to int8 per row, multiplied in bytes (AVX512-VNNI CPUs; "
                                         "elsewhere as int8); w4a8: as w8a8, the head (the drafter's largest "
                                         "layer) in int4 weights; empty: as stored; auto (default): w8a8 where the "
                                         "drafter runs this project's AVX-512 kernels on a CPU with VNNI, else as "
                                         "stored. Like drafter_dtype they change how many tokens a step accepts, not "
                                         "which (greedy)",
                                  choices=("auto", "", "int8", "w8a8", "w4a8"))
    drafter_semantics: str = option("", help="override the engine's drafter math (build-engine --drafter-semantics): "
                                         "apple or trtllm-0.13; empty means the engine's (model/drafter.py)",
                                choices=DRAFTER_SEMANTICS + ("",))
    kv_cache_tokens: int = option(0, help="KV-cache capacity in tokens; 0 means the engine's")
    enable_chunked_context: bool = option(True, help="chunked prefill (TensorRT-LLM's enable_chunked_context): a "
                                                     "prompt longer than what is left of a step's token budget "
                                                     "(max_num_tokens) is prefilled over several steps, beside the "
                                                     "running requests' decode steps; output is the same either way")
    max_num_tokens: int = option(0, help="most tokens one step computes (prompt chunks plus decode steps); 0: the "
                                         "engine's (build-engine --max-num-tokens)")
    kv_cache_reuse: bool = option(True, help="prefix reuse (TensorRT-LLM's enable_kv_cache_reuse): full KV blocks of "
                                             "committed tokens are kept, keyed by their tokens, and a request whose "
                                             "text starts with them prefills only the rest; output is the same "
                                             "either way (runtime/kv_cache.py). Off for TP > 1 and for dynamic-NTK "
                                             "RoPE models")
    max_logprobs: int = option(20, help="the most top log-probabilities a request may ask for (vLLM's max_logprobs; "
                                        "OpenAI allows 20): a step with log-probabilities finds this many most "
                                        "likely tokens per emitted token")
    warmup_guided: bool = option(False, help="the warm-up also compiles the steps of requests with a grammar "
                                             "(structured output), which otherwise compile on the first such request: "
                                             "for a server that expects them; it doubles the tree steps' warm-up")
    compile: str = option("auto", help="decode-step compilation: off (eager), inductor (torch.compile), cudagraphs "
                                   "(captured per batch bucket), inductor+cudagraphs; auto: cudagraphs on CUDA, "
                                   "inductor on a one-rank CPU engine, off for TP > 1 on the CPU (and for a "
                                   "one-shot `run` on the CPU)", choices=COMPILE_MODES)
    kernels: str = option("auto", help="custom kernels: triton (trt_redrafter.plugins, CUDA), cpu (trt_redrafter/cpu's "
                                   "C++ tree attention, AVX-512 CPUs, built at first use); auto: triton on CUDA when "
                                   "triton imports, cpu on a CPU that has AVX-512 for the engine's dtype; torch keeps "
                                   "the PyTorch path", choices=KERNEL_CHOICES)
    linear: str = option("auto", help="the model's and drafter's linear layers on the CPU, weights packed once at load "
                                  "and a token's logits the same whatever else shares the GEMM: avx512 (this "
                                  "project's kernel, trt_redrafter/cpu/linear.cpp, built at first use; float32 on "
                                  "AVX-512, bfloat16 on AVX512-BF16), onednn (one oneDNN GEMM per layer); or torch "
                                  "(F.linear). avx512 and onednn round otherwise than F.linear, so bf16 tokens may "
                                  "differ from torch's. auto: onednn for bf16 float layers on a CPU with AMX tiles "
                                  "(inputs padded to 16 rows, where a tree's rows cost about what one row costs; "
                                  "after a check at load that a row's bits do not depend on the rows beside it), "
                                  "else avx512 where the CPU has it, else onednn where oneDNN computes the dtype "
                                  "natively, torch elsewhere and on CUDA (model/linear.py)",
                     choices=LINEAR_CHOICES)
    threads: int = option(0, help="torch CPU threads in this process (0: torch's default)")
    profile_phases: bool = option(False, help="time each phase of every step (verify/accept/rewind/draft/pack); the "
                                          "phases then run as separate graphs, so steps are a little slower (the "
                                          "speculation policy's cost model still times whole steps)")
    speculate: str = option("auto", help="how much of each draft tree a step verifies: auto (the speculation policy: the "
                                     "nodes whose expected acceptance, from the proposer's own confidence calibrated "
                                     "on this engine's outcomes, pays for what they add to the step, by a cost model "
                                     "measured on this machine at load and cached beside the engine; down to AR "
                                     "steps where nothing pays, as at large batches), full (every tree whole, every "
                                     "step: what TensorRT-LLM does), or N (the N most confident nodes, root included, "
                                     "every step). Output is the same whichever; speed is not (runtime/policy.py)")
    draft_beams: str = option("all", help="beams the drafter searches in a step that drafts: all (the engine's "
                                          "--num-beams), auto (with --speculate auto, the speculation policy chooses "
                                          "among 1, 2, 4, ... all, by what the trees at hand would earn with fewer and "
                                          "what drafting costs), or N (one of those counts, every drafting step). "
                                          "Fewer beams draft smaller trees for less. Counts below all need a step "
                                          "that drafts any count: eager, or inductor on the CPU")
    draft_depth: str = option("auto", help="tokens each beam drafts in a step that drafts: all (the engine's "
                                           "--draft-len-per-beam), auto (with --speculate auto, the speculation "
                                           "policy chooses among 1 .. all, by what the trees at hand earn at each "
                                           "depth and what each depth's read of the drafter's weights costs), or N "
                                           "(every drafting step). Depths below all need a step that stops drafting "
                                           "early: the CPU, eager or inductor; elsewhere auto is all")

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        if self.max_num_tokens < 0:
            raise bad_value(s, "max_num_tokens", "0 (the engine's) or a positive integer", self.max_num_tokens)
        if self.kv_cache_tokens < 0:
            raise bad_value(s, "kv_cache_tokens", "0 (the engine's) or a positive integer", self.kv_cache_tokens)
        if self.threads < 0:
            raise bad_value(s, "threads", "0 (torch's default) or a positive integer", self.threads)
        if self.max_logprobs < 0:
            raise bad_value(s, "max_logprobs", "an integer >= 0", self.max_logprobs)
        if Speculation.parse(self.speculate) is None:
            raise bad_value(s, "speculate", "auto, full or a positive number of tree nodes", self.speculate)
        if self.draft_beams not in ("all", "auto") and not (self.draft_beams.isdigit() and int(self.draft_beams) > 0):
            raise bad_value(s, "draft_beams", "all, auto or a positive number of beams", self.draft_beams)
        if self.draft_depth not in ("all", "auto") and not (self.draft_depth.isdigit() and int(self.draft_depth) > 0):
            raise bad_value(s, "draft_depth", "all, auto or a positive number of tokens", self.draft_depth)

    @property
    def speculation(self) -> "Speculation":
        return Speculation.parse(self.speculate)


@dataclass(frozen=True)
class Speculation:
    """`--speculate`, parsed once: the policy decides by the cost model (`auto`), or every step verifies a fixed number
    of each tree's best nodes (`nodes`; None: every tree whole, `full`)."""

    auto: bool
    nodes: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> Optional["Speculation"]:
        """auto | full | N (N >= 1) -> the spec; None for anything else (RuntimeConfig.validate names it)."""
        if text in ("auto", "full"):
            return cls(text == "auto")
        return cls(False, int(text)) if text.isdigit() and int(text) >= 1 else None

    def fixed_width(self, max_tree_tokens: int) -> Optional[int]:
        """The nodes every step verifies (None: the policy decides)."""
        if self.auto:
            return None
        return max_tree_tokens if self.nodes is None else min(self.nodes, max_tree_tokens)

    def __str__(self) -> str:
        return "auto" if self.auto else "full" if self.nodes is None else str(self.nodes)


def load_recipe(path: str | Path) -> dict:
    """Read a YAML (or JSON) build recipe; sections are the `SECTION` names of the config classes."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; recipes live in builders/ (e.g. builders/tiny.yaml).")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"recipe {path} is not valid YAML: {e}.") from e
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}.")
    known = {"name", "description", "model", "drafter", "redrafter", "build", "convert", "make_tiny", "runtime"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"recipe {path}: unknown section(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    return data


def dump(obj: ConfigBase | dict, path: str | Path) -> None:
    """Write a config (or a dict of configs) as JSON or YAML by the file's suffix."""
    d = obj.to_dict() if isinstance(obj, ConfigBase) else {k: v.to_dict() if isinstance(v, ConfigBase) else v
                                                            for k, v in obj.items()}
    path = Path(path)
    with open(path, "w") as f:
        if path.suffix in (".yaml", ".yml"):
            yaml.safe_dump(d, f, sort_keys=False)
        else:
            json.dump(d, f, indent=2)
