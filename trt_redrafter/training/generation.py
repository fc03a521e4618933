"""Who writes the distillation corpus: the project's own torch engine (default) or HF `generate`.

Both answer a shard's prompts greedily and hand back, for every generated token but the last, the final-norm hidden
state whose logits chose the token after it, taken from the generation itself (no second forward):

    engine  the base converted and built in a temporary directory (`convert_base_checkpoint`, `build_torch_engine`),
            run by `runtime.Engine` with `record_hidden`: prompt and AR steps write each request's verified hidden
            state into a slot buffer (`SlotState.hidden`), read after every step. Requests are batched in flight
            across shard boundaries: a finished row's slot takes the next prompt at once, so the batch stays full
            where HF `generate` waits for the longest row of each batch. Magpie's user prompts are sampled by the
            same engine (temperature 1, top-p 0.95, a seed per prompt) before a chunk of shards is answered.
    hf      `model.generate` per shard with a hook on the final norm (`corpus.generate_shard`), the reference the
            engine's corpus is tested against.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ..config import BuildConfig, ProposerConfig, RuntimeConfig, SamplingConfig
from ..errors import UserError
from ..log import get_logger
from . import corpus as corpus_mod

log = get_logger(__name__)

GENERATORS = ("engine", "hf")
# a corpus of fewer tokens than this is generated eagerly: compiling the step (tens of seconds) would not pay
COMPILE_FROM_TOKENS = 200_000
REFILL_SHARE = 8
CHUNK_SHARDS = 8  # shards whose prompts are made before their rows are answered (in flight, across shards)  # admit new prompts once 1/REFILL_SHARE of the batch slots are free: one eager prompt step for several


@dataclass
class Answer:
    prompt: list[int]
    output: list[int]
    hidden: torch.Tensor  # [len(output), H] float32: the hidden state before each output token (the first: the
    # last prompt token's)


def rows_to_shard(answers: list[Answer], pad_id: int, dtype: torch.dtype = torch.float32) -> corpus_mod.Shard:
    """A corpus shard (corpus.Shard's layout) from answered prompts; hidden states kept in `dtype` (the base's
    compute dtype: a bf16 engine's hidden states are bf16 values, so storing them as bf16 loses nothing and halves
    the corpus)."""
    lengths = [len(a.prompt) + len(a.output) for a in answers]
    b, W, H = len(answers), max(lengths), answers[0].hidden.shape[1]
    tokens = torch.full((b, W), pad_id, dtype=torch.long)
    targets = torch.full((b, W), -100, dtype=torch.long)
    hidden = torch.zeros(b, W, H, dtype=dtype)
    for r, a in enumerate(answers):
        n, first = lengths[r], len(a.prompt) - 1
        row = torch.tensor(a.prompt + a.output)
        tokens[r, :n] = row
        targets[r, :n - 1] = row[1:]  # greedy: the base's argmax at t is token t+1
        hidden[r, first:n - 1] = a.hidden[:n - 1 - first]
    first = torch.tensor([len(a.prompt) - 1 for a in answers])
    return corpus_mod.Shard(tokens, targets, hidden, first, torch.tensor(lengths))


class EngineGenerator:
    """The base as a torch engine with hidden-state recording; `answer` and `sample` run requests in flight."""

    def __init__(self, base_model: Path, dtype: str, device: torch.device, max_batch: int, max_prompt: int,
                 max_new: int, threads: int = 0, work: Optional[Path] = None, compile: str = "auto"):
        from ..backends.torch_build import build_torch_engine
        from ..checkpoint.convert import convert_base_checkpoint
        from ..runtime.distributed import Dist
        from ..runtime.engine import Engine

        t0 = time.perf_counter()
        if work is not None:
            _remove_stale(Path(work))
        self._tmp = Path(tempfile.mkdtemp(prefix=f"generator-{os.getpid()}-", dir=work))
        try:
            ckpt = convert_base_checkpoint(base_model, self._tmp / "checkpoint", dtype=dtype)
            build = BuildConfig(max_batch_size=max_batch, max_input_len=max_prompt,
                                max_seq_len=max_prompt + max_new, dtype=dtype)
            engine_dir = build_torch_engine(ckpt, self._tmp / "engine", build,
                                            proposer=ProposerConfig(model_ngrams="off"))
            shutil.rmtree(ckpt)
            # AR steps only: no tree step to compile, no cost model to measure
            self.engine = Engine.load(engine_dir, Dist(0, 1, device),
                                 RuntimeConfig(device=device.type, threads=threads, compile=compile, speculate="full"),
                                 warmup=False, record_hidden=True)
            if self.engine.compiler.mode != "off":
                self.engine.warmup(trees=False)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self.max_batch = max_batch
        self.hidden_dtype = self.engine.dtype
        log.info("corpus engine ready in %.1fs (%s, batch %d)", time.perf_counter() - t0, dtype, max_batch)

    def close(self) -> None:
        self.engine = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def run(self, requests: Iterator[tuple[object, list[int], SamplingConfig, tuple[int, ...]]],
            hidden: bool = True) -> Iterator[tuple[object, Answer]]:
        """(key, prompt, sampling, stop ids) requests -> (key, Answer) as each finishes, in flight: at most
        max_batch at once, new ones admitted as slots free up."""
        from ..runtime.sequence import RequestSpec

        engine = self.engine
        todo = iter(requests)
        active: list = []  # (key, sequence, hidden rows)
        pending = deque()
        exhausted = False
        while True:
            free = self.max_batch - len(active)
            if not exhausted and (free >= max(1, self.max_batch // REFILL_SHARE) or not active):
                while len(pending) < free:
                    nxt = next(todo, None)
                    if nxt is None:
                        exhausted = True
                        break
                    pending.append(nxt)
            while pending and len(active) < self.max_batch:
                key, prompt, sp, stop = pending.popleft()
                active.append((key, engine.new_sequence(RequestSpec(prompt, sp, "ar", "ngram", tuple(stop))), []))
            if not active:
                return
            seqs = [s for _, s, _ in active]
            engine.step(seqs)
            if hidden:
                h = engine.hidden_states(seqs)
                for (_, _, rows), row in zip(active, h):
                    rows.append(row)
            still = []
            for key, s, rows in active:
                if s.finished:
                    engine.slots.release(s)
                    yield key, Answer(s.prompt, list(s.output),
                                      torch.stack(rows) if rows else torch.zeros(len(s.output), 0))
                else:
                    still.append((key, s, rows))
            active = still

    def shards(self, todo: list[int], prompts_for: Callable[[int], list[list[int]]], max_new: int,
               stop_ids: Optional[list[int]], pad_id: int) -> Iterator[tuple[int, corpus_mod.Shard]]:
        """(shard, Shard) for the shards in `todo`, each as soon as all its rows are answered. Shards go in chunks
        of CHUNK_SHARDS: the chunk's prompts are made first (Magpie's by this engine, with every slot free), then
        its rows are answered in flight."""
        sp = SamplingConfig(max_tokens=max_new)
        stop = tuple(stop_ids or ())
        for lo in range(0, len(todo), CHUNK_SHARDS):
            chunk = {i: prompts_for(i) for i in todo[lo:lo + CHUNK_SHARDS]}
            got: dict[int, dict[int, Answer]] = {i: {} for i in chunk}
            reqs = (((i, r), p, sp, stop) for i, prompts in chunk.items() for r, p in enumerate(prompts))
            for (i, r), ans in self.run(reqs):
                got[i][r] = ans
                if len(got[i]) == len(chunk[i]):
                    rows = got.pop(i)
                    yield i, rows_to_shard([rows[k] for k in range(len(chunk[i]))], pad_id, self.hidden_dtype)

    def sample(self, prompts: list[list[int]], max_new: int, temperature: float, top_p: float, seed: int,
               stop_ids: Optional[list[int]]) -> list[list[int]]:
        """Sampled continuations (request k seeded with seed * 1000003 + k), in the prompts' order."""
        out: dict[int, list[int]] = {}
        reqs = ((k, p, SamplingConfig(max_tokens=max_new, temperature=temperature, top_p=top_p,
                                      seed=(seed * 1000003 + k) % (1 << 62)), tuple(stop_ids or ()))
                for k, p in enumerate(prompts))
        for k, ans in self.run(reqs, hidden=False):
            out[k] = ans.output
        return [out[k] for k in range(len(prompts))]


class HFGenerator:
    """HF `generate`, one shard per batch (the reference)."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device

    def close(self) -> None:
        pass

    def shards(self, todo: list[int], prompts_for: Callable[[int], list[list[int]]], max_new: int,
               stop_ids: Optional[list[int]], pad_id: int) -> Iterator[tuple[int, corpus_mod.Shard]]:
        for i in todo:
            yield i, corpus_mod.generate_shard(self.model, prompts_for(i), max_new, stop_ids, pad_id, self.device)


def _remove_stale(work: Path) -> None:
    """Remove the engine directories of generating processes that no longer run (an interrupted run's)."""
    for d in work.glob("generator-*-*"):
        try:
            os.kill(int(d.name.split("-")[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def check_generator(name: str) -> None:
    if name not in GENERATORS:
        raise UserError(f"--generator: expected one of {', '.join(GENERATORS)}, got {name!r}.")
