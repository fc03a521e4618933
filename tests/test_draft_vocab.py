"""A drafter with a frequency-ranked draft vocabulary (FR-Spec; `train-drafter --draft-vocab K`): the format, the
runtime's mapping of head rows to token ids, exact outputs, training, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_utils import SMALL, build_small_engine
from trt_redrafter.cli import main as cli
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate

PROMPT = "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.\n"
needs_small = pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(),
                                 reason="models/small not trained")


def _with_draft_vocab(out: Path, ids: torch.Tensor) -> Path:
    """models/small's drafter, its head cut to the rows of `ids` (in that order) with `draft_vocab` = ids."""
    shutil.copytree(SMALL / "drafter", out)
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    t["lm_head.1.weight"] = t["lm_head.1.weight"][ids % 2048].contiguous()  # (% V: rows for an out-of-range id)
    t["draft_vocab"] = ids.to(torch.int64)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": len(ids)}))
    return out


def _engine(drafter: Path, tmp: Path, name: str, dtype: str = "float32") -> Engine:
    en = build_small_engine(tmp / name, num_beams=4, draft_len=4, max_batch_size=2, max_input_len=128, max_seq_len=256,
                            drafter=drafter, dtype=dtype)
    return Engine.load(en, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off", speculate="full", drafter_dtype="float32"))


def _prompt() -> list[int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SMALL / "base"))(PROMPT)["input_ids"]


@needs_small
def test_a_permuted_full_draft_vocabulary_drafts_exactly_the_same_beams(tmp_path):
    """Every token, head rows shuffled: if the runtime maps row -> token id right, nothing changes (same text,
    same number of steps); a wrong mapping drafts other tokens and loses acceptance."""
    V = 2048
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    plain = _engine(SMALL / "drafter", tmp_path, "plain")
    permuted = _engine(_with_draft_vocab(tmp_path / "perm", perm), tmp_path, "perm")
    h = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    s = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(permuted.drafter.logits(h, s), plain.drafter.logits(h, s))
    params = SamplingConfig(max_tokens=48)
    (a,) = generate(plain, [_prompt()], params, mode="redrafter")
    (b,) = generate(permuted, [_prompt()], params, mode="redrafter")
    assert b.output_ids == a.output_ids and b.tokens_per_step == a.tokens_per_step > 1.5


@needs_small
def test_a_draft_subset_drafts_only_its_tokens_and_output_equals_ar(tmp_path):
    ids = torch.arange(0, 2048, 3)  # a third of the vocabulary, not the frequent one: drafts rarely right
    engine = _engine(_with_draft_vocab(tmp_path / "sub", ids), tmp_path, "sub")
    d = engine.drafter
    logits = d.logits(torch.randn(2, 128), torch.randn(2, 128))
    outside = torch.ones(2048, dtype=torch.bool)
    outside[ids] = False
    assert (logits[:, outside] <= -5e4 + 1).all() and (logits[:, ids] > -1e3).all()
    params = SamplingConfig(max_tokens=48)
    (rd,) = generate(engine, [_prompt()], params, mode="redrafter")
    (ar,) = generate(engine, [_prompt()], params, mode="ar")
    assert rd.output_ids == ar.output_ids


@needs_small
def test_a_bfloat16_engine_keeps_the_draft_vocabulary_ids(tmp_path):
    """build-engine casts the weights to the engine's dtype, never the token ids: bfloat16 holds integers above 256
    only to a spacing (8 between 1024 and 2048), so a cast id table repeats ids. Such an engine is refused."""
    ids = torch.arange(1, 2048, 3)
    engine = _engine(_with_draft_vocab(tmp_path / "sub", ids), tmp_path, "bf16", dtype="bfloat16")
    rank0 = engine.engine_dir / "rank0.safetensors"
    stored = load_file(str(rank0))
    assert stored["drafter.draft_vocab"].dtype == torch.int64 and torch.equal(stored["drafter.draft_vocab"], ids)
    assert stored["drafter.lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(engine.drafter.draft_vocab, ids)
    params = SamplingConfig(max_tokens=32)
    (rd,) = generate(engine, [_prompt()], params, mode="redrafter")
    (ar,) = generate(engine, [_prompt()], params, mode="ar")
    assert rd.output_ids == ar.output_ids
    save_file({**stored, "drafter.draft_vocab": ids.bfloat16()}, str(rank0))  # what build-engine wrote before
    with pytest.raises(UserError, match="stored as torch.bfloat16.*Rebuild the engine"):
        Engine.load(engine.engine_dir, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off"))


@needs_small
def test_tp2_checkpoint_replicates_the_draft_vocabulary_and_splits_the_head(tmp_path):
    from trt_redrafter.checkpoint.convert import read_rank_files

    ids = torch.arange(0, 2048, 2)
    drafter = _with_draft_vocab(tmp_path / "d", ids)
    ck = tmp_path / "ck2"
    assert cli(["convert", "--base-model", str(SMALL / "base"), "--drafter", str(drafter), "--output", str(ck),
                "--tp", "2", "--dtype", "float32", "--num-beams", "2", "--draft-len-per-beam", "3"]) == 0
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["redrafter_draft_vocab_size"] == 1024
    r0, r1 = read_rank_files(ck, 2)
    assert torch.equal(r0["drafter.draft_vocab"], ids) and torch.equal(r1["drafter.draft_vocab"], ids)
    head = load_file(str(drafter / "model.safetensors"))["lm_head.1.weight"]
    assert torch.equal(torch.cat([r0["drafter.lm_head.weight"], r1["drafter.lm_head.weight"]]), head)


@needs_small
def test_refusals_name_what_is_wrong(tmp_path):
    from trt_redrafter.backends.trtllm import check_buildable
    from trt_redrafter.checkpoint.drafter import read_drafter
    from trt_redrafter.backends.torch_build import check_checkpoint
    from trt_redrafter.config import BuildConfig

    bad = _with_draft_vocab(tmp_path / "dup", torch.tensor([5, 5] + list(range(10, 72))))
    with pytest.raises(UserError, match="repeats token ids"):
        read_drafter(bad)
    oob = _with_draft_vocab(tmp_path / "oob", torch.arange(2000, 2064) % 2100)
    with pytest.raises(UserError, match="outside the vocabulary"):
        read_drafter(oob)
    stray = tmp_path / "stray"
    _with_draft_vocab(stray, torch.arange(64))
    cfg = json.loads((stray / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (stray / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="draft_vocab tensor is stored but config.json has no draft_vocab_size"):
        read_drafter(stray)
    # TensorRT-LLM cannot run it: refused before tensorrt_llm is imported (no TensorRT-LLM needed here)
    ok = _with_draft_vocab(tmp_path / "ok", torch.arange(64))
    ck = tmp_path / "ck"
    assert cli(["convert", "--base-model", str(SMALL / "base"), "--drafter", str(ok), "--output", str(ck),
                "--tp", "1", "--dtype", "float32", "--num-beams", "2", "--draft-len-per-beam", "3"]) == 0
    info = check_checkpoint(ck, None)
    with pytest.raises(UserError, match="TensorRT-LLM's ReDrafter cannot run"):
        check_buildable(info, BuildConfig(), ck)
    # a draft vocabulary --tp does not divide: the drafter is replicated (warned, flagged), and TensorRT-LLM,
    # which splits the head without padding, refuses the checkpoint
    odd = _with_draft_vocab(tmp_path / "odd", torch.arange(65))
    assert cli(["convert", "--base-model", str(SMALL / "base"), "--drafter", str(odd), "--output",
                str(tmp_path / "ck-odd"), "--tp", "2", "--dtype", "float32"]) == 0
    cfg = json.loads((tmp_path / "ck-odd" / "config.json").read_text())
    assert cfg["redrafter_drafter_replicated"] is True
    with pytest.raises(UserError, match="TensorRT-LLM"):
        check_buildable(check_checkpoint(tmp_path / "ck-odd", None), BuildConfig(), tmp_path / "ck-odd")


def test_train_drafter_with_a_draft_vocabulary(make_tiny_pair, tmp_path):
    from trt_redrafter.checkpoint.drafter import read_drafter

    base = make_tiny_pair() / "base"
    out = tmp_path / "d"
    fast = ["--steps", "12", "--num-sequences", "8", "--eval-sequences", "4", "--seq-len", "12", "--batch-size",
            "64", "--gen-batch-size", "8", "--prompt-min", "8", "--prompt-max", "16", "--lr", "3e-3", "--device",
            "cpu", "--threads", "1", "--exit-dim", "128"]
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(out), *fast, "--draft-vocab", "64"]) == 0
    s = json.loads((out / "training.json").read_text())
    assert s["draft_vocab"]["size"] == 64 and 0 < s["draft_vocab"]["coverage"]["train"] <= 1
    assert s["probe_loss_end"] < s["probe_loss_start"] - 0.1, s
    d = read_drafter(out)
    assert d.config.draft_vocab_size == 64 and d.tensors["lm_head.1.weight"].shape[0] == 64
    ids = d.tensors["draft_vocab"]
    assert ids.dtype == torch.int64 and torch.equal(ids, ids.sort().values)
    # the draft vocabulary is the most frequent generated tokens of the corpus: recount them from its shards
    from trt_redrafter.training import corpus as corpus_mod
    from trt_redrafter.training.sources import generated_targets

    root = tmp_path / "d.work" / "corpus" / "train"
    manifest = json.loads((root / corpus_mod.MANIFEST).read_text())
    corpus = corpus_mod.ShardedCorpus(root, manifest["spec"], manifest["num_shards"])
    counts = torch.zeros(d.config.vocab_size, dtype=torch.long)
    for i in range(corpus.num_shards):
        counts += torch.bincount(generated_targets(corpus.load(i)), minlength=d.config.vocab_size)
    outside = ~torch.isin(torch.arange(len(counts)), ids)
    assert counts[ids].min() >= counts[outside].max() and counts[ids].sum() > 0
    # the held-out accuracy counts targets outside the draft vocabulary as misses (never above coverage)
    assert s["held_out"]["top1"][0] <= s["draft_vocab"]["coverage"]["held_out"] + 1e-6
    # --draft-vocab must be 0 or >= 64, and below the vocabulary
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "x"), *fast,
                "--draft-vocab", "8"]) == 2


@needs_small
def test_sampled_exact_acceptance_with_a_draft_subset_follows_the_ar_distribution(tmp_path):
    """Sampling (top-k 3, T=1, the `exact` rule) through the drafter's own drafts from a half vocabulary: the
    first two tokens follow the AR joint distribution (chi-square), and drafts are really accepted."""
    from test_engine_sampling import N, _pvalue, _target

    drafter = _with_draft_vocab(tmp_path / "half", torch.arange(0, 2048, 2))
    en = build_small_engine(tmp_path, num_beams=3, draft_len=2, max_batch_size=32, max_input_len=64, max_seq_len=160,
                            drafter=drafter, tokenizer=False)
    prompt = [1, 321, 530, 265, 11]  # "def main(" in models/small's tokenizer
    probs, joint = _target(SMALL / "base", prompt)
    p, accepted = _pvalue(en, probs, joint, proposer="redrafter", prompt=prompt)
    assert accepted > N // 4, accepted  # 1575 measured: the drafts are taken often
    assert p > 1e-3, p
