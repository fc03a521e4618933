"""train-drafter (self-distillation of an Apple-format drafter) and the committed models/small pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_utils import SMALL, build_small_engine
from trt_redrafter.cli import main as cli

# fast settings: a handful of short base-generated sequences, a few optimizer steps
FAST = ["--steps", "12", "--num-sequences", "8", "--eval-sequences", "4", "--seq-len", "12", "--batch-size", "64",
        "--gen-batch-size", "8", "--prompt-min", "8", "--prompt-max", "16", "--lr", "3e-3", "--device", "cpu",
        "--threads", "1", "--exit-dim", "128"]  # 2H of the tiny base: Apple's recipe, no input projection


def _train(base: Path, out: Path, *extra) -> dict:
    rc = cli(["train-drafter", "--base-model", str(base), "--output", str(out), *FAST, *map(str, extra)])
    assert rc == 0
    return json.loads((out / "training.json").read_text())


@pytest.fixture(scope="module")
def trained(make_tiny_pair, tmp_path_factory):
    base = make_tiny_pair() / "base"
    out = tmp_path_factory.mktemp("drafter") / "d"
    return base, out, _train(base, out)


def test_training_lowers_the_loss_on_a_fixed_batch(trained):
    _, _, s = trained
    assert s["probe_loss_end"] < s["probe_loss_start"] - 0.1, s
    assert len(s["held_out"]["top1"]) == 4 and s["data"]["train_positions"] > 0


def test_writes_an_apple_drafter_the_converter_accepts(trained, tmp_path):
    base, out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["rnn"] is True and cfg["num_draft_layers"] == 1
    names = set(load_file(str(out / "model.safetensors")))
    assert names == {"lm_head.0.linear.weight", "lm_head.0.linear.bias", "lm_head.1.weight", "rnn_u.weight",
                     "rnn_u.bias", "rnn_w.weight"}
    assert cli(["convert", "--base-model", str(base), "--drafter", str(out), "--output", str(tmp_path / "ck"),
                "--tp", "1", "--dtype", "float32", "--num-beams", "2", "--draft-len-per-beam", "4"]) == 0


def test_same_seed_same_bytes_and_options_shape_the_drafter(trained, tmp_path):
    base, out, _ = trained
    again = tmp_path / "again"
    _train(base, again)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    other = tmp_path / "proj"
    _train(base, other, "--no-rnn", "--exit-dim", "96", "--num-layers", "2", "--draft-len", "2")
    cfg = json.loads((other / "config.json").read_text())
    assert (cfg["rnn"], cfg["exit_dim"], cfg["num_draft_layers"]) == (False, 96, 2)
    names = set(load_file(str(other / "model.safetensors")))
    assert "input_proj.weight" in names and not any(n.startswith("rnn_") for n in names)


def test_auto_exit_dim_keeps_the_drafter_head_small_next_to_the_base():
    from trt_redrafter.training.config import DrafterTrainConfig
    from trt_redrafter.training.loop import exit_dim_for

    cfg = DrafterTrainConfig(draft_len=4)
    # a 7B-shaped base (H 4096, V 32000): the 2H head is 4% of the base per step, Apple's recipe
    assert exit_dim_for(cfg, 4096, 32000, 6_738_415_616) == 8192
    # models/small (H 128, V 2048, 1.3M parameters): a 2H head would read 1.6x the base per step
    assert exit_dim_for(cfg, 128, 2048, 1_300_000) == 64
    # SmolLM2-135M (H 576, V 49152): a 1152-wide head would read 1.7x the base per step; 128 reads 19%
    e = exit_dim_for(cfg, 576, 49152, 134_515_008)
    assert e == 128 and 4 * e * 49152 <= 0.25 * 134_515_008 < 4 * 2 * e * 49152
    assert exit_dim_for(DrafterTrainConfig(exit_dim=96), 576, 49152, 134_515_008) == 96  # an explicit width wins


def _resume_args(base, out, work, *extra):
    # 4 shards of 2 sequences, 2 in memory at a time, 14 steps: the schedule crosses shard groups and epochs
    args = ["train-drafter", "--base-model", str(base), "--output", str(out), "--work-dir", str(work), *FAST,
            "--num-sequences", "8", "--gen-batch-size", "2", "--shards-in-memory", "2", "--batch-size", "32",
            "--steps", "14", "--save-every", "4", *map(str, extra)]
    return args


def test_resume_continues_to_the_same_bytes_as_an_uninterrupted_run(make_tiny_pair, tmp_path, capsys):
    base = make_tiny_pair() / "base"
    assert cli(_resume_args(base, tmp_path / "whole", tmp_path / "w1")) == 0
    assert cli(_resume_args(base, tmp_path / "cut", tmp_path / "w2", "--stop-after", "6")) == 0
    assert "--resume" in capsys.readouterr().out and not (tmp_path / "cut").exists()
    assert (tmp_path / "w2" / "checkpoint.pt").is_file()
    assert cli(_resume_args(base, tmp_path / "cut", tmp_path / "w2", "--resume")) == 0
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()
    whole = json.loads((tmp_path / "whole" / "training.json").read_text())
    cut = json.loads((tmp_path / "cut" / "training.json").read_text())
    assert cut["held_out"] == whole["held_out"] and cut["final_loss"] == whole["final_loss"]
    assert cut["data"]["corpus_reused"] and not whole["data"]["corpus_reused"]
    # a checkpoint is only resumed with the settings that wrote it
    assert cli(_resume_args(base, tmp_path / "cut2", tmp_path / "w2", "--resume", "--lr", "1e-3")) == 2
    assert "lr: 0.003 then, 0.001 now" in capsys.readouterr().err
    assert cli(_resume_args(base, tmp_path / "o", tmp_path / "nowhere", "--resume")) == 2


def test_the_schedule_streams_a_few_shards_and_visits_every_position_once_per_epoch(tmp_path):
    import torch

    from trt_redrafter.training import corpus as cm

    c = cm.ShardedCorpus(tmp_path, {"t": 1}, 5)
    for i in range(5):  # shard i: 2 rows, lengths 6 and 4+i, first drafting position 2
        length = torch.tensor([6, 4 + i])
        toks = torch.arange(2 * 8).reshape(2, 8) + 100 * i
        c.write(i, cm.Shard(toks, toks, torch.zeros(2, 8, 3), torch.tensor([2, 2]), length))
        c.record({i: cm.num_positions([2, 2], length.tolist())})
    total = c.total_positions
    assert total == sum(3 + (1 + i) for i in range(5))
    loads, peak = [], [0]
    real_load = c.load

    def counting_load(i):
        loads.append(i)
        return real_load(i)
    c.load = counting_load
    batch, seen = 4, []
    for step, loaded, pos in cm.batch_schedule(c, batch, seed=3, group=2):
        peak[0] = max(peak[0], len(loaded))
        assert len(pos) == batch
        seen += [(int(loaded[k].tokens[r, 0]) // 100, r, t) for k, r, t in pos.tolist()]
        if step == 40:
            break
    assert peak[0] <= 2
    # an epoch drops at most batch-1 positions per group of 2 shards (3 groups), so its first 20 are distinct
    assert len(set(seen[:20])) == 20 and all(t >= 2 for _, _, t in seen)
    assert len(set(seen)) == total  # and every position comes
    # resuming at step 30 loads only the shards from there on and yields the same batches
    loads.clear()
    again = [(s, p.tolist()) for s, _, p in _take(cm.batch_schedule(c, batch, 3, 2, start_step=30), 5)]
    assert len(loads) <= 6  # 5 batches span at most 3 groups of 2 shards; replaying steps 0-29 loads ~25
    ref = [(s, p.tolist()) for s, _, p in _take(cm.batch_schedule(c, batch, 3, 2), 35)][30:]
    assert again == ref


def test_shards_in_memory_default_holds_every_shard_that_fits(tmp_path, monkeypatch):
    """--shards-in-memory 0 (the default) holds the whole corpus when a quarter of the memory holds it, else as many
    shards as fit (never none); an explicit count is kept, capped at the corpus; a negative count is refused."""
    import torch

    from trt_redrafter.errors import UserError
    from trt_redrafter.training import corpus as cm
    from trt_redrafter.training import loop
    from trt_redrafter.training.config import DrafterTrainConfig

    c = cm.ShardedCorpus(tmp_path, {"t": 1}, 6)
    for i in range(6):
        toks = torch.arange(16).reshape(2, 8)
        c.write(i, cm.Shard(toks, toks, torch.zeros(2, 8, 64), torch.tensor([2, 2]), torch.tensor([8, 8])))
    per_shard = 2 * max(c.shard_path(i).stat().st_size for i in range(6))
    auto, three = DrafterTrainConfig(), DrafterTrainConfig(shards_in_memory=3)
    assert auto.shards_in_memory == 0
    assert loop.shards_in_memory(auto, c, world=1) == 6
    assert loop.shards_in_memory(three, c, world=1) == 3
    assert loop.shards_in_memory(DrafterTrainConfig(shards_in_memory=50), c, world=1) == 6
    page = 4096
    pages = {"SC_PAGE_SIZE": page, "SC_PHYS_PAGES": loop.MEMORY_SHARE * 4 * per_shard // page + 1}
    monkeypatch.setattr(loop.os, "sysconf", lambda name: pages[name])  # memory for 4 shards in the quarter
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loop.shards_in_memory(auto, c, world=1) == 4
    assert loop.shards_in_memory(auto, c, world=2) == 2  # two processes on the machine share it
    pages["SC_PHYS_PAGES"] = 1
    assert loop.shards_in_memory(auto, c, world=1) == 1
    with pytest.raises(UserError, match="--shards-in-memory"):
        DrafterTrainConfig(shards_in_memory=-1).validate()


def _take(it, n):
    out = []
    for x in it:
        out.append(x)
        if len(out) == n:
            break
    return out


def _chat_base(make_tiny_pair, tmp_path):
    """The tiny base with a ChatML-style chat template on its tokenizer (eos ends a turn)."""
    import shutil

    from transformers import AutoTokenizer

    base = tmp_path / "chat-base"
    shutil.copytree(make_tiny_pair() / "base", base)
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(str(base))
    return base, tok


def _first_shard(work: Path):
    from trt_redrafter.training.corpus import ShardedCorpus

    root = work / "corpus" / "train"
    m = json.loads((root / "manifest.json").read_text())
    return ShardedCorpus(root, m["spec"], m["num_shards"]).load(0)


def test_prompts_from_jsonl_go_through_the_chat_template(make_tiny_pair, tmp_path):
    base, tok = _chat_base(make_tiny_pair, tmp_path)
    rows = [{"prompt": "def add(a, b):"}, {"turns": ["import os", "second turn"]},
            {"messages": [{"role": "user", "content": "for i in range(3):"}, {"role": "assistant", "content": "x"}]},
            {"conversations": [{"from": "human", "value": "class A:"}]}] * 3
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out, work = tmp_path / "d", tmp_path / "w"
    s = _train(base, out, "--prompts", str(data), "--work-dir", str(work), "--eval-sequences", "3")
    # 12 rows: 3 held out, 9 left for training, of which --num-sequences 8 are used
    assert s["data"]["source"] == f"jsonl:{data}" and s["data"]["train_sequences"] == 8
    sh = _first_shard(work)
    wanted = {tuple(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=False, ).encode()) for c in
              ("def add(a, b):", "import os", "for i in range(3):", "class A:")}
    for r in range(len(sh.length)):
        prompt = tok.decode(sh.tokens[r, :int(sh.first[r]) + 1].tolist())
        assert tuple(prompt.encode()) in wanted, prompt
        answer = sh.tokens[r, int(sh.first[r]) + 1:int(sh.length[r])].tolist()
        assert answer and (len(answer) == 12 or answer[-1] == tok.eos_token_id)  # --seq-len 12 or ends at eos
        assert tok.eos_token_id not in answer[:-1]


def test_magpie_prompts_are_written_by_the_base(make_tiny_pair, tmp_path, capsys):
    base, tok = _chat_base(make_tiny_pair, tmp_path)
    s = _train(base, tmp_path / "d", "--magpie", "--work-dir", str(tmp_path / "w"))
    assert s["data"]["source"] == "magpie" and s["data"]["train_positions"] > 0
    prefix = tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False).split("X")[0]
    sh = _first_shard(tmp_path / "w")
    texts = {tok.decode(sh.tokens[r, :int(sh.first[r]) + 1].tolist()) for r in range(len(sh.length))}
    assert all(t.startswith(prefix) and t.endswith("<|assistant|>") for t in texts)
    assert len(texts) == len(sh.length)  # distinct user prompts
    plain = make_tiny_pair() / "base"  # no chat template: refused with what to do instead
    assert cli(["train-drafter", "--base-model", str(plain), "--output", str(tmp_path / "x"), "--magpie",
                *FAST]) == 2
    assert "chat template" in capsys.readouterr().err


def test_refusals(make_tiny_pair, tmp_path, capsys):
    base = make_tiny_pair() / "base"
    assert cli(["train-drafter", "--base-model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "exists").mkdir()
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "exists")]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "o"), "--steps", "0"]) == 2
    for bad, named in ((["--soft-targets", "1.5"], "--soft-targets"), (["--weight-decay", "-1"], "--weight-decay")):
        capsys.readouterr()
        assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "o"), *bad]) == 2
        assert named in capsys.readouterr().err


HELD_OUT_PROMPT = '''def dedent(text):
    """Remove any common leading whitespace from every line in `text`.
'''


@pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(), reason="models/small not trained")
def test_committed_small_pair_accepts_drafts_and_matches_ar(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trt_redrafter.config import SamplingConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.config import RuntimeConfig
    from trt_redrafter.runtime.engine import Engine
    from trt_redrafter.runtime.generate import generate

    AutoModelForCausalLM.from_pretrained(str(SMALL / "base"))  # loads with plain transformers
    en = build_small_engine(tmp_path, num_beams=4, draft_len=4, max_batch_size=2, max_input_len=128, max_seq_len=256)
    prompt = AutoTokenizer.from_pretrained(str(SMALL / "base"))(HELD_OUT_PROMPT)["input_ids"]
    engine = Engine.load(en, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off", speculate="full"))
    params = SamplingConfig(max_tokens=64)
    (rd,) = generate(engine, [prompt], params, mode="redrafter")
    (ar,) = generate(engine, [prompt], params, mode="ar")
    assert rd.output_ids == ar.output_ids
    assert rd.tokens_per_step > 1.5, rd.tokens_per_step


@pytest.mark.slow
def test_torchrun_two_processes_train_like_one(make_tiny_pair, tmp_path):
    """Real torchrun, two CPU processes (gloo): each generates half of the corpus shards and trains on its half of
    every batch (DDP averages the gradients), so the result is the one-process run's up to the loss weighting of
    ignored targets and float order."""
    import os
    import shutil
    import subprocess

    import torch

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH (it comes with torch)")
    base = make_tiny_pair() / "base"
    args = ["--base-model", str(base), *FAST, "--num-sequences", "8", "--gen-batch-size", "2", "--batch-size", "64"]
    one = _train(base, tmp_path / "one", "--work-dir", tmp_path / "w1", "--num-sequences", "8", "--gen-batch-size",
                 "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "trt_redrafter.cli",
                        "train-drafter", *args, "--output", str(tmp_path / "two"), "--work-dir", str(tmp_path / "w2")],
                       env=env, capture_output=True, text=True, timeout=600)
    # each rank's traceback is prefixed "[rankN]:"; the first exception is what failed
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("[rank") or "Error" in ln]
    assert r.returncode == 0, "\n".join(errors[:40]) or r.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "training.json").read_text())
    assert two["processes"] == 2 and one["processes"] == 1
    # both processes generated shards: the corpus is the one-process corpus, shard for shard
    for i in range(4):
        a = load_file(str(tmp_path / "w1" / "corpus" / "train" / f"shard-{i:05d}.safetensors"))
        b = load_file(str(tmp_path / "w2" / "corpus" / "train" / f"shard-{i:05d}.safetensors"))
        assert torch.equal(a["tokens"], b["tokens"]) and torch.allclose(a["hidden"], b["hidden"], atol=1e-5)
    assert two["data"]["train_positions"] == one["data"]["train_positions"]
    wa, wb = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    moved = sum(float((wa[k] - wb[k]).abs().max()) for k in wa) / len(wa)
    # measured: 8e-4 apart (held-out loss 6e-5 relative); without DDP's gradient averaging (each process on its
    # half batch) 7e-3 (0.5%)
    assert moved < 3e-3, moved
    assert abs(two["held_out"]["loss"] - one["held_out"]["loss"]) < 0.002 * one["held_out"]["loss"]


def test_corpus_hidden_states_and_targets_are_the_bases_own(make_tiny_pair):
    """The hidden states captured during generation (ragged, left-padded prompts, rows ending at eos) equal one
    full forward of each row alone, and each target is the base's argmax there."""
    import torch
    from transformers import AutoModelForCausalLM

    from trt_redrafter.training.corpus import generate_shard

    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_pair() / "base"), dtype=torch.float32).eval()
    prompts = [[1, 50, 60, 70, 80, 90], [1, 33], [1, 200, 201, 202]]
    for stop in (None, [int(model.config.eos_token_id or 2), 65, 97]):
        sh = generate_shard(model, prompts, 10, stop, 0, torch.device("cpu"))
        for r, p in enumerate(prompts):
            n = int(sh.length[r])
            assert sh.tokens[r, :len(p)].tolist() == p and int(sh.first[r]) == len(p) - 1
            with torch.no_grad():
                hs = model.model(input_ids=sh.tokens[r:r + 1, :n]).last_hidden_state[0]
                g = model.lm_head(hs).argmax(-1)
            torch.testing.assert_close(sh.hidden[r, :n - 1], hs[:n - 1], atol=1e-5, rtol=1e-5)
            assert sh.targets[r, len(p) - 1:n - 1].tolist() == g[len(p) - 1:n - 1].tolist()
            assert int(sh.targets[r, n - 1]) == -100
            if stop is None:
                assert n == len(p) + 10
            else:
                ans = sh.tokens[r, len(p):n].tolist()
                assert n == len(p) + 10 or ans[-1] in stop and not set(ans[:-1]) & set(stop)


def test_the_corpus_grows_and_shrinks_reusing_its_shards(make_tiny_pair, tmp_path):
    base = make_tiny_pair() / "base"
    work = tmp_path / "w"
    shard = str(work / "corpus" / "train" / "shard-{:05d}.safetensors")
    small = ("--gen-batch-size", "2", "--batch-size", "32")
    _train(base, tmp_path / "a", "--work-dir", work, "--num-sequences", "5", *small)  # shards of 2, 2 and 1
    made = {i: (shard.format(i), Path(shard.format(i)).stat().st_mtime_ns) for i in range(3)}
    s = _train(base, tmp_path / "b", "--work-dir", work, "--num-sequences", "8", *small)
    assert Path(made[0][0]).stat().st_mtime_ns == made[0][1] and Path(made[1][0]).stat().st_mtime_ns == made[1][1]
    assert Path(made[2][0]).stat().st_mtime_ns != made[2][1]  # the partial last shard is made again, whole
    assert len(load_file(made[2][0])["length"]) == 2 and s["data"]["train_sequences"] == 8
    fresh = _train(base, tmp_path / "c", "--work-dir", tmp_path / "w2", "--num-sequences", "8", *small)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "c" / "model.safetensors").read_bytes()
    assert fresh["held_out"] == s["held_out"]


def _open_corpus_repeatedly(root: str, times: int) -> None:
    from trt_redrafter.training.corpus import ShardedCorpus

    for _ in range(times):
        ShardedCorpus(root, {"seq_len": 8}, 4)


def test_ranks_open_the_same_corpus_at_once(tmp_path):
    """Every torchrun rank opens the corpus and writes its manifest; two processes doing so 300 times each at once
    must not collide on a temporary file (with one shared name a rank's os.replace failed within a few hundred)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_open_corpus_repeatedly, args=(str(tmp_path / "corpus"), 300)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.loads((tmp_path / "corpus" / "manifest.json").read_text())["num_shards"] == 4
    assert not list((tmp_path / "corpus").glob("*.tmp"))


def test_soft_targets_are_the_bases_distribution_after_each_drafted_token(make_tiny_pair):
    """--soft-targets: gather's teacher hidden state for step i is the base's at the position whose argmax is step
    i's target (so its softmax is the distribution the greedy target was taken from), and the loss mixes the two
    cross-entropies by the weight (draft vocabulary rows included)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from trt_redrafter.training import corpus as cm
    from trt_redrafter.model.drafter import Drafter
    from trt_redrafter.training.loop import head_targets, loss_and_hits

    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_pair() / "base"), dtype=torch.float32).eval()
    sh = cm.generate_shard(model, [[1, 50, 60, 70], [1, 33], [1, 200, 201, 202, 203]], 12, None, 0,
                           torch.device("cpu"))
    T = 4
    pos = torch.cat([torch.zeros(len(sh.positions()), 1, dtype=torch.long), sh.positions()], 1)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    h, e, y, th = cm.gather([sh], pos, T, embed, torch.device("cpu"), teacher=True)
    ok = y != -100
    assert th.shape == (len(pos), T, h.shape[1]) and ok.sum() > 20 and not ok.all()
    assert torch.equal((th @ head.T).argmax(-1)[ok], y[ok])  # each step's teacher predicts that step's target
    assert torch.equal(th[:, 0], cm.gather([sh], pos + torch.tensor([0, 0, 1]), T, embed, torch.device("cpu"))[0])

    V = head.shape[0]
    torch.manual_seed(0)
    vocab = torch.randperm(V)[:V // 2].sort().values
    vocab = torch.unique(torch.cat([vocab, y[ok][: len(y[ok]) // 2]]))  # some targets inside, some outside
    lookup = torch.full((V,), -100, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    d = Drafter(h.shape[1], V, 96, 1, True, vocab)
    with torch.no_grad():
        for p_ in d.parameters():
            p_.normal_(0, 0.05)
        logp = F.log_softmax(d(h, e).float(), -1)
        rows = head_targets(y, lookup)
        p = torch.softmax(th @ head[vocab].T, -1)
        for w in (0.0, 0.3, 1.0):
            want = 0.0
            for i in range(T):
                k = rows[:, i] != -100
                hard = -logp[:, i][k].gather(1, rows[:, i][k][:, None]).sum()
                soft = -(p[:, i][k] * logp[:, i][k]).sum()
                want += ((1 - w) * hard + w * soft) / int(k.sum())
            got = loss_and_hits(d, h, e, y, lookup, (th, head[vocab]), w)[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(loss_and_hits(d, h, e, y, lookup, (th, head[vocab]), 1.0)[0],
                                  loss_and_hits(d, h, e, y, lookup)[0])


@pytest.mark.skipif(not (SMALL / "base" / "model.safetensors").is_file(), reason="models/small not trained")
def test_training_on_soft_targets_lowers_the_loss_and_resumes_only_with_them(make_tiny_pair, tmp_path, capsys):
    # a trained base (a random one's distributions are near uniform: nothing to learn from them)
    s = _train(SMALL / "base", tmp_path / "kd", "--soft-targets", "1", "--work-dir", tmp_path / "w")
    assert s["probe_loss_end"] < s["probe_loss_start"] - 1.0, s  # the probe's loss is the hard one
    assert s["config"]["soft_targets"] == 1.0
    hard = _train(SMALL / "base", tmp_path / "hard", "--work-dir", tmp_path / "w")  # same corpus, seed and steps
    assert (hard["first_loss"], hard["final_loss"]) != (s["first_loss"], s["final_loss"])  # the loop used them
    base = make_tiny_pair() / "base"
    assert cli(_resume_args(base, tmp_path / "cut", tmp_path / "w2", "--soft-targets", "0.5",
                            "--stop-after", "4")) == 0
    assert cli(_resume_args(base, tmp_path / "cut", tmp_path / "w2", "--resume")) == 2
    assert "soft_targets: 0.5 then, None now" in capsys.readouterr().err


@pytest.mark.parametrize("rnn,exit_dim,vocab", [(True, 96, True), (False, 64, False)])
def test_the_trainable_drafter_and_the_engines_drafter_rank_compute_one_head(tmp_path, rnn, exit_dim, vocab):
    """model.drafter.Drafter (what train-drafter optimises and writes, Apple names) and DrafterRank (what the engine
    runs, read back through the checkpoint reader and sharding at TP 1): the same states and logits, step after
    step, with and without rnn, input projection and draft vocabulary."""
    from safetensors.torch import save_file

    from trt_redrafter.checkpoint import sharding
    from trt_redrafter.checkpoint.drafter import read_drafter
    from trt_redrafter.model.drafter import Drafter, DrafterRank
    from trt_redrafter.model.tp import Dist
    from trt_redrafter.training.loop import drafter_config_json

    torch.manual_seed(0)
    H, V = 32, 50
    draft_vocab = torch.tensor([1, 4, 9, 16, 25, 36, 49]) if vocab else None
    d = Drafter(H, V, exit_dim, 2, rnn, draft_vocab)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.2)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(drafter_config_json(d)))
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(tmp_path / "d" / "model.safetensors"))
    ckpt = read_drafter(tmp_path / "d")
    tensors = sharding.shard_drafter(ckpt.tensors, ckpt.config, sharding.Mapping(1, 0), lambda t: t.float())
    rank = DrafterRank(ckpt.config, tensors, Dist(0, 1, torch.device("cpu")), torch.float32)
    h, embs = torch.randn(3, H), torch.randn(3, 4, H)
    ref = d(h, embs)  # [3, 4, head rows]
    state = rank.init_state(3)
    for i in range(4):
        state = rank.update_state(embs[:, i], state, i)
        torch.testing.assert_close(rank.head_logits(h, state), ref[:, i], rtol=1e-5, atol=1e-5)


def test_a_drafter_for_a_qwen2_base_trains_converts_and_decodes_like_ar(make_tiny_pair, tmp_path):
    """train-drafter on a Qwen2 base (q/k/v biases) with Qwen's ChatML chat template and a draft vocabulary taken from
    the base's own answers: the drafter converts into a ReDrafterForQWenLM checkpoint whose engine's greedy
    ReDrafter output is its AR output, with drafts accepted."""
    import shutil

    from transformers import AutoTokenizer

    from engine_utils import greedy, load_engine
    from trt_redrafter.runtime.generate import generate

    base = tmp_path / "qwen-base"
    shutil.copytree(make_tiny_pair(family="qwen2") / "base", base)
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(str(base))
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "import os", "class A:",
                                                                    "for i in range(3):"] * 4))
    out, work = tmp_path / "d", tmp_path / "w"
    s = _train(base, out, "--prompts", data, "--work-dir", work, "--draft-vocab", "64", "--steps", "40")
    assert s["probe_loss_end"] < s["probe_loss_start"]
    sh = _first_shard(work)
    assert tok.decode(sh.tokens[0, :int(sh.first[0]) + 1].tolist()).startswith("<|im_start|>user\n")
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 64
    ck, en = tmp_path / "ck", tmp_path / "en"
    assert cli(["convert", "--base-model", str(base), "--drafter", str(out), "--output", str(ck), "--dtype",
                "float32", "--num-beams", "2", "--draft-len-per-beam", "3"]) == 0
    assert json.loads((ck / "config.json").read_text())["architecture"] == "ReDrafterForQWenLM"
    assert cli(["build-engine", "--checkpoint", str(ck), "--output", str(en), "--max-batch-size", "2",
                "--max-input-len", "64", "--max-seq-len", "128"]) == 0
    engine = load_engine(en)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for c in ("def add(a, b):", "class A:")]
    ar = [r.output_ids for r in generate(engine, prompts, greedy(24), "ar")]
    rd = generate(engine, prompts, greedy(24), "redrafter")
    assert [r.output_ids for r in rd] == ar
    assert sum(r.accepted_draft_tokens for r in rd) > 0, [r.tokens_per_step for r in rd]
