"""Where train-drafter's distillation corpus comes from: the base's tokenizer and weights, the prompts of each split
(text windows, a user's JSONL, Magpie self-prompts; `prompts.py`), the corpus on disk for them (`corpus.py`) and the
generator that writes it (`generation.py`, started only when a shard is missing); and the draft vocabulary (FR-Spec)
counted from the corpus's targets.
"""

from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import UserError
from ..families import FAMILIES
from ..log import get_logger
from . import corpus as corpus_mod
from . import data as data_mod
from . import generation as gen_mod
from . import prompts as prompt_mod
from .config import DTYPES, DrafterTrainConfig

log = get_logger(__name__)
FAMILY_TYPES = tuple(f.model_type for f in FAMILIES)


def load_tokenizer(path: Path):
    """(tokenizer, HF config) of the base, checked before anything is generated."""
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise UserError(f"base model directory {path} has no config.json; pass a Hugging Face model directory.")
    config = AutoConfig.from_pretrained(str(path))
    if getattr(config, "model_type", None) not in FAMILY_TYPES:
        raise UserError(f"{path}: model_type is {config.model_type!r}; train-drafter supports "
                        f"{', '.join(FAMILY_TYPES)} bases.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path} (train-drafter needs one to read the text): {e}") from e
    return tokenizer, config


def load_base(path: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _prompt_stream(tokenizer, files: list[Path], max_files: int = 48) -> torch.Tensor:
    """Token stream of up to `max_files` files spread evenly over the list (keeps tokenizing fast)."""
    if len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    return data_mod.token_stream(tokenizer, files)


@dataclass
class Source:
    """One split's prompts: `prompts_for(shard)` and how answers end."""

    name: str
    num_sequences: int
    prompts_for: Callable[[int], list[list[int]]]
    stop_ids: Optional[list[int]]  # None: exactly seq_len tokens (text windows)
    max_prompt: int  # longest prompt in tokens (the corpus engine's input limit)


def sources(cfg: DrafterTrainConfig, sample: Callable, tokenizer, bos: int) -> tuple[Source, Source]:
    """(training, held-out) prompt sources for the configured kind of data; `sample` writes Magpie's user prompts
    (prompts.magpie_user_prompts)."""
    gbs = cfg.gen_batch_size

    def rows(n: int, i: int) -> range:
        return range(i * gbs, min(n, (i + 1) * gbs))

    if cfg.prompts or cfg.magpie:
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        if stop is None:
            raise UserError("the base's tokenizer names no eos token, so its chat answers would never end; set "
                            "eos_token in its tokenizer_config.json.")
        guard = prompt_mod.EvalGuard.mt_bench()
        if cfg.prompts:
            convs = prompt_mod.read_jsonl(cfg.prompts)
            kept = [c for c in convs if not guard.conversation(c)]
            if len(kept) < len(convs):
                log.warning("--prompts %s: left out %d conversation(s) that ask %s questions (the evaluation set "
                            "never enters training)", cfg.prompts, len(convs) - len(kept), guard.name)
            if len(kept) < 2:
                raise UserError(f"--prompts {cfg.prompts} holds {len(kept)} conversation(s) outside {guard.name}; "
                                f"need at least 2 (one is held out).")
            train, held = prompt_mod.split_held_out(kept, cfg.eval_sequences, cfg.seed)
            # tokenized once: the longest sizes the corpus engine, the shards read their rows
            train = [prompt_mod.chat_ids(tokenizer, c) for c in train[:cfg.num_sequences]]
            held = [prompt_mod.chat_ids(tokenizer, c) for c in held]
            longest = max(map(len, train + held))

            def from_list(ids):
                return lambda i: [ids[j] for j in rows(len(ids), i)]
            return (Source(f"jsonl:{cfg.prompts}", len(train), from_list(train), stop, longest),
                    Source(f"jsonl:{cfg.prompts}:held-out", len(held), from_list(held), stop, longest))

        # a user prompt of MAGPIE_MAX_TOKENS tokens re-tokenizes to about as many; the template adds the rest
        longest = 2 * len(prompt_mod.user_turn_prefix(tokenizer)) + 2 * prompt_mod.MAGPIE_MAX_TOKENS

        def magpie(n: int, salt: int):
            def prompts_for(i: int) -> list[list[int]]:
                users = prompt_mod.magpie_user_prompts(sample, tokenizer, len(rows(n, i)),
                                                       (cfg.seed * 1000 + i) * 2 + salt, guard)
                return [prompt_mod.chat_ids(tokenizer, [{"role": "user", "content": u}]) for u in users]
            return prompts_for
        return (Source("magpie", cfg.num_sequences, magpie(cfg.num_sequences, 0), stop, longest),
                Source("magpie:held-out", cfg.eval_sequences, magpie(cfg.eval_sequences, 1), stop, longest))

    train_files, held_files = data_mod.text_files(cfg.data)

    def windows(files, n: int, salt: int):
        stream = _prompt_stream(tokenizer, files)
        if len(stream) <= cfg.prompt_max + 1:
            raise UserError(f"the text holds only {len(stream)} tokens; need more than {cfg.prompt_max + 1} for "
                            f"prompts.")

        def prompts_for(i: int) -> list[list[int]]:  # one window length per shard: no padding
            g = torch.Generator().manual_seed((cfg.seed * 100003 + i) * 2 + salt)
            plen = int(torch.randint(cfg.prompt_min, cfg.prompt_max + 1, (1,), generator=g))
            starts = torch.randint(0, len(stream) - plen, (len(rows(n, i)),), generator=g).tolist()
            return [[bos] + stream[s:s + plen].tolist() for s in starts]
        return prompts_for

    src = cfg.data or "stdlib"
    return (Source(f"text:{src}", cfg.num_sequences, windows(train_files, cfg.num_sequences, 0), None,
                    cfg.prompt_max + 1),
            Source(f"text:{src}:held-out", cfg.eval_sequences, windows(held_files, cfg.eval_sequences, 1), None,
                    cfg.prompt_max + 1))


def corpus_spec(cfg: DrafterTrainConfig, base_model: Path, source: Source) -> dict:
    spec = {"base_model": str(base_model.resolve()), "source": source.name, "seq_len": cfg.seq_len,
            "gen_batch_size": cfg.gen_batch_size, "seed": cfg.seed, "stop_at_eos": source.stop_ids is not None,
            "generator": cfg.generator, "generate_dtype": cfg.generate_dtype}
    if cfg.prompts or cfg.magpie:
        spec["excludes"] = "mt-bench"  # prompt_mod.EvalGuard
    if not (cfg.prompts or cfg.magpie):
        spec["prompt_len"] = [cfg.prompt_min, cfg.prompt_max]
    if cfg.prompts:  # the held-out split (and so every shard) depends on the file and the held-out count
        spec["prompts_sha256"] = hashlib.sha256(Path(cfg.prompts).read_bytes()).hexdigest()
        spec["eval_sequences"] = cfg.eval_sequences
    return spec


def open_corpus(root: Path, spec: dict, n: int, cfg: DrafterTrainConfig, force: bool) -> corpus_mod.ShardedCorpus:
    shards = max(1, math.ceil(n / cfg.gen_batch_size))
    rows = [min(cfg.gen_batch_size, n - i * cfg.gen_batch_size) for i in range(shards)]
    try:
        return corpus_mod.ShardedCorpus(root, spec, shards, rows)
    except UserError:
        if not force:
            raise
        shutil.rmtree(root)
        return corpus_mod.ShardedCorpus(root, spec, shards, rows)


def generated_targets(shard: corpus_mod.Shard) -> torch.Tensor:
    """The targets of a shard's drafting positions (t >= first: the tokens the base generated), flattened."""
    t = torch.arange(shard.targets.shape[1])[None, :]
    keep = (t >= shard.first[:, None]) & (shard.targets >= 0)
    return shard.targets[keep]


def target_counts(corpus: corpus_mod.ShardedCorpus, V: int) -> torch.Tensor:
    """[V] how often the base generated each token in `corpus` (its drafting targets), a shard at a time."""
    counts = torch.zeros(V, dtype=torch.long)
    for i in range(corpus.num_shards):
        counts += torch.bincount(generated_targets(corpus.load(i)), minlength=V)[:V]
    return counts


def draft_vocabulary(counts: torch.Tensor, k: int) -> torch.Tensor:
    """FR-Spec's draft vocabulary: the `k` most frequent token ids of `counts` (`target_counts`), ascending."""
    return torch.topk(counts, k).indices.sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the targets counted in `counts` that are among `ids`."""
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


class LazyGenerator:
    """The corpus generator (generation.py), started on first use: a complete corpus is reused without one."""

    def __init__(self, cfg: DrafterTrainConfig, base_model: Path, device: torch.device, work: Path, pad_id: int):
        self.cfg, self.base_model, self.device, self.work, self.pad_id = cfg, base_model, device, work, pad_id
        self.max_prompt = 0
        self._gen = self._sample = None

    def _start(self) -> None:
        if self._gen is not None:
            return
        cfg = self.cfg
        if cfg.generator == "engine":
            tokens = (cfg.num_sequences + cfg.eval_sequences) * cfg.seq_len
            self._gen = gen_mod.EngineGenerator(self.base_model, cfg.generate_dtype, self.device, cfg.gen_batch_size,
                                                self.max_prompt, cfg.seq_len, cfg.threads, self.work,
                                                compile="auto" if tokens >= gen_mod.COMPILE_FROM_TOKENS else "off")
            self._sample = self._gen.sample
        else:
            hf = load_base(self.base_model, self.device, DTYPES[cfg.generate_dtype])
            self._gen = gen_mod.HFGenerator(hf, self.device)
            self._sample = prompt_mod.hf_sampler(hf, self.device, self.pad_id)

    def sample(self, *args) -> list[list[int]]:
        self._start()
        return self._sample(*args)

    def shards(self, todo, *args):
        if not todo:
            return iter(())
        self._start()
        return self._gen.shards(todo, *args)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
        self._gen = self._sample = None
