"""Run under `mpirun -n TP` (or alone for TP 1): load an engine once and decode a list of runs on it, rank 0 driving
through the scheduler, the other ranks following its step plans (as a TP server's do). Each run says its mode,
proposer, speculation (a fixed width or `auto`: rank 0 decides and its step plans carry the decisions) and sampling.
Rank 0 prints one JSON line per run: every prompt's output ids, accepted and drafted tokens.

    python tests/tp_driver.py ENGINE_DIR RUNS_JSON     RUNS_JSON: a file with a list of runs, each
        {"prompts": [[ids]], "mode": "redrafter" | "ar", "proposer": null | name, "speculate": "full" | "auto" | "N",
         "max_new": 20, "sampling": {SamplingConfig fields but max_tokens}, "max_num_tokens": 0 | the step budget
         (chunked prefill; rank 0's scheduler cuts the prompts, its step plans carry the chunks), "draft_beams": "all" |
         "auto" | N: the beams a drafting step searches (--draft-beams; rank 0's step plans carry the count),
         "draft_depth": "all" | "auto" | N: how deep (--draft-depth; likewise; a depth this rank's steps cannot draft,
         where the fused AVX-512 search drafts at TP 1, prints {"unavailable": why})}
"""

import dataclasses
import json
import sys

from trt_redrafter.checkpoint.engine_config import load_engine_config
from trt_redrafter.config import RuntimeConfig, SamplingConfig, Speculation
from trt_redrafter.runtime.distributed import init_dist, shutdown_dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate, release_followers
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.launch import draft_beam_options, draft_depth_options
from trt_redrafter.runtime.scheduler import follow


def main(engine_dir: str, runs_path: str) -> None:
    runs = json.loads(open(runs_path).read())
    dist = init_dist(load_engine_config(engine_dir).tp_size, "cpu")
    auto = any(r.get("speculate", "full") == "auto" for r in runs)
    # eager, as the tests' TP=1 references run; `auto` measures the cost model at load, on every rank
    engine = Engine.load(engine_dir, dist, RuntimeConfig(device="cpu", compile="off",
                                                         speculate="auto" if auto else "full"))
    if not dist.is_driver:
        follow(engine)
    else:
        for doc in decode_runs(engine, runs):
            print(json.dumps(doc), flush=True)
    shutdown_dist()


def decode_runs(engine: Engine, runs: list[dict]) -> list[dict]:
    """Every run on `engine` (rank 0), then the followers released."""
    out = []
    for run in runs:
        engine.policy.speculation = Speculation.parse(run.get("speculate", "full"))
        engine.policy.beam_options = draft_beam_options(str(run.get("draft_beams", "all")),
                                                        engine.launcher.beam_options, engine.tree.num_beams)
        try:
            engine.policy.depth_options = draft_depth_options(str(run.get("draft_depth", "all")),
                                                              engine.launcher.depth_options,
                                                              engine.tree.draft_len_per_beam)
        except UserError as e:
            out.append({"unavailable": str(e)})
            continue
        engine.runtime = dataclasses.replace(engine.runtime, max_num_tokens=run.get("max_num_tokens", 0))
        params = SamplingConfig(max_tokens=run.get("max_new", 20), **run.get("sampling", {}))
        res = generate(engine, run["prompts"], params, run.get("mode", "redrafter"), proposer=run.get("proposer"),
                       last=False)
        out.append({"output_ids": [r.output_ids for r in res],
                    "accepted_draft_tokens": [r.accepted_draft_tokens for r in res],
                    "draft_tokens": [r.draft_tokens for r in res], "steps": [r.steps for r in res]})
    release_followers(engine)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])
