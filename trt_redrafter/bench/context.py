"""Workloads whose requests share context, replayed through a served engine's OpenAI API with prefix reuse on and off
in one run (`trt-redrafter bench-reuse`, docs/perf.md):

    conversation   MT-Bench as two-turn conversations: turn 2 is sent after turn 1's answer, with that answer in its
                   history, in the model's chat template (the OpenAI frontend applies it to the messages)
    shared-prefix  N requests at a fixed concurrency whose prompts begin with one long system message (MT-Bench's
                   first turns, cut to a token count), each followed by its own MT-Bench question

Every request is streamed with the `openai` client. TTFT is the time to the first content chunk, TPOT (last content
chunk - first) / (completion tokens - 1), and `usage.prompt_tokens_details.cached_tokens` the prompt tokens the engine
took from its prefix cache. The two servers (one engine, `kv_cache_reuse` on and off) run one at a time, their
requests interleaved and the order flipped every conversation, so a shared machine's drift lands on both. Greedy
decoding: the texts with reuse on and off must be equal, and the run says whether they are.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..errors import UserError
from ..log import get_logger
from .metrics import median

logger = get_logger(__name__)

WORKLOADS = ("conversation", "shared-prefix")
REUSE = ("reuse", "no-reuse")  # the two servers, kv_cache_reuse on and off
MODEL = "bench"  # the served name the requests use


@dataclass
class Turn:
    """One streamed request's timing and what it produced."""

    server: str  # reuse | no-reuse
    mode: str  # ar | redrafter
    key: str  # which request: "conv3/turn2", "shared7"
    text: str
    ttft_ms: float
    tpot_ms: Optional[float]
    e2e_ms: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def mtbench_conversations(dataset: str, n: Optional[int] = None) -> list[tuple[str, str]]:
    """MT-Bench's questions with two turns (the first n), as (turn 1, turn 2) texts."""
    from ..datasets import read_jsonl, resolve_dataset

    path = resolve_dataset(dataset)
    rows = read_jsonl(path, "dataset {path} does not exist; pass MT-Bench's question.jsonl or mt-bench.")
    out = [(str(r["turns"][0]), str(r["turns"][1])) for _, r in rows
           if isinstance(r, dict) and isinstance(r.get("turns"), list) and len(r["turns"]) >= 2]
    if not out or (n is not None and len(out) < n):
        raise UserError(f"dataset {path} has {len(out)} two-turn conversations; ask for at most that many.")
    return out if n is None else out[:n]


def system_prompt(dataset: str, tokens: int, tokenizer, start: int = 0) -> str:
    """A system message of `tokens` tokens (as `tokenizer` encodes it alone): MT-Bench's first turns one after
    another from the `start`-th, cut there (another `start`, another prompt: nothing for reuse to share)."""
    questions = [q for q, _ in mtbench_conversations(dataset)]
    questions = questions[start % len(questions):] + questions[:start % len(questions)]
    ids: list[int] = []
    while len(ids) < tokens:
        for q in questions:
            ids += tokenizer.encode(q + "\n\n", add_special_tokens=False)
            if len(ids) >= tokens:
                break
    return tokenizer.decode(ids[:tokens])


def stream_chat(client, messages: list[dict], max_tokens: int, mode: str, server: str, key: str) -> Turn:
    """One chat request, streamed and timed (greedy; the engine's statistics in the usage chunk)."""
    t0 = time.perf_counter()
    times, text, usage = [], [], None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"decoding_mode": mode})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    if usage is None or not times:
        raise UserError(f"{server} server: request {key} ({mode}) returned no tokens or no usage.")
    n = usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    return Turn(server, mode, key, "".join(text), (times[0] - t0) * 1e3,
                (times[-1] - times[0]) * 1e3 / (n - 1) if n > 1 else None, (end - t0) * 1e3, usage.prompt_tokens, n,
                int(getattr(details, "cached_tokens", 0) or 0))


def run_conversations(clients: dict[str, object], conversations: list[tuple[str, str]], modes: list[str],
                      max_tokens: int) -> list[Turn]:
    """Each conversation on each server (the server order flipped every conversation): turn 1, then turn 2 over turn
    1's answer. The modes take turns through the conversations (conversation i in mode i % len(modes)), so that no
    request finds what another mode's request left in the cache."""
    out = []
    for i, (q1, q2) in enumerate(conversations):
        for mode in modes[i % len(modes):i % len(modes) + 1]:
            for server in (REUSE if (i // len(modes)) % 2 == 0 else REUSE[::-1]):
                client = clients[server]
                first = [{"role": "user", "content": q1}]
                t1 = stream_chat(client, first, max_tokens, mode, server, f"conv{i}/turn1")
                second = first + [{"role": "assistant", "content": t1.text}, {"role": "user", "content": q2}]
                t2 = stream_chat(client, second, max_tokens, mode, server, f"conv{i}/turn2")
                out += [t1, t2]
    return out


def run_shared_prefix(client, server: str, system: str, questions: list[str], mode: str, concurrency: int,
                      max_tokens: int) -> tuple[list[Turn], float]:
    """The requests (system + question each), `concurrency` at a time -> their turns and the wall time (s)."""
    results: list[Optional[Turn]] = [None] * len(questions)
    errors: list[BaseException] = []
    todo = iter(range(len(questions)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None or errors:
                return
            try:
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": questions[i]}]
                results[i] = stream_chat(client, msgs, max_tokens, mode, server, f"shared{i}")
            except BaseException as e:  # noqa: BLE001  re-raised below, in the caller's thread
                errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], time.perf_counter() - t0


@contextlib.contextmanager
def serve_reuse_pair(engine_dir: str, runtime, log_dir: Optional[Path] = None) -> Iterator[dict[str, object]]:
    """The engine served twice, with prefix reuse on and off (tritonserver + the OpenAI frontend each) -> an `openai`
    client per server."""
    import openai

    from ..runtime.distributed import free_port
    from ..serving.launcher import TritonServer
    from .harness import SERVER_READY_TIMEOUT_S
    from ..serving.openai_api.process import OpenAIFrontend
    from ..serving.repo import make_repo

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="trt-redrafter-bench-reuse-") as tmp:
        clients = {}
        for server in REUSE:
            repo = Path(tmp) / server
            make_repo(engine_dir, repo, runtime=runtime.replace(kv_cache_reuse=server == "reuse"))
            log = (log_dir / f"tritonserver-{server}.log") if log_dir else None
            triton = stack.enter_context(TritonServer(repo, grpc_port=free_port(), http_port=free_port(),
                                                      metrics_port=free_port(), log_path=log,
                                                      ready_timeout=SERVER_READY_TIMEOUT_S))
            api = stack.enter_context(OpenAIFrontend(repo, triton.grpc_url, free_port(), model_name=MODEL))
            clients[server] = openai.OpenAI(base_url=api.url, api_key="none", max_retries=0, timeout=600)
        yield clients


def _stats(ts: list[Turn]) -> dict:
    """Requests, median TTFT and TPOT, and the share of their prompt tokens that came from the cache."""
    return {"requests": len(ts), "ttft_ms": median([t.ttft_ms for t in ts]), "tpot_ms": median([t.tpot_ms for t in ts]),
            "cached_share": sum(t.cached_tokens for t in ts) / max(1, sum(t.prompt_tokens for t in ts))}


def _same_texts(turns: list[Turn]) -> bool:
    """Whether every request's text is the same on both servers."""
    texts: dict[tuple[str, str], set[str]] = {}
    for t in turns:
        texts.setdefault((t.mode, t.key), set()).add(t.text)
    return all(len(v) == 1 for v in texts.values())


def summarize_conversations(turns: list[Turn], modes: list[str]) -> dict:
    """Per mode and turn: median TTFT / TPOT and the cached share of prompt tokens, per server; the turn-2 TTFT ratio
    reuse / no-reuse (median of the per-conversation ratios); whether the texts agree between the servers."""
    rows, ratios = [], {}
    for mode in modes:
        for turn in ("turn1", "turn2"):
            for server in REUSE:
                ts = [t for t in turns if t.mode == mode and t.server == server and t.key.endswith(turn)]
                rows.append({"mode": mode, "turn": turn, "server": server, **_stats(ts)})
        on = {t.key: t for t in turns if t.mode == mode and t.server == "reuse"}
        off = {t.key: t for t in turns if t.mode == mode and t.server == "no-reuse"}
        ratios[mode] = median([on[k].ttft_ms / off[k].ttft_ms for k in on if k.endswith("turn2") and k in off])
    return {"rows": rows, "turn2_ttft_ratio": ratios, "identical_outputs": _same_texts(turns)}


def summarize_shared(runs: dict[tuple[str, str], tuple[list[Turn], float]]) -> dict:
    """Per (mode, server): requests/s, median TTFT and TPOT, cached share; the throughput ratio reuse / no-reuse."""
    rows = [{"mode": mode, "server": server, "wall_s": wall, "req_per_s": len(ts) / wall, **_stats(ts)}
            for (mode, server), (ts, wall) in runs.items()]
    modes = sorted({m for m, _ in runs})
    speedup = {m: runs[(m, "no-reuse")][1] / runs[(m, "reuse")][1] for m in modes
               if (m, "reuse") in runs and (m, "no-reuse") in runs}
    return {"rows": rows, "throughput_ratio": speedup,
            "identical_outputs": _same_texts([t for ts, _ in runs.values() for t in ts])}


def markdown(doc: dict) -> str:
    """The run's tables."""
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    out = []
    if "conversation" in doc:
        c = doc["conversation"]
        out += ["### MT-Bench two-turn conversations", "",
                "| mode | turn | server | requests | TTFT ms | TPOT ms | cached share |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['mode']} | {r['turn']} | {r['server']} | {r['requests']} | {f(r['ttft_ms'])} | "
                f"{f(r['tpot_ms'])} | {f(100 * r['cached_share'], 0)}% |" for r in c["rows"]]
        out += ["", "Turn-2 TTFT, reuse / no reuse (median of per-conversation ratios): " +
                ", ".join(f"{m} {f(x, 3)}" for m, x in c["turn2_ttft_ratio"].items()) +
                f". Outputs identical with and without reuse: {'yes' if c['identical_outputs'] else 'NO'}.", ""]
    if "shared_prefix" in doc:
        s = doc["shared_prefix"]
        out += ["### Shared system prompt", "",
                "| mode | server | requests | req/s | TTFT ms | TPOT ms | cached share |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['mode']} | {r['server']} | {r['requests']} | {f(r['req_per_s'], 3)} | {f(r['ttft_ms'])} | "
                f"{f(r['tpot_ms'])} | {f(100 * r['cached_share'], 0)}% |" for r in s["rows"]]
        out += ["", "Request throughput, reuse / no reuse: " +
                ", ".join(f"{m} {f(x, 2)}x" for m, x in s["throughput_ratio"].items()) +
                f". Outputs identical with and without reuse: {'yes' if s['identical_outputs'] else 'NO'}.", ""]
    return "\n".join(out)


def turns_to_dicts(turns: list[Turn]) -> list[dict]:
    return [asdict(t) for t in turns]
