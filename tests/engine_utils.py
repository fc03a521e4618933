"""Helpers shared by the engine tests: build tiny engines through the real CLI, and reference outputs."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import torch

from trt_redrafter.bench.baselines import hf_generate, load_hf_model
from trt_redrafter.bench.oracle import ContinuationOracle
from trt_redrafter.cli import main as cli
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.proposer import Proposer
from trt_redrafter.runtime.sequence import Draft

SMALL = Path(__file__).resolve().parents[1] / "models" / "small"  # the trained pair (scripts/train_small_pair.sh)


def record_tree_steps(launcher, pick) -> list:
    """Wrap `launcher.tree` to record pick(variant, beams, depth) of every tree step the engine launches (its beams
    and depth as passed: 0 for the tree's own), skipping steps it maps to None; `del launcher.tree` restores it."""
    seen, tree_step = [], launcher.tree

    def recording(slots, width, keep, longest, variant, pending=None, grammar=None, beams=0, depth=0):
        value = pick(variant, beams, depth)
        if value is not None:
            seen.append(value)
        return tree_step(slots, width, keep, longest, variant, pending, grammar, beams, depth)

    launcher.tree = recording
    return seen


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


def build_small_engine(root: Path, *, num_beams: int, draft_len: int, max_batch_size: int, max_input_len: int,
                       max_seq_len: int, drafter: Path = SMALL / "drafter", tp: int = 1, dtype: str = "float32",
                       tokenizer: bool = True) -> Path:
    """models/small's base (the trained pair, or another drafter for it) -> convert (--tp, --dtype) -> build-engine
    under `root`: the engine directory."""
    ck, en = root / "ck", root / "en"
    run_cli("convert", "--base-model", SMALL / "base", "--drafter", drafter, "--output", ck, "--tp", tp,
            "--dtype", dtype, "--num-beams", num_beams, "--draft-len-per-beam", draft_len)
    run_cli("build-engine", "--checkpoint", ck, "--output", en, "--max-batch-size", max_batch_size,
            "--max-input-len", max_input_len, "--max-seq-len", max_seq_len,
            *(["--tokenizer", SMALL / "base"] if tokenizer else []))
    return en


def run_json(engine_dir, prompts: list[list[int]], mode: str, extra=(), max_new: int = 20, full: bool = False,
             stderr: list[str] | None = None) -> list:
    """`trt-redrafter run --json` in a fresh process (TP > 1 relaunches itself under mpirun): each prompt's output
    ids (`full`: its whole JSON document), greedy, eos ignored; rank 0 alone prints. `stderr`: a list the run's
    standard error (every rank's) is appended to."""
    cmd = [sys.executable, "-m", "trt_redrafter", "run", "--engine", str(engine_dir), "--mode", mode, "--json",
           "--max-tokens", str(max_new), "--ignore-eos", "--prompt-ids", *[",".join(map(str, p)) for p in prompts],
           *extra]
    docs = _json_lines(cmd, len(prompts), stderr)
    return docs if full else [d["output_ids"] for d in docs]


def _json_lines(cmd: list[str], n: int, stderr: list[str] | None = None) -> list[dict]:
    """Run `cmd` (a run on one or more ranks; rank 0 prints) -> the n JSON lines it printed."""
    # a compiled TP=2 run compiles on every rank: ~200 s alone on 2 cores, over 300 s when the machine is shared
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    docs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == n, proc.stdout[-3000:]
    return docs


def decode_tp(engine_dir: Path, runs: dict[str, dict], tp: int, tmp: Path) -> dict[str, dict]:
    """Each named run (tp_driver.py) on the engine, eager, in one engine load: TP 1 in this process, else under real
    mpirun, one launch for them all -> name: {output_ids, accepted_draft_tokens, draft_tokens} per prompt."""
    if tp == 1:
        from tp_driver import decode_runs

        return dict(zip(runs, decode_runs(load_engine(engine_dir, speculate="auto"), list(runs.values()))))
    from trt_redrafter.runtime.distributed import mpirun_prefix

    spec = tmp / f"runs-{engine_dir.name}.json"
    spec.write_text(json.dumps(list(runs.values())))
    cmd = mpirun_prefix(tp, "the test") + [sys.executable, str(Path(__file__).with_name("tp_driver.py")),
                                           str(engine_dir), str(spec)]
    return dict(zip(runs, _json_lines(cmd, len(runs))))


def load_engine(engine_dir: Path, proposer=None, device: str = "cpu", compile: str = "off", speculate: str = "full",
                warmup: bool = True, **runtime) -> Engine:
    """An engine on one rank; eager by default (the compiled step has its own parity tests), verifying every tree
    whole by default (tests of the tree machinery; the speculation policy's tests ask for `speculate="auto"`).
    `warmup=False`: compile each step variant when first launched, not every one the engine could launch at load
    (a compiled test that runs a few of them saves minutes of compiling on a 2-core CPU)."""
    cfg = RuntimeConfig(device=device, compile=compile, speculate=speculate, **runtime)
    return Engine.load(engine_dir, Dist(0, 1, torch.device(device)), cfg, proposer=proposer, warmup=warmup)


@functools.lru_cache(maxsize=None)
def _hf_model(base_dir: str):
    return load_hf_model(base_dir)  # eos ignored: exactly max_new_tokens, like --ignore-eos


def hf_greedy(base_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_generate(_hf_model(str(base_dir)), [prompt], max_new_tokens)[1][0]


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


def OracleProposer(engine_dir: Path, continuations: dict, corrupt_every: int = 0, seed: int = 0,
                   key: str = "seq_id") -> ContinuationOracle:
    """A host proposer that drafts each request's known AR continuation (`continuations[seq_id]`: `generate` numbers
    its prompts from 0; with key="prompt", `continuations[tuple(prompt)]`, for requests over several `generate`
    calls) as one beam of every tree, certain of it; with `corrupt_every=k` every k-th tree's oracle beam is wrong at
    a random depth (partial acceptances). The other beams branch off it with random tokens."""
    from trt_redrafter.checkpoint.engine_config import load_engine_config

    ecfg = load_engine_config(engine_dir)
    return ContinuationOracle(ecfg.tree.num_beams, ecfg.tree.draft_len_per_beam, ecfg.checkpoint.model.vocab_size,
                              continuations, key=key, corrupt_every=corrupt_every, seed=seed)


def chunk_calls(engine: Engine) -> list[int]:
    """Spy on the engine's prompt chunks: the tokens of each chunk computed (not the ones that end a prompt)."""
    calls, orig = [], engine.steps.prefill_chunk

    def spy(slots, ids, lengths, *a, **kw):
        calls.extend(lengths.tolist())
        return orig(slots, ids, lengths, *a, **kw)

    engine.steps.prefill_chunk = spy
    return calls


def check_logprobs_against_hf(base_dir: Path, prompt: list[int], result, top: int, atol: float) -> None:
    """A result's log-probabilities (each output token's and its `top` best) against HF's log_softmax of the same
    model's logits over prompt + output, at each output position."""
    with torch.no_grad():
        logits = _hf_model(str(base_dir))(torch.tensor([prompt + result.output_ids])).logits.float()
    ref = torch.log_softmax(logits, dim=-1)[0, len(prompt) - 1:-1]  # [len(output), V]
    assert len(result.logprobs) == len(result.output_ids)
    got = torch.tensor([t.logprob for t in result.logprobs])
    torch.testing.assert_close(got, ref.gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0], atol=atol, rtol=0)
    best = ref.topk(top, dim=-1)
    assert [[i for i, _ in t.top] for t in result.logprobs] == best.indices.tolist()
    torch.testing.assert_close(torch.tensor([[x for _, x in t.top] for t in result.logprobs]), best.values,
                               atol=atol, rtol=0)


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


QWEN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_qwen_tokenizer(src: Path, dst: Path) -> Path:
    """The byte-level BPE in `src` made a Qwen2 tokenizer: Qwen's pre-tokenizer split (its regex, then bytes), no BOS,
    `<|endoftext|>` / `<|im_start|>` / `<|im_end|>` as special tokens (eos `<|im_end|>`, pad `<|endoftext|>`, as
    Qwen2.5-Instruct's tokenizer_config.json says) and the ChatML chat template."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from trt_redrafter.checkpoint.tokenizer_files import save_tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN_CHAT_TEMPLATE
    save_tokenizer(fast, dst)
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
