"""`train-drafter`'s settings: one ConfigBase, so that its flags, defaults and help come from one place (the command
adds them with `DrafterTrainConfig.add_cli_args` and reads them back with `from_sources`, as every other command does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..config import ConfigBase, ReDrafterConfig, option
from ..errors import UserError
from .generation import GENERATORS, check_generator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --exit-dim auto: the drafter's vocabulary head, read once per drafting step, costs at most this share of the
# base's weights per decoding step (draft_len * exit_dim * V <= budget * base parameters)
DRAFT_HEAD_BUDGET = 0.25
MIN_DRAFT_VOCAB = 64  # a draft vocabulary below this cannot fill a beam search's candidates meaningfully


@dataclass
class DrafterTrainConfig(ConfigBase):
    SECTION: ClassVar[str] = "train"

    draft_len: int = option(ReDrafterConfig.project().draft_len_per_beam,
                            help="drafter steps trained (T; match --draft-len-per-beam at inference)")
    num_layers: int = option(1, help="ResBlocks")
    rnn: bool = option(True, help="recurrent state")
    exit_dim: int = option(0, help="ResBlock width; 2*hidden has no input projection (Apple's recipe); 0 (default): "
                                   "2*hidden unless the drafter's vocabulary head would cost more than a quarter of "
                                   "the base's weights per step, else the widest power of two that fits, behind an "
                                   "input projection")
    draft_vocab: int = option(0, help="0 (default): the drafter's head scores the whole vocabulary (Apple's and "
                                      "TensorRT-LLM's format); K: only the K tokens the base generates most often in "
                                      "the corpus (FR-Spec), a head V/K times cheaper per drafted token; outputs do "
                                      "not change (verification is exact), but only --backend torch runs such a "
                                      "drafter")
    steps: int = option(600, help="optimizer steps")
    lr: float = option(2e-3, help="peak learning rate (AdamW, warmup + cosine)")
    warmup: int = option(30, help="learning-rate warmup steps")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    soft_targets: float = option(0.0, help="weight in [0, 1] of the base's whole next-token distribution in each "
                                           "step's loss (knowledge distillation; 0: its greedy token only, Apple's "
                                           "recipe)")
    batch_size: int = option(512, help="drafting positions per step")
    seq_len: int = option(160, help="tokens the base generates per sequence")
    prompt_min: int = option(16, help="shortest prompt window (tokens)")
    prompt_max: int = option(64, help="longest prompt window (tokens)")
    num_sequences: int = option(512, help="distillation sequences")
    eval_sequences: int = option(64, help="held-out sequences")
    gen_batch_size: int = option(64, help="sequences per corpus shard, and the corpus engine's batch (hf: per "
                                          "generate call)")
    seed: int = option(0, help="seed of the prompts, the corpus split and the drafter's initialization")
    data: Optional[str] = option(None, help="text: 'stdlib' (default: the Python standard library), a directory of "
                                            "*.py/*.txt/*.md files, or one text file")
    prompts: Optional[str] = option(None, help="JSONL of prompts or conversations ({\"prompt\"}, MT-Bench "
                                               "{\"turns\"}, {\"messages\"} or ShareGPT {\"conversations\"}); the "
                                               "chat template is applied and a quarter at most (--eval-sequences) is "
                                               "held out")
    magpie: bool = option(False, help="the base writes its own user prompts (its chat template's user-turn prefix, "
                                      "sampled), then answers them")
    work_dir: Optional[str] = option(None, help="corpus shards and checkpoints (default: OUTPUT.work); a corpus made "
                                                "with the same settings is reused")
    save_every: int = option(100, help="checkpoint every N steps")
    resume: bool = option(False, help="continue from the work directory's checkpoint")
    stop_after: int = option(0, help="end this run after N steps, leaving a checkpoint to --resume from")
    shards_in_memory: int = option(0, help="corpus shards (of --gen-batch-size sequences) held in memory while "
                                           "training; each batch is drawn from the shards held, so fewer shards "
                                           "let the drafter overfit the few conversations it sees at a time. 0 "
                                           "(default): every shard, or as many as a quarter of the memory holds")
    dtype: str = option("float32", help="dtype of the written weights", choices=tuple(DTYPES))
    generator: str = option("engine", choices=GENERATORS,
                            help="who writes the corpus: engine (default: the project's torch engine, "
                                 "--gen-batch-size requests batched in flight, hidden states recorded by the decode "
                                 "step) or hf (HF generate, one batch per shard)")
    generate_dtype: str = option("float32", choices=tuple(DTYPES),
                                 help="the base's dtype while it writes the corpus (bfloat16 is faster on CPUs with "
                                      "AVX512-BF16; match the dtype you will deploy)")
    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="where to generate and train")
    threads: int = option(0, help="torch CPU threads (0: torch's default)")
    log_every: int = option(25, cli=False)

    def validate(self) -> None:
        for n in ("draft_len", "steps", "batch_size", "seq_len", "prompt_min", "prompt_max", "num_sequences",
                  "eval_sequences", "gen_batch_size", "save_every"):
            v = getattr(self, n)
            if not isinstance(v, int) or v <= 0:
                raise UserError(f"--{n.replace('_', '-')}: expected a positive integer, got {v!r}.")
        if not isinstance(self.shards_in_memory, int) or self.shards_in_memory < 0:
            raise UserError(f"--shards-in-memory: expected 0 (as many as fit) or a positive integer, got "
                            f"{self.shards_in_memory!r}.")
        if self.stop_after < 0:
            raise UserError(f"--stop-after: expected a step count >= 0, got {self.stop_after}.")
        if sum(bool(x) for x in (self.data, self.prompts, self.magpie)) > 1:
            raise UserError("pass one data source: --data (text windows), --prompts (JSONL) or --magpie.")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.generate_dtype not in DTYPES:
            raise UserError(f"--generate-dtype: expected one of {', '.join(DTYPES)}, got {self.generate_dtype!r}.")
        check_generator(self.generator)
        if self.num_layers < 0 or self.exit_dim < 0:
            raise UserError("--num-layers and --exit-dim must be >= 0.")
        if self.draft_vocab and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise UserError(f"--draft-vocab {self.draft_vocab}: expected 0 (the whole vocabulary) or at least "
                            f"{MIN_DRAFT_VOCAB} tokens.")
        if self.prompt_min > self.prompt_max:
            raise UserError(f"prompt length range {self.prompt_min}..{self.prompt_max} is empty.")
        if not 0.0 <= self.soft_targets <= 1.0:
            raise UserError(f"--soft-targets: expected a weight in [0, 1] (0: the base's greedy token only, 1: its "
                            f"whole distribution), got {self.soft_targets}.")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay: expected a number >= 0, got {self.weight_decay}.")
        if not self.lr > 0:
            raise UserError(f"--lr: expected a positive number, got {self.lr}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device: expected auto, cpu or cuda, got {self.device!r}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available; use --device cpu.")
