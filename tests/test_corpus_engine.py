"""The distillation corpus written by the project's own engine (training/generation.py): the hidden states its decode
step hands back, its tokens against HF `generate`'s, and the evaluation set kept out of it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from trt_redrafter.training import corpus as cm
from trt_redrafter.training import generation

PROMPTS = [[1, 50, 60, 70, 80, 90], [1, 33], [1, 200, 201, 202], [1, 7, 8], [1, 99, 98, 97, 96]]


@pytest.fixture(scope="module")
def base(make_tiny_pair) -> Path:
    return make_tiny_pair() / "base"


@pytest.fixture(scope="module")
def hf(base):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


def _engine_shards(base: Path, dtype: str, prompts, max_new: int, stop, batch: int = 2, tmp=None):
    g = generation.EngineGenerator(base, dtype, torch.device("cpu"), batch, 16, max_new, threads=1, work=tmp,
                                   compile="off")
    try:
        shard = lambda i: prompts[i * batch:(i + 1) * batch]  # noqa: E731
        n = -(-len(prompts) // batch)
        return dict(g.shards(list(range(n)), shard, max_new, stop, 0)), g
    finally:
        g.close()


@pytest.mark.parametrize("stop", [None, "eos"])
def test_engine_hidden_states_equal_a_separate_forward_fp32(base, hf, tmp_path, stop):
    """fp32: every hidden state the generating step handed back (prompt step, then AR steps, rows admitted in flight
    into freed slots of a batch of 2) equals the base's final-norm hidden state at that position in one separate
    forward over the finished row, and every target is the base's argmax there."""
    stop_ids = None if stop is None else [int(hf.config.eos_token_id or 2), 65, 97]
    shards, _ = _engine_shards(base, "float32", PROMPTS, 10, stop_ids, tmp=tmp_path)
    assert sorted(shards) == [0, 1, 2]
    for i, sh in shards.items():
        for r, p in enumerate(PROMPTS[2 * i:2 * i + 2]):
            n, first = int(sh.length[r]), int(sh.first[r])
            assert first == len(p) - 1 and sh.tokens[r, :len(p)].tolist() == p
            with torch.no_grad():
                hs = hf.model(input_ids=sh.tokens[r:r + 1, :n]).last_hidden_state[0]
            got, want = sh.hidden[r, first:n - 1], hs[first:n - 1]
            # the engine's GEMMs (avx512 / oneDNN) and HF's round differently: float32 rounding, no more
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            assert sh.targets[r, first:n - 1].tolist() == hf.lm_head(want).argmax(-1).tolist()
            assert int(sh.targets[r, n - 1]) == -100 and not sh.hidden[r, n - 1:].any()
            if stop_ids is None:
                assert n == len(p) + 10
            else:
                ans = sh.tokens[r, len(p):n].tolist()
                assert n == len(p) + 10 or (ans[-1] in stop_ids and not set(ans[:-1]) & set(stop_ids))


def test_engine_hidden_states_bf16_within_the_dtypes_error(base, hf, tmp_path):
    """bfloat16: the handed-back hidden states are the bf16 base's, within bf16's error of the fp32 forward over the
    same tokens (relative to each state's size)."""
    shards, _ = _engine_shards(base, "bfloat16", PROMPTS[:2], 8, None, tmp=tmp_path)
    sh = shards[0]
    for r, p in enumerate(PROMPTS[:2]):
        n, first = int(sh.length[r]), int(sh.first[r])
        with torch.no_grad():
            want = hf.model(input_ids=sh.tokens[r:r + 1, :n]).last_hidden_state[0, first:n - 1]
        got = sh.hidden[r, first:n - 1]
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
        assert rel < 0.05, rel  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding, through a few layers
        assert not torch.equal(got, want)  # it really ran in bf16


def test_a_bf16_corpus_is_stored_in_bf16_exactly_and_trains_in_fp32(base, tmp_path):
    """A bf16 base's hidden states are bf16 values: the shard keeps them in bf16 (half the bytes of fp32, nothing
    lost: the engine's own slot-state values come back bit for bit), an fp32 base's stay fp32, and `gather` hands
    the trainer float32 either way."""
    sizes = {}
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        shards, _ = _engine_shards(base, dtype, PROMPTS[:2], 8, None, tmp=tmp_path)
        sh = shards[0]
        assert sh.hidden.dtype == want
        corpus = cm.ShardedCorpus(tmp_path / dtype, {"dtype": dtype}, 1, [2])
        corpus.write(0, sh)
        back = corpus.load(0)
        assert back.hidden.dtype == want and torch.equal(back.hidden, sh.hidden)
        sizes[dtype] = corpus.shard_path(0).stat().st_size
        pos = torch.cat([torch.zeros(len(sh.positions()), 1, dtype=torch.long), sh.positions()], 1)
        h, e, y = cm.gather([back], pos, 2, torch.randn(1000, sh.hidden.shape[-1]), torch.device("cpu"))
        assert h.dtype == torch.float32
        assert torch.equal(h, back.hidden[pos[:, 1], pos[:, 2]].float())
    hidden_bytes = sh.hidden.numel() * 4
    assert sizes["float32"] - sizes["bfloat16"] == pytest.approx(hidden_bytes / 2, abs=256)


def test_engine_corpus_has_the_tokens_of_hf_generate(base, hf, tmp_path):
    """Greedy fp32: the engine's corpus (in-flight batch of 2 over 5 rows) and HF `generate`'s (one left-padded batch
    per shard) hold the same rows token for token, with the same targets and drafting positions."""
    stop = [int(hf.config.eos_token_id or 2), 65, 97]
    for stop_ids in (None, stop):
        shards, _ = _engine_shards(base, "float32", PROMPTS, 12, stop_ids, tmp=tmp_path)
        hf_gen = generation.HFGenerator(hf, torch.device("cpu"))
        ref = dict(hf_gen.shards([0, 1, 2], lambda i: PROMPTS[2 * i:2 * i + 2], 12, stop_ids, 0))
        for i in range(3):
            a, b = shards[i], ref[i]
            assert torch.equal(a.length, b.length) and torch.equal(a.first, b.first)
            for r in range(len(a.length)):
                n = int(a.length[r])
                assert a.tokens[r, :n].tolist() == b.tokens[r, :n].tolist()
                assert a.targets[r, :n].tolist() == b.targets[r, :n].tolist()
            assert torch.equal(a.positions(), b.positions())


def test_engine_corpus_is_resumable_and_trains(base, tmp_path, capsys):
    """train-drafter with the engine (the default): an interrupted corpus (one shard removed) is completed to the
    same bytes, and the corpus spec names its generator, so an HF-made corpus is not mixed in."""
    from trt_redrafter.cli import main as cli

    fast = ["--steps", "4", "--num-sequences", "6", "--eval-sequences", "2", "--seq-len", "8", "--batch-size", "16",
            "--gen-batch-size", "2", "--prompt-min", "4", "--prompt-max", "8", "--device", "cpu", "--threads", "1",
            "--exit-dim", "128"]
    work = tmp_path / "w"
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "a"), "--work-dir", str(work),
                *fast]) == 0
    manifest = json.loads((work / "corpus" / "train" / "manifest.json").read_text())
    assert manifest["spec"]["generator"] == "engine" and manifest["spec"]["generate_dtype"] == "float32"
    shard1 = work / "corpus" / "train" / "shard-00001.safetensors"
    before = shard1.read_bytes()
    shard1.unlink()
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "b"), "--work-dir", str(work),
                *fast]) == 0
    assert shard1.read_bytes() == before
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "c"), "--work-dir", str(work),
                "--generator", "hf", *fast]) != 0
    assert "generator: 'engine' there, 'hf' now" in capsys.readouterr().err


def _mt_bench_turns() -> list[str]:
    from trt_redrafter.datasets import mt_bench_path

    return [t for line in mt_bench_path().read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]


def test_mt_bench_never_enters_a_corpus_from_a_prompts_file(base, tmp_path, caplog):
    """--prompts with every MT-Bench first turn mixed into other prompts: the corpus (train and held-out) holds none
    of them, and the log says how many were left out."""
    from transformers import AutoTokenizer

    from trt_redrafter.cli import main as cli

    mt = _mt_bench_turns()[::2]  # the first turns
    mine = [f"Tell me about the number {i} and why it matters to people who count things." for i in range(8)]
    rows = [{"prompt": p} for pair in zip(mine, mt[:8]) for p in pair] + [{"turns": [q]} for q in mt[8:]]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    work = tmp_path / "w"
    logging.getLogger("trt_redrafter").addHandler(caplog.handler)  # the package's logger does not propagate
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "d"), "--work-dir", str(work),
                "--prompts", str(tmp_path / "p.jsonl"), "--steps", "2", "--num-sequences", "8", "--eval-sequences",
                "2", "--seq-len", "4", "--batch-size", "8", "--gen-batch-size", "4", "--device", "cpu", "--threads",
                "1", "--exit-dim", "128"]) == 0
    assert f"left out {len(mt)} conversation(s) that ask mt-bench questions" in caplog.text
    logging.getLogger("trt_redrafter").removeHandler(caplog.handler)
    tok = AutoTokenizer.from_pretrained(str(base))
    texts = []
    for split in ("train", "held-out"):
        corpus = cm.ShardedCorpus(work / "corpus" / split, json.loads(
            (work / "corpus" / split / "manifest.json").read_text())["spec"], 1 if split == "held-out" else 2)
        for i in range(corpus.num_shards):
            sh = corpus.load(i)
            texts += [tok.decode(sh.tokens[r, :int(sh.first[r]) + 1]) for r in range(len(sh.length))]
    assert len(texts) == len(mine)  # 6 trained on, 2 held out: all of ours, none of MT-Bench's
    words = lambda t: " ".join(t.lower().split())  # noqa: E731
    assert not any(words(q)[:60] in words(t) for q in mt for t in texts)
    assert all(any(words(m) in words(t) for m in mine) for t in texts)


def test_magpie_draws_again_when_the_scripted_sampler_writes_an_mt_bench_question(base, tmp_path):
    """Magpie's filter with a scripted sampler (a stand-in for a base that recites MT-Bench, which no tiny model
    does): a user prompt that is an MT-Bench turn, or contains one, is refused and drawn again; others pass."""
    from transformers import AutoTokenizer

    from trt_redrafter.training.prompts import EvalGuard, magpie_user_prompts

    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    mt = _mt_bench_turns()
    script = [mt[3], "Please, " + mt[40].lower() + " Thanks!", "How do birds find their way home in the winter?",
              "What is a good name for a small brown dog?", mt[77], "Why is the sky blue during the day?"]
    calls = []

    def sample(prompts, max_new, temperature, top_p, seed, stop):
        calls.append(len(prompts))
        out = [tok.encode(t, add_special_tokens=False) for t in script[:len(prompts)]]
        del script[:len(prompts)]
        return out

    got = magpie_user_prompts(sample, tok, 3, seed=0, guard=EvalGuard.mt_bench())
    assert [g.split()[0] for g in got] == ["How", "What", "Why"], got
    assert len(calls) == 2  # the first draw kept one of its five; the second, asked for more, the other two


def test_an_interrupted_runs_engine_directory_is_removed(tmp_path):
    """The corpus engine lives in WORK/generator-PID-*; a later run removes those of processes that no longer run
    (a killed run's, hundreds of MB each) and leaves a running one's alone."""
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    dead = tmp_path / f"generator-{gone.pid}-abc"
    alive = tmp_path / f"generator-{os.getpid()}-def"
    for d in (dead, alive):
        (d / "engine").mkdir(parents=True)
    generation._remove_stale(tmp_path)
    assert not dead.exists() and alive.exists()
