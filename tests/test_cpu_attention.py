"""The CPU tree attention kernel (trt_redrafter/cpu/attention.cpp, RuntimeConfig.kernels "cpu"): against its oracle
`torch_tree_attention` on random paged caches and trees, a query row's bits independent of how many new tokens share
the step, the refusals, and on tiny engines greedy ReDrafter == AR with it (eager; compiled: test_cpu_linear.py) and
AR with it == AR with the PyTorch attention.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine_utils import OracleProposer, build_tiny_engines, greedy, load_engine, random_prompts
from trt_redrafter import cpu
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.errors import UserError
from trt_redrafter.model.attention import AttentionMeta, cpu_tree_attention, torch_tree_attention
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.step import move_kv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_NEW = 24
PROMPT_LENS = [5, 11, 3, 8, 14]


def _need(dtype: torch.dtype) -> None:
    if not cpu.available(dtype):
        pytest.skip(f"this CPU has no AVX-512 for {dtype}")
    cpu.ops()  # on such a CPU the kernels must build: a failure here is a failure


def _case(g, dtype, bs, T, nh, nkv, D, block_size, ctx, nblk):
    """Random caches, a shuffled block table per request, a random tree (ancestors + itself) per request."""
    num_blocks = bs * nblk + 3
    kc = torch.randn(num_blocks * block_size, nkv, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks * block_size, nkv, D, generator=g).to(dtype)
    q = (2 * torch.randn(bs, T, nh, D, generator=g)).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:bs * nblk].view(bs, nblk)
    ctx_len = torch.tensor(ctx)
    tree = (torch.rand(bs, T, T, generator=g) < 0.5).tril() | torch.eye(T, dtype=torch.bool)[None]
    pos = ctx_len[:, None] + torch.arange(T)[None]
    meta = AttentionMeta(positions=pos, write_slots=pos.clone(), block_table=table, ctx_len=ctx_len, tree_mask=tree,
                         block_size=block_size)
    return q, kc, vc, meta


CASES = [  # bs, T, nh, nkv, D, block_size, ctx_len per request, blocks per request
    (1, 1, 9, 3, 64, 64, [250], 5),  # SmolLM2's AR step
    (1, 5, 9, 3, 64, 64, [130], 3),  # its 1 x 4 tree
    (2, 9, 4, 2, 16, 16, [30, 7], 3),  # the tiny engines' heads; a request shorter than its neighbour
    (3, 7, 8, 8, 128, 16, [0, 5, 40], 4),  # no committed keys (a prompt step), MHA, D = 128
    (2, 3, 6, 2, 48, 8, [17, 33], 5),
]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[f"bs{c[0]}-T{c[1]}-D{c[4]}" for c in CASES])
def test_cpu_tree_attention_matches_the_oracle(dtype, case):
    dt = DTYPES[dtype]
    _need(dt)
    q, kc, vc, meta = _case(torch.Generator().manual_seed(7), dt, *case)
    scale = case[4] ** -0.5
    ref = torch_tree_attention(q, kc, vc, meta.for_torch(), scale)
    out = cpu_tree_attention(q, kc, vc, meta, scale)
    assert out.shape == q.shape and out.dtype == dt
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_rows_attention_does_not_depend_on_the_tokens_beside_it(dtype):
    """Each row of a causal chain of T new tokens is bitwise the row computed with those tokens fed one per step (T =
    1 after the previous ones were committed), and the root of a tree is bitwise the AR step's token."""
    dt = DTYPES[dtype]
    _need(dt)
    g = torch.Generator().manual_seed(3)
    T, ctx = 6, 40
    q, kc, vc, meta = _case(g, dt, 1, T, 9, 3, 64, 16, [ctx], 4)
    meta.tree_mask = torch.ones(1, T, T, dtype=torch.bool).tril()[None][0]
    together = cpu_tree_attention(q, kc, vc, meta, 0.125)
    for t in range(T):
        one = AttentionMeta(positions=meta.positions[:, t:t + 1], write_slots=meta.write_slots[:, t:t + 1],
                            block_table=meta.block_table, ctx_len=torch.tensor([ctx + t]),
                            tree_mask=torch.ones(1, 1, 1, dtype=torch.bool), block_size=16)
        alone = cpu_tree_attention(q[:, t:t + 1].contiguous(), kc, vc, one, 0.125)
        assert torch.equal(alone[:, 0], together[:, t]), t


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_rows_attention_does_not_depend_on_how_the_threads_split_the_rows(dtype):
    """The kernel gives each thread the rows of one KV head and a run of new tokens, split as far as the threads need
    work: 1 thread, 2 or 4 split a 9-token tree of two requests differently, and every row keeps its bits."""
    dt = DTYPES[dtype]
    _need(dt)
    q, kc, vc, meta = _case(torch.Generator().manual_seed(5), dt, 2, 9, 9, 3, 64, 16, [70, 23], 6)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs.append(cpu_tree_attention(q, kc, vc, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_refusals():
    _need(torch.float32)
    q, kc, vc, meta = _case(torch.Generator().manual_seed(1), torch.float32, 1, 2, 4, 2, 16, 16, [10], 1)
    with pytest.raises(RuntimeError, match="block table covers 16 positions"):
        cpu_tree_attention(q, kc, vc, AttentionMeta(**{**meta.__dict__, "ctx_len": torch.tensor([15])}), 0.25)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_tree_attention(q.double(), kc, vc, meta, 0.25)
    q8, kc8, vc8, meta8 = _case(torch.Generator().manual_seed(1), torch.float32, 1, 2, 4, 2, 8, 16, [10], 1)
    with pytest.raises(RuntimeError, match="head size 8 is not a multiple of 16"):
        cpu_tree_attention(q8, kc8, vc8, meta8, 0.25)
    with pytest.raises(UserError, match=r"runtime.kernels: expected one of auto, triton, cpu, torch, got 'cuda'"):
        RuntimeConfig.from_dict({"kernels": "cuda"})


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_kv_move_is_the_oracles_rewind_bit_for_bit(dtype):
    """The eager step's one-call KV rewind (attention.cpp: kv_move) against runtime.step.move_kv: paths whose rows
    move onto each other (a source that is another row's destination), rows that stay, a request whose path is its
    root alone; and a row outside the cache refused."""
    dt = DTYPES[dtype]
    _need(dt)
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(64, 3, 16, generator=g).to(dt) for _ in range(7)]
    src = torch.tensor([[10, 12, 13, 15], [40, 41, 41, 41], [20, 20, 20, 20]])
    dst = torch.tensor([[10, 11, 12, 13], [40, 41, 42, 43], [20, 21, 22, 23]])
    want = [c.clone() for c in caches]
    move_kv(want, src, dst)
    got = [c.clone() for c in caches]
    cpu.kv_move(got, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0][11], caches[0][11]) and torch.equal(got[0][11], caches[0][12])
    with pytest.raises(RuntimeError, match="outside a cache of 64 rows"):
        cpu.kv_move(got, torch.tensor([[64]]), torch.tensor([[0]]))


def test_a_build_lock_left_by_a_killed_build_is_cleared():
    """torch's build lock file, left by a process killed mid-build, would make every later load wait forever."""
    _need(torch.float32)
    build_dir = cpu._build_dir()
    stale = os.path.join(build_dir, "lock")
    open(stale, "w").close()
    with cpu._exclusive(build_dir):
        assert not os.path.exists(stale)


@pytest.mark.parametrize("where", ["environment", "venv"])
def test_every_process_builds_with_the_declared_ninja(tmp_path, where):
    """Loading the kernels runs the `ninja` package's binary whatever ninja PATH finds first: two ninja versions hash
    the build's commands differently, so processes with different PATHs (a server's rank 0 and its mpirun ranks)
    rebuilt the kernels in turn, ~20 s each. Here PATH's ninja is one that records its call and fails. Also from a
    virtualenv that sees this environment's packages (ci/transformers4.sh's), where the package's BIN_DIR is empty."""
    _need(torch.float32)
    python = sys.executable
    if where == "venv":
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(tmp_path / "venv")],
                       check=True)
        python = str(tmp_path / "venv" / "bin" / "python")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'called'}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    code = "import trt_redrafter.cpu as c; c.ops(); import shutil; print(shutil.which('ninja'))"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(fake / "ninja")  # PATH is the caller's again after the load
    assert not (tmp_path / "called").exists(), (tmp_path / "called").read_text()


# ---- engines ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(DTYPES))
def tiny(request, tmp_path_factory):
    _need(DTYPES[request.param])
    _, engines = build_tiny_engines(tmp_path_factory.mktemp(f"cpu-attn-{request.param}"), seed=43, num_beams=4,
                                    draft_len=3, dtype=request.param, kv_block_size=16, num_heads=4, num_kv_heads=2)
    engine_dir = engines[1]
    prompts = random_prompts(384, PROMPT_LENS, seed=43)
    ar = {k: [r.output_ids for r in generate(load_engine(engine_dir, kernels=k), prompts, greedy(MAX_NEW), "ar")]
          for k in ("cpu", "torch")}
    return dict(dtype=request.param, engine_dir=engine_dir, prompts=prompts, ar=ar)


def test_engine_uses_the_cpu_attention(tiny):
    engine = load_engine(tiny["engine_dir"])  # auto
    assert engine.kernels == "cpu" and engine.model.attention_impl is cpu_tree_attention
    assert load_engine(tiny["engine_dir"], kernels="torch").model.attention_impl is torch_tree_attention


def test_the_cpu_step_rewinds_in_one_call(tiny):
    """The CPU kernels' step rewinds with kv_move, eager and compiled (the greedy == AR tests below run it eager,
    test_cpu_linear's and test_compile's compiled); with the PyTorch kernels the step keeps the PyTorch rewind."""
    assert load_engine(tiny["engine_dir"], kernels="cpu").steps.kernels.move_kv is cpu.kv_move
    assert load_engine(tiny["engine_dir"], kernels="torch").steps.kernels.move_kv is move_kv
    from trt_redrafter.runtime.loading import plug_kernels
    engine = load_engine(tiny["engine_dir"], kernels="cpu")
    assert plug_kernels("cpu", engine.model, engine.cache, "inductor")[0].move_kv is cpu.kv_move


def test_cpu_attention_ar_matches_torch_attention_ar(tiny):
    """fp32: the same tokens (bf16 rounds the attention output otherwise than SDPA now and then)."""
    if tiny["dtype"] == "float32":
        assert tiny["ar"]["cpu"] == tiny["ar"]["torch"]
    else:
        same = sum(a == b for a, b in zip(tiny["ar"]["cpu"], tiny["ar"]["torch"]))
        assert same >= len(tiny["prompts"]) - 2


@pytest.mark.parametrize("corrupt_every", [None, 0, 2])
def test_greedy_redrafter_equals_ar_with_the_cpu_attention(tiny, corrupt_every):
    """The engine's own drafter (None), and an oracle drafter forcing long (0) and partial (2) acceptances: accepted
    tokens' K/V and logits come from tree steps of up to 13 tokens, AR's from one-token steps."""
    ar = tiny["ar"]["cpu"]
    proposer = None if corrupt_every is None else \
        OracleProposer(tiny["engine_dir"], dict(enumerate(ar)), corrupt_every=corrupt_every)
    res = generate(load_engine(tiny["engine_dir"], proposer, kernels="cpu"), tiny["prompts"], greedy(MAX_NEW),
                   "redrafter")
    assert [r.output_ids for r in res] == ar
    if corrupt_every == 0:
        assert min(r.tokens_per_step for r in res) > 1.5


# inductor around the kernel (an external op in the graph): test_cpu_linear.py's compiled tests, whose engines run
# this attention (kernels auto on the CPU), float32 and bfloat16.
