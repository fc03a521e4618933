"""Other engines on the same token ids: Hugging Face `generate` (greedy, and prompt-lookup decoding) and llama.cpp
(llama-cpp-python, at the weight types asked), each timed at batch 1, greedy, as the engine's TPOT is.

Each baseline runs in a process of its own (`python -m trt_redrafter.bench.baselines TARGET JOB OUT`): on some CPUs
llama-cpp-python's Q8_0 / Q4_1 models crash at their first completion, and a crash must cost its own row (recorded
with the reason, e.g. "exited with signal 11 (SIGSEGV)"), not the benchmark. The child decodes and reports ms/token
and its outputs; the parent compares them with the engine's AR outputs.

Nothing here imports torch, transformers or llama_cpp at module level: the parent only starts processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

LLAMA_CPP_TYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
                   "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}
HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens of HF prompt-lookup decoding (HF's documented value)
WARMUP_TOKENS = 4


@dataclass
class BaselineJob:
    """What every baseline decodes: these token ids, greedy, one at a time, `max_tokens` each (eos ignored)."""

    prompts: list[list[int]]
    max_tokens: int
    repeats: int  # the ms/token is the median over repeats of the median over prompts
    threads: int  # the engine's torch threads: every baseline gets as many


@dataclass
class Baseline:
    """One baseline process: `target` ("module:function") is called with the job and `options` and returns its
    rows as dicts (BaselineRow's fields); `names` are the rows it makes, each an error row if the process fails."""

    names: tuple[str, ...]
    target: str
    options: dict = field(default_factory=dict)


@dataclass
class BaselineRow:
    """One baseline's result, or why it has none."""

    name: str
    ms_per_token: Optional[float] = None
    outputs: Optional[list[list[int]]] = None  # the greedy tokens of each prompt (not in the JSON)
    greedy_outputs_equal: Optional[bool] = None  # every output equals the engine's AR one (None: nothing to compare)
    outputs_equal_to_ar: Optional[str] = None  # how many do, e.g. "7/8"
    speedup: Optional[float] = None  # AR at batch 1's ms/token over this row's
    file: Optional[str] = None  # the model file it ran (llama.cpp)
    error: Optional[str] = None  # why the row has no numbers (e.g. "exited with signal 11 (SIGSEGV)")
    options: dict = field(default_factory=dict)  # how it decoded (e.g. prompt_lookup_num_tokens)

    def compare(self, reference: Optional[list[list[int]]], ar_ms: Optional[float]) -> "BaselineRow":
        """With the engine's AR outputs and ms/token at batch 1 (None where batch 1 was not measured)."""
        if self.outputs is not None and reference is not None:
            same = sum(a == b for a, b in zip(self.outputs, reference))
            self.greedy_outputs_equal = same == len(reference) == len(self.outputs)
            self.outputs_equal_to_ar = f"{same}/{len(reference)}"
        if self.ms_per_token and ar_ms:
            self.speedup = ar_ms / self.ms_per_token
        return self

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("name", "outputs", "options")}
        return {**{k: v for k, v in d.items() if v is not None or k not in ("file", "error")}, **self.options}


def hf_baseline(hf_dir: str, lookup_tokens: int = HF_LOOKUP_TOKENS) -> Baseline:
    return Baseline(("hf_greedy", "hf_prompt_lookup"), f"{__name__}:hf_rows",
                    {"hf_dir": str(hf_dir), "lookup_tokens": lookup_tokens})


def llama_cpp_baseline(gguf: Path, kind: str) -> Baseline:
    return Baseline((f"llama.cpp_{kind}",), f"{__name__}:llama_cpp_rows", {"gguf": str(gguf), "kind": kind})


def run_baselines(baselines: list[Baseline], job: BaselineJob, reference: Optional[list[list[int]]],
                  ar_ms: Optional[float], timeout_s: Optional[float] = None) -> list[BaselineRow]:
    """Each baseline in its own process, one after another; every row compared with the engine's AR."""
    rows = []
    for b in baselines:
        rows += [r.compare(reference, ar_ms) for r in run_isolated(b, job, timeout_s)]
    return rows


def run_isolated(b: Baseline, job: BaselineJob, timeout_s: Optional[float] = None) -> list[BaselineRow]:
    """Run `b` in a child process (its stderr passes through); its rows, or an error row per name."""
    with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps({"job": dataclasses.asdict(job), "options": b.options}))
        cmd = [sys.executable, "-m", __name__, b.target, str(job_file), str(out_file)]
        try:
            # its stdout to our stderr: this process's stdout ends with one JSON document
            rc = subprocess.run(cmd, stdout=2, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return [BaselineRow(n, error=f"ran past {timeout_s:.0f} s") for n in b.names]
        doc = json.loads(out_file.read_text()) if out_file.is_file() else {}
    if rc == 0 and "rows" in doc:
        return [BaselineRow(**r) for r in doc["rows"]]
    reason = doc.get("error") or exit_reason(rc)
    print(f"baseline {b.target} failed: {reason}", file=sys.stderr)
    return [BaselineRow(n, error=reason) for n in b.names]


def exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return f"exited with signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"exited with signal {-rc}"
    return f"exited with status {rc}"


def time_batch1(gen: Callable[[list[int], int], tuple[float, list[int]]], job: BaselineJob) -> tuple[float, list]:
    """(ms/token, outputs) of `gen(ids, n) -> (seconds, tokens)`: each prompt's TPOT is (time for max_tokens - time
    for 1 token) / (max_tokens - 1); the median over prompts, then over repeats."""
    gen(job.prompts[0], WARMUP_TOKENS)
    reps, outputs = [], []
    for _ in range(job.repeats):
        tpots, outputs = [], []
        for ids in job.prompts:
            t_full, toks = gen(ids, job.max_tokens)
            t_one, _ = gen(ids, 1)
            tpots.append(1e3 * (t_full - t_one) / (job.max_tokens - 1))
            outputs.append(toks)
        reps.append(statistics.median(tpots))
    return statistics.median(reps), outputs


# ---- Hugging Face ------------------------------------------------------------------------------------------------
def load_hf_model(hf_dir: str, device: str = "cpu"):
    """A float32 HF causal LM that decodes exactly the tokens asked for (eos ignored, like the engine's runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompts: list[list[int]], n: int, **kw) -> tuple[float, list[list[int]]]:
    """(seconds, each prompt's n greedy tokens) of one HF `generate` call over `prompts` (equal lengths, batched),
    eos ignored; the device is synchronized before the clock stops."""
    import torch

    x = torch.tensor(prompts, device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0, out[:, x.shape[1]:].tolist()


def hf_rows(job: BaselineJob, hf_dir: str, lookup_tokens: int) -> list[dict]:
    """HF generate at batch 1, greedy and with prompt-lookup decoding (child process)."""
    import torch

    torch.set_num_threads(job.threads)
    model = load_hf_model(hf_dir)
    rows = []
    for name, kw in (("hf_greedy", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": lookup_tokens})):
        def gen(ids: list[int], n: int, kw=kw) -> tuple[float, list[int]]:
            t, out = hf_generate(model, [ids], n, **kw)
            return t, out[0]

        ms, outputs = time_batch1(gen, job)
        rows.append({"name": name, "ms_per_token": ms, "outputs": outputs, "options": kw})
    return rows


# ---- llama.cpp -------------------------------------------------------------------------------------------------
def llama_cpp_file(gguf: Path, kind: str, threads: int) -> Path:
    """`gguf` re-typed to `kind` with llama.cpp's own quantizer (cached beside it as STEM.KIND.gguf; written under a
    temporary name). A Q4_1 source re-typed to f32 holds exactly its dequantized weights."""
    import ctypes

    import llama_cpp
    from gguf import GGUFReader

    field_ = GGUFReader(gguf).fields.get("general.file_type")
    if field_ is not None and int(field_.parts[field_.data[0]][0]) == getattr(llama_cpp, LLAMA_CPP_TYPES[kind]):
        return gguf  # already of that type: the file itself, not a re-quantization of it
    out = gguf.with_name(f"{gguf.stem}.{kind}.gguf")
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_CPP_TYPES[kind])
    params.allow_requantize = True
    params.nthread = threads
    tmp, log = out.with_suffix(".part"), out.with_suffix(".log")
    print(f"llama.cpp: writing {out} (its quantizer's log: {log})", file=sys.stderr)
    with open(log, "w") as f:  # the quantizer prints a line per tensor on fd 2
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not write {kind} from {gguf} (see {log})")
    tmp.replace(out)
    return out


def llama_cpp_rows(job: BaselineJob, gguf: str, kind: str) -> list[dict]:
    """llama.cpp at batch 1 on the same token ids and threads, greedy (top_k 1, no repetition penalty, eos
    ignored), one weight type (child process)."""
    from llama_cpp import Llama

    path = llama_cpp_file(Path(gguf), kind, job.threads)
    llm = Llama(model_path=str(path), n_ctx=max(map(len, job.prompts)) + job.max_tokens + 8, n_threads=job.threads,
                n_threads_batch=job.threads, n_batch=512, verbose=False)

    def gen(ids: list[int], n: int) -> tuple[float, list[int]]:
        toks = []
        t0 = time.perf_counter()
        for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(t)
            if len(toks) == n:
                break
        return time.perf_counter() - t0, toks

    ms, outputs = time_batch1(gen, job)
    return [{"name": f"llama.cpp_{kind}", "ms_per_token": ms, "outputs": outputs, "file": str(path)}]


# ---- the child process -------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """TARGET JOB OUT: call TARGET ("module:function") with the job and options in JOB, write {"rows": ...} (or
    {"error": ...}) to OUT."""
    target, job_file, out_file = argv
    spec = json.loads(Path(job_file).read_text())
    module, _, fn = target.partition(":")
    try:
        rows = getattr(importlib.import_module(module), fn)(BaselineJob(**spec["job"]), **spec["options"])
    except Exception as e:  # the parent records it as this baseline's reason, and goes on
        Path(out_file).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    Path(out_file).write_text(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
