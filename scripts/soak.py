#!/usr/bin/env python3
"""Soak test of the served engine (issue 12; not part of the unit suite): an open-loop Poisson mix of streaming,
unary, cancelled and malformed requests against real tritonservers for --duration seconds (default 20 minutes).

What it does:
  1. builds a repository pair for the committed small trained pair (models/small: convert -> build-engine ->
     make-repo, eager `--compile off`) under --workdir, or takes --repo (decoupled) and --unary-repo;
  2. computes the offline greedy AR reference for every (prompt, max_tokens) it will send (the offline engine);
  3. starts two servers (serving.launcher.TritonServer): a decoupled one (gRPC streaming, the ensemble and the
     engine model, client cancellation and TensorRT-LLM's stop request, streamed malformed requests) and a
     `--decoupled false` one (unary gRPC / HTTP infer, unary malformed requests);
  4. sends Poisson arrivals at --rate req/s, each request with a deadline, and classifies every request:
        ok              final answer, output ids == the offline AR reference (greedy)
        expected_error  a malformed request answered by exactly one error that names the problem
        cancelled       cancelled mid-stream (client cancellation straight to tensorrt_llm or through the ensemble, or
                        a `stop=true` request with the same id through the ensemble); tokens received == a prefix of
                        the reference
        fault           (--fault-every) failed at once with a connection error while its server restarted after a
                        stub was killed: answered, with an error
        lost            no final answer by the request's deadline
        unexpected      any other error, a wrong error text, more than one answer, a mismatch with the reference
  5. samples /metrics of both servers every second (waiting / active requests, KV blocks), watches that both
     tritonservers and their Python-backend stub processes stay alive (same pids), and at the end checks: KV blocks
     used back to 0, no request running or waiting, the waiting queue bounded (--max-waiting), both tritonserver
     logs free of crash messages ('Stub process ... is not healthy', 'Segmentation fault', 'Signal (N) received',
     'Fatal Python error', ...), a clean shutdown (exit 0, nothing left to kill) and new `dmesg` lines (if readable);
  6. with --fault-every S, `kill -9` a Python-backend stub of the decoupled server every S seconds (tensorrt_llm,
     postprocessing, preprocessing, the BLS model in turn), healed by `serve`'s supervisor (launcher.Supervisor:
     the server restarted whole); reports each kill, the seconds until the server was ready again, and fails if a
     kill was not healed or a request was lost;
  7. prints one JSON summary as the last stdout line. Exit status 1 if any request was lost or unexpected, a crash
     was seen, the KV cache did not drain or the queue was unbounded; 0 otherwise.

Choosing the rate: the sustainable rate is the highest offered load at which the scheduler's waiting queue stays
bounded (it does not grow for the whole step) and nothing is lost. `--find-rate` measures it: it runs the same mix
for --find-step seconds at each rate of --find-rates (one pair of servers), stops at the first rate whose waiting
queue grows or that loses a request, and prints the highest rate that held; soak at that rate (or a bit below).

The latest runs' figures are in docs/serving.md ("Soak"), generated from their JSON in docs/perf/.

Why the kernel log is read: a Python-backend stub can crash without a word in the server's log or its exit status
(python_backend PR #429's crash at shutdown, in Metric::SaveToSharedMemory, which the engine model avoids by releasing
its metrics in finalize(), serving.metrics.ServingMetrics.release); dmesg is where it shows. The soak fails on any
crash line of its stubs, with the stub's model and phase.

    nice -n 19 python scripts/soak.py --rate 4 --duration 1200                 # the 20-minute soak
    nice -n 19 python scripts/soak.py --rate 1 --duration 180                  # a 3-minute check
    python scripts/soak.py --rate 2 --duration 1200 --fault-every 60           # 20 minutes, a stub killed a minute
    nice -n 19 python scripts/soak.py --find-rate --find-rates 2 4 6 8 --find-step 30
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["def fibonacci(n):", "import os", "class Node:", "def main():", "for i in range(10):",
           "import numpy as np", "def read_file(path):", "if __name__ == '__main__':", "# Sort a list of numbers",
           "def __init__(self, name):", "return", "with open(path) as f:"]
MAX_TOKENS = (8, 24, 48, 96)
CANCEL_MAX_TOKENS = 160  # cancelled requests ask for many tokens (end_id -1) so they are still running when cancelled
DEFAULT_MIX = ("stream=30,stream_engine=10,unary=20,unary_http=5,cancel_client=5,cancel_ensemble=5,cancel_stop=10,"
               "malformed=15")

# log lines that mean a process crashed (fail the soak)
CRASH_PATTERNS = [r"Stub process .* is not healthy", r"Segmentation fault", r"[Ss]ignal \((?!2\))\d+\) received",
                  r"core dumped", r"Fatal Python error", r"terminate called", r"\bAborted\b", r"SIGSEGV|SIGABRT|SIGBUS",
                  r"Failed to (?:restart|initialize) stub", r"stub process .*(?:died|exited|crashed)",
                  r"Bus error", r"double free|corrupted size|malloc\(\)"]
# log lines worth reporting (not failing the soak by themselves)
SUSPICIOUS_PATTERNS = [r"Traceback \(most recent call last\)", r"this is a bug in trt-redrafter",
                       r"^E\d{4} ", r"sending a response .* failed", r"could not be queued"]
DMESG_PATTERNS = r"segfault|traps:|general protection|Out of memory|Killed process|oom-kill|triton|python"


# ---- build ---------------------------------------------------------------------------------------------------------
def build_repos(workdir: Path, max_batch_size: int, max_queue_size: int) -> tuple[Path, Path, Path]:
    """(engine, decoupled repo, unary repo) for models/small, built under workdir (kept and reused)."""
    from trt_redrafter.cli import main as cli

    small = ROOT / "models" / "small"
    ckpt, engine = workdir / "small-ckpt", workdir / "small-engine"
    repos = {True: workdir / f"repo-decoupled-q{max_queue_size}", False: workdir / f"repo-unary-q{max_queue_size}"}

    def run(*args):
        t0 = time.monotonic()
        rc = cli([str(a) for a in args])
        if rc != 0:
            raise SystemExit(f"trt-redrafter {' '.join(map(str, args))} exited {rc}")
        log(f"trt-redrafter {args[0]}: {time.monotonic() - t0:.1f} s")

    if not (ckpt / "config.json").is_file():
        run("convert", "--base-model", small / "base", "--drafter", small / "drafter", "--output", ckpt,
            "--dtype", "float32", "--num-beams", 4, "--draft-len-per-beam", 4)
    if not (engine / "config.json").is_file():
        run("build-engine", "--checkpoint", ckpt, "--output", engine, "--tokenizer", small / "base",
            "--max-batch-size", max_batch_size, "--max-input-len", 256, "--max-seq-len", 512)
    for decoupled, repo in repos.items():
        if not (repo / "ensemble" / "config.pbtxt").is_file():
            run("make-repo", "--engine", engine, "--output", repo, "--compile", "off", "--decoupled",
                "true" if decoupled else "false", "--max-queue-size", max_queue_size)
    return engine, repos[True], repos[False]


def repo_engine_dir(repo: Path) -> Path:
    from trt_redrafter.serving.repo import repo_parameter

    return Path(repo_parameter(repo, "tensorrt_llm", "engine_dir"))


def repo_tokenizer_dir(repo: Path) -> Path:
    from trt_redrafter.serving.repo import repo_parameter

    return Path(repo_parameter(repo, "preprocessing", "tokenizer_dir"))


def offline_reference(engine_dir: Path, codec) -> tuple[dict, dict]:
    """Greedy AR outputs of the offline engine: {(prompt, n): ids} stopping at EOS (the server's default end_id),
    and {prompt: ids} of CANCEL_MAX_TOKENS tokens without EOS (what cancelled requests must be a prefix of)."""
    import torch

    from trt_redrafter.config import RuntimeConfig, SamplingConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.runtime.engine import Engine
    from trt_redrafter.runtime.generate import generate

    keys = [(p, n) for p in PROMPTS for n in MAX_TOKENS]
    cache = engine_dir / "soak-reference.json"  # the engine's greedy outputs do not change: computed once
    tag = {"prompts": PROMPTS, "max_tokens": list(MAX_TOKENS), "cancel_max_tokens": CANCEL_MAX_TOKENS,
           "engine_mtime": (engine_dir / "config.json").stat().st_mtime}
    try:
        saved = json.loads(cache.read_text())
        if saved["tag"] == tag:
            log(f"offline AR reference from {cache}")
            return ({(p, n): ids for (p, n), ids in zip(keys, saved["ref"])},
                    dict(zip(PROMPTS, saved["ref_noeos"])))
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.monotonic()
    engine = Engine.load(engine_dir, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off"))
    res = generate(engine, [codec.encode(p) for p, _ in keys], [SamplingConfig(max_tokens=n) for _, n in keys],
                   mode="ar", stop_ids=(codec.end_id,))
    ref = {k: r.output_ids for k, r in zip(keys, res)}
    res = generate(engine, [codec.encode(p) for p in PROMPTS], SamplingConfig(max_tokens=CANCEL_MAX_TOKENS),
                   mode="ar", stop_ids=())
    ref_noeos = {p: r.output_ids for p, r in zip(PROMPTS, res)}
    del engine
    try:
        cache.write_text(json.dumps({"tag": tag, "ref": [ref[k] for k in keys],
                                     "ref_noeos": [ref_noeos[p] for p in PROMPTS]}))
    except OSError:
        pass
    log(f"offline AR reference: {len(keys) + len(PROMPTS)} requests in {time.monotonic() - t0:.1f} s")
    return ref, ref_noeos


# ---- requests ------------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    i: int
    kind: str
    status: str = "unexpected"  # ok | expected_error | cancelled | lost | unexpected
    detail: str = ""
    sent_at: float = 0.0
    ended_at: float = 0.0
    latency_s: Optional[float] = None
    tokens: int = 0


def _tensor(mod, name: str, arr: np.ndarray):
    from tritonclient.utils import np_to_triton_dtype

    t = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def _tensors(mod, values: dict) -> list:
    return [_tensor(mod, k, v) for k, v in values.items()]


def ensemble_values(prompt: str, n: int, stream: Optional[bool] = None, end_id: Optional[int] = None) -> dict:
    v = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[n]], np.int32)}
    if stream is not None:
        v["stream"] = np.array([[stream]], bool)
    if end_id is not None:
        v["end_id"] = np.array([[end_id]], np.int32)
    return v


def engine_values(ids: list[int], n: int, stream: bool, end_id: Optional[int] = None) -> dict:
    v = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
         "request_output_len": np.array([[n]], np.int32), "streaming": np.array([[stream]], bool)}
    if end_id is not None:
        v["end_id"] = np.array([[end_id]], np.int32)
    return v


def malformed_cases(codec, max_input_len: int) -> list[tuple[str, str, dict, str]]:
    """(name, model, full input values, expected error text): each must get exactly one error."""
    ids = codec.encode(PROMPTS[0])
    long_prompt = " ".join(["x = 1"] * (max_input_len + 8))

    def ens(**over):
        v = ensemble_values(PROMPTS[0], 8)
        v.update(over)
        return {k: x for k, x in v.items() if x is not None}

    def eng(**over):
        v = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
             "request_output_len": np.array([[8]], np.int32)}
        v.update(over)
        return {k: x for k, x in v.items() if x is not None}

    return [
        ("missing_max_tokens", "ensemble", ens(max_tokens=None),
         "max_tokens (preprocessing's REQUEST_OUTPUT_LEN) is missing"),
        ("max_tokens_fp32", "ensemble", ens(max_tokens=np.array([[4.0]], np.float32)), "data-type is 'FP32'"),
        ("max_tokens_0", "ensemble", ens(max_tokens=np.array([[0]], np.int32)), "max_tokens must be a positive"),
        ("max_tokens_huge", "ensemble", ens(max_tokens=np.array([[10 ** 6]], np.int32)), "exceeds the engine's max_seq_len"),
        ("empty_text", "ensemble", ens(text_input=np.array([[b""]], dtype=object)), "text_input is empty"),
        ("prompt_too_long", "ensemble", ens(text_input=np.array([[long_prompt.encode()]], dtype=object)),
         f"max_input_len is {max_input_len}"),
        ("beam_width_2", "ensemble", ens(beam_width=np.array([[2]], np.int32)), "beam_width=2 is not supported"),
        ("negative_temperature", "ensemble", ens(temperature=np.array([[-0.5]], np.float32)), "bad sampling parameters"),
        ("repetition_penalty", "ensemble", ens(repetition_penalty=np.array([[1.2]], np.float32)), "repetition_penalty=1.2"),
        ("bad_decoding_mode", "ensemble", ens(decoding_mode=np.array([[b"medusa"]], dtype=object)),
         "decoding_mode must be one of"),
        ("lora", "ensemble", ens(lora_task_id=np.array([[3]], np.uint64)), "LoRA"),
        ("bad_input_lengths", "tensorrt_llm", eng(input_lengths=np.array([[99]], np.int32)), "input_lengths=99"),
        ("id_out_of_vocab", "tensorrt_llm", eng(input_ids=np.array([[5, 10 ** 7]], np.int32),
                                                input_lengths=np.array([[2]], np.int32)), "10000000"),
        ("bad_shape", "tensorrt_llm", eng(request_output_len=np.array([[4, 5]], np.int32)),
         "unexpected shape for input 'request_output_len'"),
    ]


class Stream:
    """One gRPC stream with its responses on a queue; `close` never blocks past its timeout."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.q: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.q.put((time.monotonic(), result, error)))

    def send(self, model: str, inputs: list, request_id: str) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def close(self, cancel: bool, timeout: float) -> bool:
        """stop_stream (waits until the server closes the stream); False if it did not within timeout."""
        done = threading.Event()

        def stop():
            try:
                self.client.stop_stream(cancel_requests=cancel)
            except Exception:
                pass
            done.set()

        threading.Thread(target=stop, daemon=True).start()
        ok = done.wait(max(timeout, 0.5))
        if not ok:  # the server never closed it: cancel the call so the thread ends
            try:
                self.client._stream._response_iterator.cancel()  # noqa: SLF001
            except Exception:
                pass
        try:
            self.client.close()
        except Exception:
            pass
        return ok


def _final(result) -> bool:
    p = result.get_response().parameters
    return p["triton_final_response"].bool_param if "triton_final_response" in p else False


def _ids(result) -> list[int]:
    x = result.as_numpy("output_ids")
    return [] if x is None else x.reshape(-1).tolist()


class Soak:
    def __init__(self, args, stream_srv, unary_srv, codec, ref, ref_noeos, max_input_len: int):
        self.a = args
        self.stream_srv, self.unary_srv = stream_srv, unary_srv
        self.codec, self.ref, self.ref_noeos = codec, ref, ref_noeos
        self.malformed_list = malformed_cases(codec, max_input_len)
        mix = dict(kv.split("=") for kv in args.mix.split(","))
        self.kinds = list(mix)
        self.weights = [float(mix[k]) for k in self.kinds]
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise SystemExit(f"--mix: unknown kind(s) {sorted(unknown)}; known: {sorted(KINDS)}")
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()

    # each returns (status, detail, tokens)
    def _collect(self, s: Stream, deadline: float, on_first=None) -> tuple[list, Optional[str], bool, int]:
        """Read responses until a final one, an error or the deadline: (ids, error, final, responses)."""
        ids, n = [], 0
        first_seen = False
        while True:
            try:
                _, result, error = s.q.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return ids, None, False, n
            n += 1
            if error is not None:
                return ids, str(error), True, n
            new = _ids(result)
            ids += new
            if new and not first_seen and on_first is not None:
                first_seen = True
                on_first()
            if _final(result):
                return ids, None, True, n

    def _check_ok(self, ids, prompt, n) -> tuple[str, str]:
        want = self.ref[(prompt, n)]
        if ids == want:
            return "ok", ""
        k = next((j for j, (x, y) in enumerate(zip(ids, want)) if x != y), min(len(ids), len(want)))
        return "unexpected", f"output != offline AR reference ({len(ids)} vs {len(want)} tokens, first difference at {k})"

    def stream(self, rng, engine: bool) -> tuple[str, str, int]:
        prompt, n = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
        deadline = time.monotonic() + self.a.deadline
        s = Stream(self.stream_srv.grpc_url)
        try:
            if engine:
                s.send("tensorrt_llm", _tensors(grpc(), engine_values(self.codec.encode(prompt), n, True,
                                                                     self.codec.end_id)), uuid.uuid4().hex[:12])
            else:
                s.send("ensemble", _tensors(grpc(), ensemble_values(prompt, n, stream=True)), uuid.uuid4().hex[:12])
            ids, error, final, _ = self._collect(s, deadline)
        finally:
            closed = s.close(cancel=False, timeout=deadline - time.monotonic())
        if not final:
            return "lost", f"no final response within {self.a.deadline:.0f} s ({len(ids)} tokens so far)", len(ids)
        if error is not None:
            return "unexpected", error[:300], len(ids)
        if not closed:
            return "lost", "final response arrived but the server never closed the stream", len(ids)
        st, d = self._check_ok(ids, prompt, n)
        return st, d, len(ids)

    def unary(self, rng, http: bool) -> tuple[str, str, int]:
        from tritonclient.utils import InferenceServerException

        prompt, n = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
        try:
            if http:
                import tritonclient.http as httpclient

                c = httpclient.InferenceServerClient(self.unary_srv.http_url.removeprefix("http://"),
                                                     connection_timeout=self.a.deadline, network_timeout=self.a.deadline)
                r = c.infer("ensemble", _tensors(httpclient, ensemble_values(prompt, n)))
                c.close()
            else:
                c = grpc().InferenceServerClient(self.unary_srv.grpc_url)
                r = c.infer("ensemble", _tensors(grpc(), ensemble_values(prompt, n)), client_timeout=self.a.deadline)
                c.close()
        except InferenceServerException as e:
            msg = str(e)
            if "Deadline Exceeded" in msg or "timed out" in msg.lower():
                return "lost", f"no answer within {self.a.deadline:.0f} s: {msg[:200]}", 0
            return "unexpected", msg[:300], 0
        except Exception as e:  # HTTP client timeouts come as socket/gevent errors
            msg = f"{type(e).__name__}: {e}"
            if "timeout" in msg.lower() or "timed out" in msg.lower():
                return "lost", f"no answer within {self.a.deadline:.0f} s: {msg[:200]}", 0
            return "unexpected", msg[:300], 0
        ids = r.as_numpy("output_ids").reshape(-1).tolist()
        st, d = self._check_ok(ids, prompt, n)
        return st, d, len(ids)

    def _cancelled_check(self, prompt, ids) -> tuple[str, str]:
        want = self.ref_noeos[prompt]
        if ids != want[:len(ids)]:
            return "unexpected", f"tokens before the cancellation are not a prefix of the reference ({len(ids)} tokens)"
        if len(ids) >= CANCEL_MAX_TOKENS:
            return "ok", "completed before the cancellation took effect"
        return "cancelled", ""

    def cancel_client(self, rng, ensemble: bool = False) -> tuple[str, str, int]:
        """Streaming, cancelled by the client (stop_stream(cancel_requests=True)) after k responses: straight to
        tensorrt_llm (the engine model's monitor frees it) or through the ensemble (postprocessing sends the engine
        the request's key)."""
        prompt, k = rng.choice(PROMPTS), rng.randint(1, 3)
        deadline = time.monotonic() + self.a.deadline
        s = Stream(self.stream_srv.grpc_url)
        ids, got, final, error = [], 0, False, None
        try:
            if ensemble:
                s.send("ensemble", _tensors(grpc(), ensemble_values(prompt, CANCEL_MAX_TOKENS, True, -1)),
                       uuid.uuid4().hex[:12])
            else:
                s.send("tensorrt_llm", _tensors(grpc(), engine_values(self.codec.encode(prompt), CANCEL_MAX_TOKENS,
                                                                     True, -1)), uuid.uuid4().hex[:12])
            while got < k:
                try:
                    _, result, err = s.q.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                got += 1
                if err is not None:
                    error = str(err)
                    break
                ids += _ids(result)
                if _final(result):
                    final = True
                    break
        finally:
            closed = s.close(cancel=True, timeout=deadline - time.monotonic())
        if error is not None:
            return "unexpected", error[:300], len(ids)
        if got < k and not final:
            return "lost", f"only {got} of the {k} responses before the cancellation arrived by the deadline", len(ids)
        if not closed:
            return "lost", "cancelling the stream did not finish by the deadline", len(ids)
        st, d = self._cancelled_check(prompt, ids)
        return st, d, len(ids)

    def cancel_stop(self, rng) -> tuple[str, str, int]:
        """Through the ensemble (streaming), ended by TensorRT-LLM's stop request (same id, stop=true) after the
        first tokens; the stream must end with a final response and no error."""
        from trt_redrafter.serving.client import send_stop

        prompt = rng.choice(PROMPTS)
        rid = f"soak-stop-{uuid.uuid4().hex[:10]}"
        deadline = time.monotonic() + self.a.deadline
        stop_error = []

        def stop():
            try:
                send_stop(self.stream_srv.grpc_url, rid, timeout=max(deadline - time.monotonic(), 1.0))
            except Exception as e:
                stop_error.append(f"{type(e).__name__}: {e}")

        stopper = threading.Thread(target=stop, daemon=True)
        s = Stream(self.stream_srv.grpc_url)
        ids, error, final = [], None, False
        try:
            s.send("ensemble", _tensors(grpc(), ensemble_values(prompt, CANCEL_MAX_TOKENS, stream=True, end_id=-1)),
                   rid)
            ids, error, final, _ = self._collect(s, deadline, on_first=stopper.start)
        finally:
            closed = s.close(cancel=not final, timeout=deadline - time.monotonic())
        if stopper.ident is not None:
            stopper.join(max(deadline - time.monotonic(), 0.1))
        if not final:
            return "lost", f"no final response within {self.a.deadline:.0f} s after the stop request", len(ids)
        if error is not None:
            return "unexpected", error[:300], len(ids)
        if stopper.is_alive():
            return "lost", "the stop request got no answer by the deadline", len(ids)
        if stop_error:
            return "unexpected", f"stop request failed: {stop_error[0][:300]}", len(ids)
        if not closed:
            return "lost", "final response arrived but the server never closed the stream", len(ids)
        st, d = self._cancelled_check(prompt, ids)
        return st, d, len(ids)

    def malformed(self, rng) -> tuple[str, str, int]:
        from tritonclient.utils import InferenceServerException

        name, model, values, expect = rng.choice(self.malformed_list)
        streaming = rng.random() < 0.5
        if streaming:
            deadline = time.monotonic() + self.a.deadline
            s = Stream(self.stream_srv.grpc_url)
            try:
                s.send(model, _tensors(grpc(), values), uuid.uuid4().hex[:12])
                try:
                    first = s.q.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    first = None
            finally:
                # stop_stream waits until the server closes the stream: everything it sent is on the queue then
                closed = s.close(cancel=False, timeout=deadline - time.monotonic())
            if first is None:
                return "lost", f"[stream {name}] no answer within {self.a.deadline:.0f} s", 0
            answers = [first] + [s.q.get() for _ in range(s.q.qsize())]
            errors = [str(e) for _, _, e in answers if e is not None]
            if len(answers) != 1 or len(errors) != 1:
                return "unexpected", f"[stream {name}] {len(answers)} answers, {len(errors)} errors: {errors[:2]}", 0
            if not closed:
                return "lost", f"[stream {name}] the server never closed the stream after the error", 0
            error = errors[0]
        else:
            if model == "tensorrt_llm":
                values = {**values, "streaming": np.array([[False]], bool)}
            try:
                c = grpc().InferenceServerClient(self.unary_srv.grpc_url)
                c.infer(model, _tensors(grpc(), values), client_timeout=self.a.deadline)
                c.close()
                return "unexpected", f"[unary {name}] answered without an error", 0
            except InferenceServerException as e:
                error = str(e)
                if "Deadline Exceeded" in error:
                    return "lost", f"[unary {name}] no answer within {self.a.deadline:.0f} s", 0
        if expect not in error:
            return "unexpected", f"[{'stream' if streaming else 'unary'} {name}] wrong error: {error[:300]}", 0
        return "expected_error", name, 0

    # ---- the run ---------------------------------------------------------------------------------------------------
    def one(self, i: int, kind: str, seed: int) -> None:
        rng = random.Random(seed)
        o = Outcome(i, kind, sent_at=time.monotonic())
        try:
            fn = KINDS[kind]
            o.status, o.detail, o.tokens = fn(self, rng)
        except Exception as e:
            o.status, o.detail = "unexpected", f"client exception {type(e).__name__}: {e}"[:300]
        o.ended_at = time.monotonic()
        o.latency_s = o.ended_at - o.sent_at
        with self.lock:
            self.outcomes.append(o)

    def run(self, rate: float, duration: float, seed: int, monitor: "Monitor") -> dict:
        rng = random.Random(seed)
        threads = []
        t0 = time.monotonic()
        next_t, i = 0.0, 0
        while next_t < duration:
            delay = t0 + next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            kind = rng.choices(self.kinds, self.weights)[0]
            th = threading.Thread(target=self.one, args=(i, kind, rng.randrange(2 ** 31)), daemon=True)
            th.start()
            threads.append(th)
            i += 1
            next_t += rng.expovariate(rate)
            if i % 50 == 0:
                c = Counter(o.status for o in self.outcomes)
                log(f"t={time.monotonic() - t0:.0f}s sent={i} done={sum(c.values())} {dict(c)} "
                    f"waiting(now/peak)={monitor.last_waiting}/{monitor.peak_waiting}")
        sent_s = time.monotonic() - t0
        # every request has a deadline, so all threads end by then (plus the close timeouts)
        join_deadline = time.monotonic() + self.a.deadline + 30
        for th in threads:
            th.join(max(join_deadline - time.monotonic(), 0.1))
        stuck = sum(th.is_alive() for th in threads)
        return {"sent": i, "arrival_window_s": round(sent_s, 1), "wall_s": round(time.monotonic() - t0, 1),
                "client_threads_stuck": stuck}


KINDS = {
    "stream": lambda self, rng: self.stream(rng, engine=False),
    "stream_engine": lambda self, rng: self.stream(rng, engine=True),
    "unary": lambda self, rng: self.unary(rng, http=False),
    "unary_http": lambda self, rng: self.unary(rng, http=True),
    "cancel_client": lambda self, rng: self.cancel_client(rng),
    "cancel_ensemble": lambda self, rng: self.cancel_client(rng, ensemble=True),
    "cancel_stop": lambda self, rng: self.cancel_stop(rng),
    "malformed": lambda self, rng: self.malformed(rng),
}


def grpc():
    import tritonclient.grpc as grpcclient

    return grpcclient


# ---- server health ------------------------------------------------------------------------------------------------
def stub_pids(srv) -> dict[int, str]:
    """{pid: cmdline} of the Python-backend stub processes in the server's process group."""
    from trt_redrafter.serving.launcher import stub_processes

    return {} if srv.proc is None else stub_processes(srv.proc.pid)


def stub_model(cmd: str) -> str:
    """The model a stub serves, from its command line (its first argument is the model's model.py path)."""
    m = re.search(r"/([^/ ]+)/\d+/model\.py", cmd)
    return m.group(1) if m else cmd[:80]


class Monitor:
    """Every --sample-period seconds: both servers' /metrics (waiting, active, KV blocks), that both tritonservers run
    and that their stub processes are the ones seen at the start."""

    def __init__(self, servers: dict, period: float, faulted: tuple[str, ...] = ()):
        """faulted: servers whose stubs --fault-every kills; their restarts are the Faults thread's to check."""
        self.servers, self.period, self.faulted = servers, period, faulted
        self.stubs0 = {name: stub_pids(s) for name, s in servers.items()}
        self.all_stubs: dict[int, str] = {pid: f"{name}/{stub_model(c)}" for name, st in self.stubs0.items()
                                          for pid, c in st.items()}
        self.samples: dict[str, list] = defaultdict(list)  # name -> [(t, waiting, active, kv_used)]
        self.events: list[str] = []
        self.peak_waiting = 0.0
        self.last_waiting = 0.0
        self.scrape_errors = 0
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(10)

    def check_processes(self) -> None:
        for name, srv in self.servers.items():
            if name in self.faulted:
                for pid, cmd in stub_pids(srv).items():
                    self.all_stubs.setdefault(pid, f"{name}/{stub_model(cmd)}")
                continue
            rc = srv.poll()
            if rc is not None:
                ev = f"{name}: tritonserver exited with status {rc} during the soak"
                if ev not in self.events:
                    self.events.append(ev)
            now = stub_pids(srv)
            for pid, cmd in now.items():
                self.all_stubs.setdefault(pid, f"{name}/{stub_model(cmd)}")
            for pid, cmd in self.stubs0[name].items():
                if pid not in now:
                    ev = f"{name}: stub {pid} ({stub_model(cmd)}) is gone"
                    if ev not in self.events:
                        self.events.append(ev)
            for pid, cmd in now.items():
                if pid not in self.stubs0[name]:
                    ev = f"{name}: new stub {pid} ({stub_model(cmd)}) appeared (a restarted stub?)"
                    if ev not in self.events:
                        self.events.append(ev)

    def sample(self, name: str, srv) -> Optional[tuple]:
        from trt_redrafter.serving.metrics import scrape, sum_metric

        try:
            m = scrape(srv.metrics_url)
        except OSError:
            self.scrape_errors += 1
            return None
        row = (round(time.monotonic() - self._t0, 1), sum_metric(m, "trt_redrafter_waiting_requests"),
               sum_metric(m, "trt_redrafter_active_requests"), sum_metric(m, "trt_redrafter_kv_blocks_used"))
        self.samples[name].append(row)
        return row

    def _loop(self):
        while not self._stop.wait(self.period):
            waiting = 0.0
            for name, srv in self.servers.items():
                row = self.sample(name, srv)
                if row:
                    waiting += row[1]
            self.last_waiting = waiting
            self.peak_waiting = max(self.peak_waiting, waiting)
            self.check_processes()

    def wait_idle(self, timeout: float) -> dict:
        """Poll until nothing runs, waits or holds KV blocks on either server; the last values per server."""
        deadline = time.monotonic() + timeout
        while True:
            last = {name: self.sample(name, srv) for name, srv in self.servers.items()}
            idle = all(r is not None and r[1] == r[2] == r[3] == 0 for r in last.values())
            if idle or time.monotonic() > deadline:
                return {name: (None if r is None else {"waiting": r[1], "active": r[2], "kv_blocks_used": r[3]})
                        for name, r in last.items()}
            time.sleep(0.2)

    def queue_stats(self) -> dict:
        out = {}
        for name, rows in self.samples.items():
            w = [r[1] for r in rows]
            if not w:
                continue
            half = len(w) // 2
            out[name] = {"samples": len(w), "peak_waiting": max(w), "mean_waiting": round(sum(w) / len(w), 2),
                         "mean_waiting_first_half": round(sum(w[:half]) / max(half, 1), 2),
                         "mean_waiting_second_half": round(sum(w[half:]) / max(len(w) - half, 1), 2),
                         "peak_active": max(r[2] for r in rows), "peak_kv_blocks_used": max(r[3] for r in rows)}
        return out


FAULT_VICTIMS = ("tensorrt_llm", "postprocessing", "preprocessing", "tensorrt_llm_bls")
# errors a request in flight (or sent) while its server restarts gets: the connection closes or is refused
FAULT_ERRORS = r"UNAVAILABLE|Socket closed|Connection refused|failed to connect|Stream removed|Broken pipe|" \
               r"Connection reset|not healthy|CANCELLED|RemoteDisconnected|Connection aborted|no longer in valid state"


class Faults:
    """--fault-every S: every S seconds `kill -9` one Python-backend stub of the decoupled server (tensorrt_llm,
    postprocessing, preprocessing, the BLS model, in turn), with `serve`'s supervisor (launcher.Supervisor) healing
    it. Records each kill and when the server was ready again."""

    def __init__(self, srv, every: float):
        from trt_redrafter.serving.launcher import Supervisor

        self.srv, self.every = srv, every
        self.supervisor = Supervisor(srv, max_restarts=10 ** 6)
        self.kills: list[dict] = []  # {"t": monotonic, "model", "pid", "ready_s": seconds until ready again}
        self.restarts_seen = 0
        self._no_more_kills = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Faults":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self, heal_timeout: float = 120.0) -> None:
        """No more kills; wait (up to heal_timeout) until the last one is healed, then stop watching."""
        self._no_more_kills = True
        deadline = time.monotonic() + heal_timeout
        while self.kills and self.kills[-1]["ready_s"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self._stop.set()
        self._thread.join(120)

    def windows(self, margin: float = 2.0) -> list[tuple[float, float]]:
        """(from, to) monotonic times during which a request may fail because of a fault."""
        return [(k["t"] - margin, k["t"] + (k["ready_s"] or 300.0) + margin) for k in self.kills]

    def _loop(self) -> None:
        next_kill = self._t0 + self.every
        while not self._stop.wait(self.supervisor.WATCH_PERIOD_S):
            n = len(self.supervisor.recoveries)
            if self.supervisor.check() is not None:  # never with this budget
                return
            if len(self.supervisor.recoveries) > n:
                self.restarts_seen += 1
                if self.kills and self.kills[-1]["ready_s"] is None:
                    self.kills[-1]["ready_s"] = round(time.monotonic() - self.kills[-1]["t"], 2)
                log(f"fault: decoupled server ready again {self.kills[-1]['ready_s'] if self.kills else '?'} s after "
                    f"the kill")
            if time.monotonic() >= next_kill and not self._no_more_kills:
                model = FAULT_VICTIMS[len(self.kills) % len(FAULT_VICTIMS)]
                victims = [pid for pid, cmd in stub_pids(self.srv).items() if stub_model(cmd) == model]
                if victims:
                    os.kill(victims[0], signal.SIGKILL)
                    self.kills.append({"t": time.monotonic(), "at_s": round(time.monotonic() - self._t0, 1),
                                       "model": model, "pid": victims[0], "ready_s": None})
                    log(f"fault: killed the {model} stub (pid {victims[0]}) of the decoupled server")
                next_kill += self.every

    def summary(self) -> dict:
        ready = sorted(k["ready_s"] for k in self.kills if k["ready_s"] is not None)
        return {"every_s": self.every, "kills": [{k: v for k, v in x.items() if k != "t"} for x in self.kills],
                "restarts": self.restarts_seen,
                "recovery_s_median": ready[len(ready) // 2] if ready else None,
                "recovery_s_max": ready[-1] if ready else None}


def classify_faults(outcomes: list, windows: list[tuple[float, float]]) -> int:
    """Outcomes that failed with a connection error while their server restarted after a fault: answered (an error,
    at once), status `fault`. Returns how many."""
    n = 0
    for o in outcomes:
        if o.status == "unexpected" and re.search(FAULT_ERRORS, o.detail) and any(
                o.sent_at <= hi and o.ended_at >= lo for lo, hi in windows):
            o.status, n = "fault", n + 1
    return n


def scan_log(path: Path) -> dict:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return {"path": str(path), "error": str(e)}
    crash, suspicious = [], []
    for line in text.splitlines():
        if any(re.search(p, line) for p in CRASH_PATTERNS):
            crash.append(line[:300])
        elif any(re.search(p, line) for p in SUSPICIOUS_PATTERNS):
            suspicious.append(line[:300])
    return {"path": str(path), "lines": text.count("\n"), "crash_lines": len(crash), "crash_samples": crash[:10],
            "suspicious_lines": len(suspicious), "suspicious_samples": suspicious[:10]}


def uptime() -> Optional[float]:
    """Seconds since boot (the clock of dmesg's timestamps)."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None


# ---- main ----------------------------------------------------------------------------------------------------------
def start_servers(stream_repo: Path, unary_repo: Path, workdir: Path):
    from trt_redrafter.runtime.distributed import free_port
    from trt_redrafter.serving.launcher import TritonServer

    stamp = time.strftime("%Y%m%d-%H%M%S")
    servers = {}
    for name, repo in (("decoupled", stream_repo), ("unary", unary_repo)):
        srv = TritonServer(repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port(),
                           log_path=workdir / f"tritonserver-{name}-{stamp}.log")
        t0 = time.monotonic()
        try:
            srv.start()
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
        log(f"{name} server ready in {time.monotonic() - t0:.1f} s (gRPC {srv.grpc_url}, log {srv.log_path})")
        servers[name] = srv
    return servers


def summarize(outcomes: list[Outcome]) -> dict:
    by_status = Counter(o.status for o in outcomes)
    by_kind = defaultdict(Counter)
    for o in outcomes:
        by_kind[o.kind][o.status] += 1
    lat = sorted(o.latency_s for o in outcomes if o.status == "ok" and o.latency_s is not None)
    bad = [o for o in outcomes if o.status in ("lost", "unexpected")]
    return {"requests": len(outcomes), "outcomes": {k: by_status.get(k, 0) for k in
                                                    ("ok", "expected_error", "cancelled", "fault", "lost",
                                                     "unexpected")},
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "ok_latency_s_p50": lat[len(lat) // 2] if lat else None,
            "ok_latency_s_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "ok_tokens": sum(o.tokens for o in outcomes if o.status == "ok"),
            "bad_requests": [{"i": o.i, "kind": o.kind, "status": o.status, "detail": o.detail,
                              "latency_s": round(o.latency_s or 0, 2), "sent_at": round(o.sent_at, 2),
                              "ended_at": round(o.ended_at, 2)} for o in bad[:25]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, help="a decoupled repository to serve (default: build one from models/small)")
    p.add_argument("--unary-repo", type=Path, help="a `make-repo --decoupled false` repository of the same engine")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/trt-redrafter-soak"),
                   help="where the checkpoint, engine, repositories and server logs go (reused across runs)")
    p.add_argument("--max-batch-size", type=int, default=8, help="of the engine built from models/small")
    p.add_argument("--max-queue-size", type=int, default=0, help="make-repo --max-queue-size (0: no limit)")
    p.add_argument("--rate", type=float, default=1.0, help="offered load, requests/s (Poisson arrivals)")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of arrivals")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds each request has for its final answer")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... (default {DEFAULT_MIX})")
    p.add_argument("--max-waiting", type=float, default=None,
                   help="peak waiting requests (both servers) allowed; default 4 x max_batch_size")
    p.add_argument("--sample-period", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-every", type=float, default=0.0,
                   help="kill -9 a stub of the decoupled server every this many seconds, healed as `serve` heals it "
                        "(0: no faults); requests failed by a fault are counted as `fault`, a lost one fails the soak")
    p.add_argument("--find-rate", action="store_true", help="step through --find-rates and report the highest rate "
                   "whose waiting queue stays bounded with nothing lost, instead of soaking")
    p.add_argument("--find-rates", type=float, nargs="+", default=[0.5, 1, 2, 3, 4, 6, 8])
    p.add_argument("--find-step", type=float, default=60.0, help="seconds per rate with --find-rate")
    a = p.parse_args()

    from trt_redrafter.checkpoint.engine_config import load_engine_config
    from trt_redrafter.serving.launcher import kernel_log, kernel_log_since
    from trt_redrafter.serving.text import TextCodec

    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.repo:
        if not a.unary_repo:
            raise SystemExit("--repo needs --unary-repo (a `make-repo --decoupled false` repository of the same engine)")
        stream_repo, unary_repo = a.repo, a.unary_repo
    else:
        _, stream_repo, unary_repo = build_repos(a.workdir, a.max_batch_size, a.max_queue_size)
    engine_dir = repo_engine_dir(stream_repo)
    build = load_engine_config(engine_dir).build
    max_waiting = a.max_waiting if a.max_waiting is not None else 4 * build.max_batch_size
    codec = TextCodec(repo_tokenizer_dir(stream_repo))
    ref, ref_noeos = offline_reference(engine_dir, codec)
    dmesg0 = kernel_log()
    marks = {"start": uptime()}

    servers = start_servers(stream_repo, unary_repo, a.workdir)
    summary: dict = {"rate": a.rate, "duration_s": a.duration, "deadline_s": a.deadline, "mix": a.mix,
                     "engine": str(engine_dir), "max_batch_size": build.max_batch_size,
                     "max_queue_size": a.max_queue_size}
    monitor = Monitor(servers, a.sample_period, faulted=("decoupled",) if a.fault_every else ()).start()
    faults = Faults(servers["decoupled"], a.fault_every).start() if a.fault_every else None
    summary["stubs_at_start"] = {n: {str(pid): stub_model(c) for pid, c in s.items()}
                                 for n, s in monitor.stubs0.items()}
    soak = Soak(a, servers["decoupled"], servers["unary"], codec, ref, ref_noeos, build.max_input_len)
    failures: list[str] = []
    try:
        if a.find_rate:
            steps, best = [], None
            for k, rate in enumerate(a.find_rates):
                soak.outcomes = []
                rows0 = {n: len(r) for n, r in monitor.samples.items()}
                run = soak.run(rate, a.find_step, a.seed + k, monitor)
                w = [r[1] for n in monitor.samples for r in monitor.samples[n][rows0.get(n, 0):]]
                third = max(len(w) // 3, 1)
                s = summarize(soak.outcomes)
                lost = s["outcomes"]["lost"] + s["outcomes"]["unexpected"]
                growing = bool(w) and (sum(w[-third:]) / third > max(2.0, 2 * sum(w[:third]) / third)
                                       or max(w) > max_waiting)
                step = {"rate": rate, **run, "outcomes": s["outcomes"], "peak_waiting": max(w) if w else None,
                        "waiting_growing": growing, "ok_latency_s_p50": s["ok_latency_s_p50"]}
                steps.append(step)
                print(json.dumps(step), flush=True)
                monitor.wait_idle(60)
                if lost or growing:
                    break
                best = rate
            summary["find_rate"] = {"steps": steps, "sustainable_rate": best}
        else:
            summary["run"] = soak.run(a.rate, a.duration, a.seed, monitor)
            if faults is not None:
                faults.stop()
                classify_faults(soak.outcomes, faults.windows())
                summary["faults"] = faults.summary()
                if faults.restarts_seen != len(faults.kills):
                    failures.append(f"{len(faults.kills)} stub(s) killed but {faults.restarts_seen} restart(s)")
                if any(k["ready_s"] is None for k in faults.kills):
                    failures.append("the decoupled server was not ready again after a fault")
            summary.update(summarize(soak.outcomes))
            summary["answered"] = summary["requests"] - summary["outcomes"]["lost"]
            o = summary["outcomes"]
            if o["lost"]:
                failures.append(f"{o['lost']} request(s) lost")
            if o["unexpected"]:
                failures.append(f"{o['unexpected']} unexpected outcome(s)")
            if summary["run"]["client_threads_stuck"]:
                failures.append(f"{summary['run']['client_threads_stuck']} client thread(s) never finished")
        summary["idle_at_end"] = idle = monitor.wait_idle(60)
        for name, r in idle.items():
            if r is None:
                failures.append(f"{name}: /metrics unreadable at the end")
            elif r["kv_blocks_used"] or r["active"] or r["waiting"]:
                failures.append(f"{name}: not idle 60 s after the last request: {r}")
        monitor.stop()
        monitor.check_processes()
        summary["queue"] = monitor.queue_stats()
        peak = max((q["peak_waiting"] for q in summary["queue"].values()), default=0)
        summary["max_waiting_allowed"] = max_waiting
        if peak > max_waiting and not a.find_rate:
            failures.append(f"waiting queue unbounded: peak {peak} > {max_waiting} (lower --rate; see --find-rate)")
        summary["metrics_scrape_errors"] = monitor.scrape_errors
        summary["stubs_at_end"] = {n: {str(pid): stub_model(c) for pid, c in stub_pids(s).items()}
                                   for n, s in servers.items()}
    finally:
        if faults is not None:
            faults.stop()
        monitor.stop()
        process_events = list(monitor.events)
        marks["shutdown"] = uptime()
        shutdown = {}
        for name, srv in servers.items():
            rep = srv.stop()
            shutdown[name] = {"returncode": rep["returncode"], "killed": rep["killed"],
                              "removed_shm": rep["removed_shm"]}
    summary["process_events"] = process_events
    failures += process_events
    summary["shutdown"] = shutdown
    for name, rep in shutdown.items():
        if rep["returncode"] != 0 or rep["killed"]:
            failures.append(f"{name}: unclean shutdown {rep}")
    summary["logs"] = {name: scan_log(srv.log_path) for name, srv in servers.items()}
    for name, lg in summary["logs"].items():
        if lg.get("crash_lines") and name not in monitor.faulted:  # the faulted server's are the faults' own
            failures.append(f"{name}: {lg['crash_lines']} crash line(s) in {lg['path']}")
    new = kernel_log_since(dmesg0)
    if new is None:
        summary["dmesg"] = "not readable"
    else:
        hits = [ln for ln in new if re.search(DMESG_PATTERNS, ln, re.I)]
        attributed = []
        for ln in hits:  # "[17503.52] triton_python_b[775]: segfault at 60 ...": whose process, and when
            m = re.match(r"\[\s*([\d.]+)\]\s+([^\[]+)\[(\d+)\]", ln)
            if not m:
                attributed.append({"line": ln[:300]})
                continue
            t, pid = float(m.group(1)), int(m.group(3))
            phase = ("before the soak" if marks["start"] and t < marks["start"] - 5 else
                     "during the soak" if marks["shutdown"] is None or t < marks["shutdown"] else
                     "during shutdown")
            attributed.append({"line": ln[:300], "pid": pid, "t": t,
                               "process": monitor.all_stubs.get(pid, "not ours"),
                               "phase": phase, "s_after_shutdown_began": round(t - marks["shutdown"], 1)
                               if marks["shutdown"] else None})
        windows = faults.windows(margin=5.0) if faults is not None else []
        for h in attributed:  # a crash a fault caused (killing the BLS stub crashes tritonserver 2.51 itself)
            t = h.get("t")
            if t is not None and any(lo <= t <= hi for lo, hi in windows):
                h["phase"] = "during a fault"
        ours = [h for h in attributed if (h.get("process", "not ours") != "not ours" or "pid" not in h)
                and h.get("phase") != "during a fault"]
        summary["dmesg"] = {"new_lines": len(new), "crash_like": attributed[:10]}
        if ours:
            failures.append(f"dmesg: {len(ours)} crash-like line(s) of this soak's processes: "
                            + "; ".join(f"{h.get('process')} pid {h.get('pid')} {h.get('phase')}" for h in ours[:5]))
    summary["failures"] = failures
    summary["passed"] = not failures
    print(json.dumps(summary), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
