"""Tensor parallelism under real `mpirun`: TP=2 and TP=4 give the same tokens as TP=1; a dead rank ends the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_utils import build_small_engine, build_tiny_engines, decode_tp, random_prompts, run_json
from trt_redrafter.runtime.graphs import tree_buckets

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("tp"), seed=5, num_beams=4, draft_len=3, tps=(1, 2, 4),
                                    num_heads=4, num_kv_heads=2, rnn=True, vocab_size=512)
    return engines


PROMPTS = random_prompts(512, [4, 9, 6], seed=3)
REPEATED = [(PROMPTS[0] * 4)[:14], *PROMPTS[1:]]  # repeated text: context matches, long acceptances
SAMPLED = {"temperature": 0.8, "top_k": 50, "seed": 123}
WIDTHS = [*map(str, tree_buckets(1 + 4 * 3)), "auto"]
# what each TP size decodes, in one engine load per size (tp_driver.py): name -> run
RUNS = {
    "redrafter": {"prompts": PROMPTS},
    "ar": {"prompts": PROMPTS, "mode": "ar"},
    "ngram": {"prompts": REPEATED, "proposer": "ngram"},
    "mixed": {"prompts": REPEATED, "proposer": "mixed"},
    "ar-repeated": {"prompts": REPEATED, "mode": "ar"},
    **{f"width-{w}": {"prompts": PROMPTS, "speculate": w} for w in WIDTHS},
    "ar-sampled": {"prompts": PROMPTS, "mode": "ar", "sampling": SAMPLED},
    **{f"sampled-width-{w}": {"prompts": PROMPTS, "speculate": w, "sampling": SAMPLED} for w in ("2", "auto")},
    "redrafter-sampled": {"prompts": random_prompts(512, [5, 7], seed=4), "sampling": SAMPLED},
    **{f"beams-{k}": {"prompts": PROMPTS, "draft_beams": k} for k in (1, 2)},
    "sampled-beams-1": {"prompts": PROMPTS, "draft_beams": 1, "sampling": SAMPLED},
    "beams-auto": {"prompts": PROMPTS, "speculate": "auto", "draft_beams": "auto"},
    **{f"depth-{d}": {"prompts": PROMPTS, "draft_depth": d, "draft_beams": k} for d, k in ((1, "all"), (2, 2))},
    "sampled-depth-1": {"prompts": PROMPTS, "draft_depth": 1, "sampling": SAMPLED},
    "depth-auto": {"prompts": PROMPTS, "speculate": "auto", "draft_beams": "auto", "draft_depth": "auto"},
}
TP4_RUNS = ("redrafter", "ar")


@pytest.fixture(scope="module")
def decoded(engines, tmp_path_factory):
    """Every run at TP 1 and 2, and the TP4_RUNS at TP 4: three engine loads, two mpirun launches."""
    tmp = tmp_path_factory.mktemp("runs")
    return {1: decode_tp(engines[1], RUNS, 1, tmp), 2: decode_tp(engines[2], RUNS, 2, tmp),
            4: decode_tp(engines[4], {n: RUNS[n] for n in TP4_RUNS}, 4, tmp)}


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
@pytest.mark.parametrize("mode", ["redrafter", "ar"])
def test_tp_ranks_give_the_tp1_tokens(decoded, mode):
    for tp in (2, 4):
        assert decoded[tp][mode]["output_ids"] == decoded[1][mode]["output_ids"], f"tp={tp} {mode} differs from tp=1"
    assert decoded[1]["redrafter"]["output_ids"] == decoded[1]["ar"]["output_ids"]
    if mode == "redrafter":  # trees were drafted and verified on every rank
        assert all(n > 0 for tp in (2, 4) for n in decoded[tp][mode]["draft_tokens"])


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
@pytest.mark.parametrize("proposer", ["ngram", "mixed"])
def test_tp2_ngram_and_mixed_trees_give_the_tp1_tokens(decoded, proposer):
    tp2 = decoded[2][proposer]
    assert tp2["output_ids"] == decoded[1]["ar-repeated"]["output_ids"]
    assert tp2["accepted_draft_tokens"][0] > 0, tp2  # the repeated prompt's matches were drafted and accepted
    assert tp2 == decoded[1][proposer]  # and the same ones as at TP 1


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles on both ranks at once: minutes on 2 shared cores
def test_tp2_compiled_gives_the_tp1_tokens(tmp_path_factory, monkeypatch):
    """The compiled step under real ranks (inductor): TP=2 compiled == TP=1. On the CPU the gloo collectives split
    the graph instead of being traced into it (model/tp.py: traced, they corrupted the heap in about one run in five),
    so none of the kernels inductor wrote beside the engine, one directory per rank, calls a functional collective.
    One decoder layer (each layer's collectives are the same ones) and one tree width (pruned: fewer nodes than the
    tree): the ranks compile each graph piece between collectives, and with every width and the policy's cost model
    (`test_tp2_every_tree_width_and_the_policy_give_the_tp1_ar_tokens`, eager) this test took 4 minutes. One batch
    bucket (max batch size 1: the prompts run one after the other): the ranks compile the AR step and the mixed
    proposer's two tree steps once, where buckets 1 and 2 compiled each tree step twice (warm-up 130 s against 72 s
    here). Batches of several requests at TP 2 are the eager tests' (`decoded`), compiled ones TP 1's."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the engine's own cache: the user set none
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("tp-compiled"), seed=5, num_beams=4, draft_len=3,
                                    tps=(1, 2), num_heads=4, num_kv_heads=2, rnn=True, vocab_size=512, num_layers=1,
                                    max_batch_size=1)
    a, b = random_prompts(512, [4, 9], seed=8)
    prompts = [a * 3, b]  # repeated text: the mixed trees' n-gram beams are accepted (the random drafter's are not)
    from engine_utils import greedy, load_engine
    from trt_redrafter.runtime.generate import generate

    ref = [r.output_ids for r in generate(load_engine(engines[1]), prompts, greedy(20), "ar")]  # eager, TP=1
    err: list[str] = []
    docs = run_json(engines[2], prompts, "redrafter",
                    ["--compile", "inductor", "--speculate", "5", "--proposer", "mixed"], full=True, stderr=err)
    assert [d["output_ids"] for d in docs] == ref
    # every collective runs outside the graphs by design (model/tp.py), none by dynamo giving up inside one
    assert "Dynamo does not know how to trace" not in err[0], err[0][-2000:]
    assert sum(d["draft_tokens"] for d in docs) > 0 and sum(d["accepted_draft_tokens"] for d in docs) > 0
    for rank in range(2):
        kept = list((engines[2] / ".cache" / "inductor").glob(f"kernels-*/rank{rank}"))  # keep_inductor_cache
        code = [f.read_text() for d in kept for f in d.rglob("*.py")]
        # a compiled graph's module: Python's wrapper defines call(), the C++ wrapper (the CPU's) inductor_entry_impl
        assert any("def call(" in c or "inductor_entry_impl" in c for c in code), \
            f"rank {rank} kept no compiled graph beside the engine"
        assert not [c for c in code if "_c10d_functional" in c], f"rank {rank}: a collective traced into a graph"


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
def test_tp2_every_tree_width_and_the_policy_give_the_tp1_ar_tokens(decoded):
    """Every width the speculation policy can choose (`--speculate N`) and the policy itself (`auto`: rank 0 decides
    and broadcasts), greedy and sampled, at TP=2: AR's tokens at TP=1."""
    for width in WIDTHS:
        assert decoded[2][f"width-{width}"]["output_ids"] == decoded[1]["ar"]["output_ids"], width
    for width in ("2", "auto"):
        assert decoded[2][f"sampled-width-{width}"]["output_ids"] == decoded[1]["ar-sampled"]["output_ids"], width
    assert len({tuple(o) for o in decoded[1]["ar-sampled"]["output_ids"]}) > 1  # really sampled


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
def test_tp2_every_beam_count_gives_the_tp1_ar_tokens(decoded):
    """Drafting fewer beams (`--draft-beams N`, and `auto`: rank 0's policy chooses; its step plans carry the count),
    greedy and sampled, at TP=2:
    AR's tokens at TP=1, and the same trees as at TP=1 (drafted and verified alike)."""
    for k in (1, 2):
        run = decoded[2][f"beams-{k}"]
        assert run["output_ids"] == decoded[1]["ar"]["output_ids"], k
        assert run == decoded[1][f"beams-{k}"] and all(n > 0 for n in run["draft_tokens"]), k
    assert decoded[2]["sampled-beams-1"]["output_ids"] == decoded[1]["ar-sampled"]["output_ids"]
    assert decoded[2]["beams-auto"]["output_ids"] == decoded[1]["ar"]["output_ids"]  # the policy choosing counts


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
def test_tp2_every_draft_depth_gives_the_tp1_ar_tokens(decoded):
    """Drafting less deep (`--draft-depth N`, with every beam and with 2; and `auto`: rank 0's policy chooses depth
    and beams; its step plans carry them), greedy and sampled, at TP=2, where the sharded drafter's layers gather
    zero rows past the depth: AR's tokens at TP=1, and the same trees as at TP=1 (drafted and verified alike), never
    verified deeper than the depth (the first tree, drafted after the prompt, aside: 3 deep)."""
    if "unavailable" in decoded[1]["depth-1"]:  # TP 1 on an AVX-512 CPU: the fused search drafts every depth
        pytest.skip(decoded[1]["depth-1"]["unavailable"])
    for d in (1, 2):
        run = decoded[2][f"depth-{d}"]
        assert run["output_ids"] == decoded[1]["ar"]["output_ids"], d
        assert run == decoded[1][f"depth-{d}"] and all(n > 0 for n in run["draft_tokens"]), d
        assert all(n <= d * steps + 3 - d for n, steps in zip(run["draft_tokens"], run["steps"])), d
    assert decoded[2]["sampled-depth-1"]["output_ids"] == decoded[1]["ar-sampled"]["output_ids"]
    assert decoded[2]["depth-auto"]["output_ids"] == decoded[1]["ar"]["output_ids"]  # the policy choosing depths


@pytest.mark.core  # one engine load per TP size for all of them (the `decoded` fixture)
def test_tp_sampled_output_is_reproducible_across_tp(decoded):
    assert decoded[2]["redrafter-sampled"] == decoded[1]["redrafter-sampled"]


def test_an_idle_tp_server_keeps_its_ranks_past_the_collective_timeout(engines):
    """The driver's heartbeats keep the follower's pending broadcast alive while no request arrives."""
    from trt_redrafter.runtime.distributed import mpirun_prefix

    prompt = random_prompts(512, [5], seed=6)[0]
    ids = ",".join(map(str, prompt))
    cmd = mpirun_prefix(2, "the test") + [sys.executable, str(Path(__file__).with_name("tp_idle_driver.py")),
                                          str(engines[2]), ids]
    env = {**os.environ, "TRT_REDRAFTER_COLLECTIVE_TIMEOUT": "4"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from engine_utils import greedy, load_engine
    from trt_redrafter.runtime.generate import generate

    expected = generate(load_engine(engines[1]), [prompt], greedy(12))[0].output_ids
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


def test_a_dead_rank_ends_the_job_within_seconds(engines):
    prompts = random_prompts(512, [6] * 4, seed=9)
    from trt_redrafter.runtime.distributed import mpirun_command

    argv = ["run", "--engine", str(engines[2]), "--json", "--ignore-eos", "--max-tokens", "130",
            "--prompt-ids", *[",".join(map(str, p)) for p in prompts] * 40]
    proc = subprocess.Popen(mpirun_command(2, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        ranks = _wait_for_children(proc.pid, 2, timeout=60)
        time.sleep(8)  # past start-up, inside the decode loop
        assert proc.poll() is None, "the run finished before a rank could be killed; make it longer"
        os.kill(ranks[-1], signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0
    assert elapsed < 15, f"survivors took {elapsed:.1f}s to exit"


def _wait_for_children(pid: int, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-P", str(pid), "-f", "trt_redrafter"], capture_output=True, text=True).stdout
        kids = [int(x) for x in out.split()]
        if len(kids) >= n:
            return sorted(kids)
        time.sleep(0.2)
    raise AssertionError(f"mpirun did not start {n} ranks in {timeout}s")


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "models/small/drafter/model.safetensors").is_file(),
                    reason="models/small not trained")
def test_tp2_draft_vocabulary_drafter_gives_the_tp1_tokens_and_steps(tmp_path):
    """A drafter with a draft vocabulary (its head split across ranks, `draft_vocab` on each): TP=2 drafts what
    TP=1 drafts (same text, same tokens/step)."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    import torch

    from test_draft_vocab import _with_draft_vocab

    drafter = _with_draft_vocab(tmp_path / "d", torch.randperm(2048, generator=torch.Generator().manual_seed(0))[:1024])
    engines = {tp: build_small_engine(tmp_path / f"tp{tp}", num_beams=2, draft_len=3, max_batch_size=2,
                                      max_input_len=64, max_seq_len=128, drafter=drafter, tp=tp, tokenizer=False)
               for tp in (1, 2)}
    runs = {"full": {"prompts": [[1, 400, 401, 402, 403, 404, 405], [10, 11, 12, 13, 14, 15, 16, 17]], "max_new": 40}}
    docs = {tp: decode_tp(engines[tp], runs, tp, tmp_path)["full"] for tp in (1, 2)}
    assert docs[2] == docs[1]  # the same tokens, and the same drafts accepted
    assert sum(docs[1]["accepted_draft_tokens"]) > 0


def test_tp2_replicated_drafter_gives_the_tp1_tokens_and_steps(tmp_path):
    """A TP size that does not divide the drafter (vocabulary 511 here; SmolLM2's exit_dim 512 at TP=3): `convert`
    gives every rank the whole drafter (draft TP 1), flags it in config.json, and each rank runs it alone; the
    tokens and tokens/step are TP=1's, and TensorRT-LLM's build is refused."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    from safetensors.torch import load_file

    from trt_redrafter.backends.trtllm import check_buildable
    from trt_redrafter.checkpoint.trtllm_config import REPLICATED_KEY, parse_checkpoint_config
    from trt_redrafter.config import BuildConfig
    from trt_redrafter.errors import UserError

    _, engines = build_tiny_engines(tmp_path, seed=9, num_beams=2, draft_len=3, tps=(1, 2), num_heads=4,
                                    num_kv_heads=2, rnn=True, vocab_size=511)
    config = json.loads((tmp_path / "ckpt-tp2" / "config.json").read_text())
    assert config[REPLICATED_KEY] is True and REPLICATED_KEY not in json.loads(
        (tmp_path / "ckpt-tp1" / "config.json").read_text())
    r0, r1 = (load_file(str(tmp_path / "ckpt-tp2" / f"rank{r}.safetensors")) for r in (0, 1))
    whole = load_file(str(tmp_path / "ckpt-tp1" / "rank0.safetensors"))
    for name in [n for n in whole if n.startswith("drafter.")]:
        assert r0[name].equal(whole[name]) and r1[name].equal(whole[name]), name
    assert r0["transformer.layers.0.mlp.fc.weight"].shape[0] * 2 == whole["transformer.layers.0.mlp.fc.weight"].shape[0]
    runs = {"full": {"prompts": random_prompts(511, [4, 9], seed=2), "max_new": 24}}
    docs = {tp: decode_tp(engines[tp], runs, tp, tmp_path)["full"] for tp in (1, 2)}
    assert docs[2] == docs[1] and all(n > 0 for n in docs[2]["draft_tokens"])
    info = parse_checkpoint_config(config, "ckpt-tp2")
    assert info.drafter.replicated
    with pytest.raises(UserError, match="whole drafter"):
        check_buildable(info, BuildConfig(), tmp_path / "ckpt-tp2")
