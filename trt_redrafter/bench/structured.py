"""Structured output, measured: extraction and tool-call tasks with JSON schemas (written for this project), decoded
with constrained AR and constrained ReDrafter on one engine, and by llama.cpp with the same schemas (its GBNF grammar
from the schema), at batch 1, greedy.

Each round runs every task in both engine modes, the order flipped from task to task and round to round, so a shift
in the machine's speed hits both; the ratios to AR are medians of per-task ratios (each task's median over rounds),
with their quartiles. Two speeds per decoder: TPOT (decoding: first token to last over the tokens between, what
bench-engine reports) and end to end (the request's wall time over its output tokens, the prompt step included).
Every output is parsed and validated against its schema (`jsonschema`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .baselines import Baseline, BaselineJob, run_isolated

MAX_STRING = 80  # characters: every free string of a task's schema is bounded, so a document closes within max_tokens


def bounded(schema: dict) -> dict:
    """`schema` with maxLength MAX_STRING on each string that has neither an enum nor a maxLength of its own: a small
    model can repeat itself inside an unbounded string until max_tokens, and no grammar can close it then."""
    if schema.get("type") == "string" and "enum" not in schema and "maxLength" not in schema:
        return {**schema, "maxLength": MAX_STRING}
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k: bounded(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        out["items"] = bounded(schema["items"])
    return out


def _object(**properties: dict) -> dict:
    """A closed object schema: these properties, each required, no other."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _task(name: str, prompt: str, /, **properties: dict) -> dict:
    return {"name": name, "prompt": prompt, "schema": _object(**properties)}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_TASKS: list[dict] = [
    _task("person", "Extract the person as JSON: Maria Lopez, 34, is a nurse in Madrid.",
          name=_STR, age=_INT, job=_STR, city=_STR),
    _task("weather_call", "Call the weather tool for Paris tomorrow, in celsius. Answer with the arguments as JSON.",
          location=_STR, day={"type": "string", "enum": ["today", "tomorrow"]},
          unit={"type": "string", "enum": ["celsius", "fahrenheit"]}),
    _task("invoice", "Turn this into JSON line items: 3 apples at 0.5 each, 2 breads at 2.25 each.",
          items={"type": "array", "maxItems": 4,
                 "items": _object(product=_STR, quantity=_INT, unit_price={"type": "number"})}),
    _task("event", "Extract the event as JSON: The team meeting is on Friday at 10am in room 4.",
          title=_STR, day=_STR, time=_STR, room=_INT),
    _task("sentiment", "Classify the review as JSON with a sentiment and a score from 1 to 5: The soup was cold and "
                       "the waiter was rude.",
          sentiment={"type": "string", "enum": ["positive", "neutral", "negative"]},
          score={"type": "integer", "minimum": 1, "maximum": 5}),
    _task("search_call", "Call the search tool to find vegetarian pasta recipes, at most 5 results. Answer with the "
                         "arguments as JSON.",
          query=_STR, max_results={"type": "integer", "minimum": 1, "maximum": 20}),
    _task("book", "Give the book as JSON: Moby-Dick by Herman Melville, published in 1851.",
          title=_STR, author=_STR, year=_INT),
    _task("address", "Parse the address into JSON: 221B Baker Street, London NW1 6XE, United Kingdom.",
          street=_STR, city=_STR, postcode=_STR, country=_STR),
    _task("email_call", "Call the send_email tool: write to bob@example.com that the report is late. Answer with the "
                        "arguments as JSON.",
          to=_STR, subject=_STR, body=_STR),
    _task("tags", "List three keywords of this sentence as JSON: Solar panels turn sunlight into electricity for "
                  "homes.",
          keywords={"type": "array", "items": _STR, "minItems": 3, "maxItems": 3}),
    _task("flight", "Extract the flight as JSON: Flight AF123 leaves Paris at 08:15 and lands in New York at 10:40.",
          **{"flight": _STR, "from": _STR, "to": _STR, "departure": _STR, "arrival": _STR}),
    _task("calendar_call", "Call the create_event tool for a dentist appointment on 2025-03-14 lasting 30 minutes. "
                           "Answer with the arguments as JSON.",
          title=_STR, date=_STR, duration_minutes=_INT),
]
TASKS = [{**t, "schema": bounded(t["schema"])} for t in _TASKS]


@dataclass
class Run:
    """One task decoded once."""

    task: str
    mode: str  # ar | redrafter | llama.cpp_KIND
    round: int
    text: str
    tokens: int
    seconds: float  # the whole request
    valid: bool
    tpot_ms: float = 0.0  # (last token - first token) / (tokens - 1)
    steps: int = 0
    grammar_ms: float = 0.0  # the host's grammar work (masks, repaired trees) over the request
    error: Optional[str] = None

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / max(self.tokens, 1)


def valid(text: str, schema: dict) -> tuple[bool, Optional[str]]:
    """Whether `text` is a JSON document that validates against `schema`; else why not. Strings may hold raw control
    characters (strict=False): xgrammar's JSON strings admit a tab, as llama.cpp's do."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text, strict=False), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return True, None


def prompt_ids(tokenizer, tasks: list[dict]) -> list[list[int]]:
    """Each task's prompt as one user message in the model's chat template, as token ids."""
    from ..chat import chat_ids

    return [chat_ids(tokenizer, [{"role": "user", "content": t["prompt"]}]) for t in tasks]


def run_engine(engine, tokenizer, tasks: list[dict], rounds: int, max_tokens: int) -> list[Run]:
    """Constrained AR and ReDrafter on every task, `rounds` times, order alternated; one warm-up pass first."""
    from ..config import Guide, GuideType, SamplingConfig
    from ..runtime.generate import generate

    params = SamplingConfig(max_tokens=max_tokens)
    stop = (tokenizer.eos_token_id,)
    ids = prompt_ids(tokenizer, tasks)
    guides = [Guide(GuideType.JSON_SCHEMA, json.dumps(t["schema"])) for t in tasks]
    for mode in ("ar", "redrafter"):  # compiles the grammar variants of the steps
        generate(engine, ids[:1], params, mode, stop, guide=guides[0])
    runs = []
    for r in range(rounds):
        for i, task in enumerate(tasks):
            order = ("ar", "redrafter") if (i + r) % 2 == 0 else ("redrafter", "ar")
            for mode in order:
                before = engine.grammars.seconds
                t0 = time.perf_counter()
                res = generate(engine, [ids[i]], params, mode, stop, guide=guides[i])[0]
                took = time.perf_counter() - t0
                text = tokenizer.decode(res.output_ids, skip_special_tokens=True)
                ok, why = valid(text, task["schema"])
                runs.append(Run(task["name"], mode, r, text, len(res.output_ids), took, ok, res.ms_per_token,
                                res.steps, 1e3 * (engine.grammars.seconds - before), why))
    return runs


def run_llama_cpp(gguf: Path, kind: str, tokenizer, tasks: list[dict], rounds: int, max_tokens: int,
                  threads: int) -> list[Run]:
    """llama.cpp (its own process: a crash costs its row) on the same prompt ids with each task's schema."""
    ids = prompt_ids(tokenizer, tasks)
    job = BaselineJob(ids, max_tokens, rounds, threads)
    name = f"llama.cpp_{kind}"
    [row] = run_isolated(Baseline((name,), f"{__name__}:llama_cpp_child",
                                  {"gguf": str(gguf), "kind": kind, "schemas": [t["schema"] for t in tasks],
                                   "names": [t["name"] for t in tasks]}), job)
    if row.error:
        return [Run(t["name"], name, 0, "", 0, 0.0, False, error=row.error) for t in tasks]
    runs = [Run(**r) for r in row.options["runs"]]
    for run, task in zip(runs, tasks * rounds):
        run.valid, run.error = valid(run.text, task["schema"])
    return runs


def llama_cpp_child(job: BaselineJob, gguf: str, kind: str, schemas: list[dict], names: list[str]) -> list[dict]:
    """(child process) each prompt with its schema's grammar (llama.cpp's JSON-schema converter), greedy."""
    from llama_cpp import Llama, LlamaGrammar

    from .baselines import llama_cpp_file

    path = llama_cpp_file(Path(gguf), kind, job.threads)
    llm = Llama(model_path=str(path), n_ctx=max(map(len, job.prompts)) + job.max_tokens + 8, n_threads=job.threads,
                n_threads_batch=job.threads, n_batch=512, verbose=False)
    grammars = [LlamaGrammar.from_json_schema(json.dumps(s), verbose=False) for s in schemas]
    llm.create_completion(job.prompts[0], max_tokens=4, temperature=0.0, grammar=grammars[0])  # warm-up
    runs = []
    for r in range(job.repeats):
        for name, ids, grammar in zip(names, job.prompts, grammars):
            t0 = time.perf_counter()
            stamps, text = [], ""
            for chunk in llm.create_completion(ids, max_tokens=job.max_tokens, temperature=0.0, top_k=1,
                                               repeat_penalty=1.0, grammar=grammar, stream=True):
                stamps.append(time.perf_counter())  # one chunk per token
                text += chunk["choices"][0]["text"]
            took = time.perf_counter() - t0
            n = len(stamps)
            tpot = 1e3 * (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else 0.0
            runs.append(asdict(Run(name, f"llama.cpp_{kind}", r, text, n, took, False, tpot)))
    return [{"name": f"llama.cpp_{kind}", "file": str(path), "options": {"runs": runs}}]


@dataclass
class Summary:
    """One decoder's figures over the tasks."""

    mode: str
    valid: str  # "n/N" outputs that parse and validate
    tpot_ms: Optional[float]  # median over tasks of each task's median over rounds
    ms_per_token: Optional[float] = None  # end to end, the same way
    tokens_per_step: Optional[float] = None  # tokens decode steps emitted, forced ones included, per step (engine)
    grammar_ms_per_step: Optional[float] = None  # the host's grammar work per step
    vs_ar: Optional[float] = None  # AR's TPOT over this one's: the median of per-task ratios
    vs_ar_quartiles: list = field(default_factory=list)
    vs_ar_end_to_end: Optional[float] = None  # the same with end-to-end ms/token
    same_text_as_ar: Optional[str] = None
    error: Optional[str] = None


def summarize(runs: list[Run]) -> list[Summary]:
    by = {}
    for r in runs:
        by.setdefault(r.mode, {}).setdefault(r.task, []).append(r)
    ar = by.get("ar", {})
    medians = lambda tasks, key: {t: statistics.median(key(x) for x in rs) for t, rs in tasks.items()}  # noqa: E731
    ar_tpot, ar_ms = medians(ar, lambda x: x.tpot_ms), medians(ar, lambda x: x.ms_per_token)
    out = []
    for mode, tasks in by.items():
        flat = [x for rs in tasks.values() for x in rs]
        errors = {x.error for x in flat if x.error and not x.tokens}
        if errors:
            out.append(Summary(mode, f"0/{len(flat)}", None, error=errors.pop()))
            continue
        tpot, ms = medians(tasks, lambda x: x.tpot_ms), medians(tasks, lambda x: x.ms_per_token)
        ratios = sorted(ar_tpot[t] / tpot[t] for t in tpot if t in ar_tpot and tpot[t] > 0)
        steps = sum(x.steps for x in flat)
        s = Summary(mode, f"{sum(x.valid for x in flat)}/{len(flat)}", statistics.median(tpot.values()),
                    statistics.median(ms.values()))
        if steps:
            s.tokens_per_step = sum(x.tokens - 1 for x in flat) / steps  # the prompt step's token is not a step's
            s.grammar_ms_per_step = sum(x.grammar_ms for x in flat) / steps
        if ratios and mode != "ar":
            s.vs_ar = statistics.median(ratios)
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            s.vs_ar_quartiles = [round(q[0], 3), round(q[2], 3)]
            s.vs_ar_end_to_end = statistics.median(ar_ms[t] / ms[t] for t in ms if t in ar_ms)
            same = sum(x.text == y.text for t in tasks for x, y in zip(tasks[t], ar.get(t, [])))
            s.same_text_as_ar = f"{same}/{len(flat)}"
        out.append(s)
    return out


def table(summaries: list[Summary]) -> str:
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    lines = ["| decoder | valid | TPOT ms | x AR (quartiles) | end-to-end ms/token | x AR | tokens/step | "
             "grammar ms/step | same text as AR |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        q = f" ({s.vs_ar_quartiles[0]:.2f}-{s.vs_ar_quartiles[1]:.2f})" if s.vs_ar_quartiles else ""
        lines.append(f"| {s.mode} | {s.valid} | {f(s.tpot_ms, '.2f')} | {f(s.vs_ar, '.2f')}{q} | "
                     f"{f(s.ms_per_token, '.2f')} | {f(s.vs_ar_end_to_end, '.2f')} | {f(s.tokens_per_step, '.2f')} | "
                     f"{f(s.grammar_ms_per_step, '.3f')} | {s.same_text_as_ar or ''} |" + (f" {s.error}" if s.error else ""))
    return "\n".join(lines)
