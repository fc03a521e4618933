"""Helpers shared by the engine tests: build tiny engines through the real CLI, and reference outputs."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from trt_redrafter.cli import main as cli
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.proposer import Draft, Proposer
from trt_redrafter.runtime.step import SCORE_FLOOR, quantize_scores


def run_cli(*args) -> None:
    rc = cli([str(a) for a in args])
    assert rc == 0, f"trt-redrafter {' '.join(map(str, args))} exited {rc}"


def build_tiny_engines(root: Path, *, seed: int, num_beams: int, draft_len: int, tps=(1,), dtype="float32",
                       max_batch_size=4, max_seq_len=160, kv_block_size=64, build_args=(), convert_args=(),
                       **sizes) -> tuple[Path, dict[int, Path]]:
    """make-tiny -> convert (per TP, plus `convert_args`) -> build-engine (plus `build_args`). Returns (HF base dir,
    {tp: engine dir})."""
    tiny = root / "tiny"
    flags = []
    for k, v in sizes.items():
        if isinstance(v, bool):
            flags.append(f"--{'' if v else 'no-'}{k.replace('_', '-')}")
        else:
            flags += [f"--{k.replace('_', '-')}", v]
    run_cli("make-tiny", "--output", tiny, "--seed", seed, *flags)
    engines = {}
    for tp in tps:
        ckpt, eng = root / f"ckpt-tp{tp}", root / f"engine-tp{tp}"
        run_cli("convert", "--base-model", tiny / "base", "--drafter", tiny / "drafter", "--output", ckpt,
                "--tp", tp, "--dtype", dtype, "--num-beams", num_beams, "--draft-len-per-beam", draft_len, *convert_args)
        run_cli("build-engine", "--checkpoint", ckpt, "--output", eng, "--tp", tp, "--backend", "torch",
                "--max-batch-size", max_batch_size, "--max-input-len", 64, "--max-seq-len", max_seq_len,
                "--kv-block-size", kv_block_size,
                "--tokenizer", tiny / "base", *build_args)
        engines[tp] = eng
    return tiny / "base", engines


def run_json(engine_dir, prompts: list[list[int]], mode: str, extra=(), max_new: int = 20) -> list[list[int]]:
    """`trt-redrafter run --json` in a fresh process (TP > 1 relaunches itself under mpirun): each prompt's output
    ids, greedy, eos ignored; rank 0 alone prints."""
    cmd = [sys.executable, "-m", "trt_redrafter", "run", "--engine", str(engine_dir), "--mode", mode, "--json",
           "--max-tokens", str(max_new), "--ignore-eos", "--prompt-ids", *[",".join(map(str, p)) for p in prompts],
           *extra]
    # a compiled TP=2 run compiles on every rank: ~200 s alone on 2 cores, over 300 s when the machine is shared
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == len(prompts), proc.stdout
    return [d["output_ids"] for d in docs]


def load_engine(engine_dir: Path, proposer=None, device: str = "cpu", compile: str = "off", speculate: str = "full",
                **runtime) -> Engine:
    """An engine on one rank; eager by default (the compiled step has its own parity tests), verifying every tree
    whole by default (tests of the tree machinery; the speculation policy's tests ask for `speculate="auto"`)."""
    cfg = RuntimeConfig(device=device, compile=compile, speculate=speculate, **runtime)
    return Engine(engine_dir, Dist(0, 1, torch.device(device)), cfg, proposer=proposer)


@functools.lru_cache(maxsize=None)
def _hf_model(base_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like --ignore-eos
    return model.eval()


def hf_greedy(base_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = _hf_model(str(base_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingConfig:
    return SamplingConfig(max_tokens=max_tokens)


class HostDrafts(Proposer):
    """A test's proposer: it composes every speculative request's tree on the host (`beams` per request), scored
    with `scores` (default: every node certain)."""

    on_host = True

    def beams(self, seq) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, beams: torch.Tensor) -> list[list[int]]:
        return [[0] * (beams.shape[1] - 1)] * beams.shape[0]

    def compose(self, seq, device=None) -> Draft:
        beams = self.beams(seq)
        return Draft(beams.tolist(), self.scores(beams))


class OracleProposer(HostDrafts):
    """A host proposer that drafts the known AR continuation as one of its beams (tests only).

    The other beams branch off the oracle beam at random depths with random tokens, so the verify step sees a
    real tree. `continuations[seq_id]` is the request's full AR output. With `corrupt_every=k`, every k-th
    draft has its oracle beam corrupted at a random depth, exercising partial acceptance. Scores: the oracle beam's
    nodes are certain, the random branches' nodes score log(1 / vocab) per random token.
    """

    name = "oracle"

    def __init__(self, engine_dir: Path, continuations: dict[int, list[int]], corrupt_every: int = 0, seed: int = 0):
        from trt_redrafter.checkpoint.engine_config import load_engine_config

        info = load_engine_config(engine_dir).checkpoint
        self.num_beams, self.draft_len = info.redrafter.num_beams, info.redrafter.draft_len_per_beam
        self.vocab = info.model.vocab_size
        self.continuations, self.corrupt_every = continuations, corrupt_every
        self.g = torch.Generator().manual_seed(seed)
        self.calls = 0
        self._oracle = 0

    def beams(self, s) -> torch.Tensor:
        nb, dl, g = self.num_beams, self.draft_len, self.g
        known = self.continuations[s.seq_id]
        cont = known[len(s.output):len(s.output) + dl]
        cont = cont + [1] * (dl - len(cont))
        beams = torch.randint(3, self.vocab, (nb, dl + 1), generator=g)
        beams[:, 0] = s.true_token
        oracle = self._oracle = int(torch.randint(0, nb, (1,), generator=g))
        beams[oracle, 1:] = torch.tensor(cont)
        for b in range(nb):  # share a random prefix with the oracle beam
            depth = int(torch.randint(0, dl + 1, (1,), generator=g))
            beams[b, :depth + 1] = beams[oracle, :depth + 1]
        self.calls += 1
        if self.corrupt_every and self.calls % self.corrupt_every == 0:
            d = int(torch.randint(1, dl + 1, (1,), generator=g))
            beams[oracle, d] = (beams[oracle, d] + 1) % self.vocab
        return beams

    def scores(self, beams: torch.Tensor) -> list[list[int]]:
        miss = quantize_scores(torch.tensor(-math.log(self.vocab))).item()
        same = (beams == beams[self._oracle]).long().cumprod(dim=1)[:, 1:]  # [nb, dl] still on the oracle's path
        return ((1 - same).cumsum(dim=1) * miss).clamp(min=SCORE_FLOOR).tolist()


# Llama 2's chat template in miniature: it writes the BOS text itself, as Llama 2's and Llama 3's do, so encoding its
# output with special tokens would put a second BOS in front (trt_redrafter/chat.py).
LLAMA2_STYLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                         "[/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def write_chat_tokenizer(src: Path, dst: Path, template: str = LLAMA2_STYLE_TEMPLATE) -> Path:
    """A copy of the tokenizer in `src` (a tiny pair's base/, an engine's tokenizer/) with a chat template set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    assert not tok.chat_template, f"{src} already has a chat template"
    tok.chat_template = template
    tok.save_pretrained(str(dst))
    return dst



def stub_crashes(before: list[str] | None, pids) -> list[str] | None:
    """Kernel-log lines written since `before` (`launcher.kernel_log()`) that report a crash of one of `pids` (the
    stub's process name is cut to `triton_python_b[PID]: segfault at ...`); None where the kernel log cannot be
    read."""
    import re

    from trt_redrafter.serving.launcher import kernel_log_since

    new = kernel_log_since(before)
    if new is None:
        return None
    hits = []
    for line in new:
        m = re.search(r"\S+\[(\d+)\]: (segfault|general protection|trap)", line)
        if m and int(m.group(1)) in pids:
            hits.append(line)
    return hits
