"""The compiled step (torch.compile / inductor on the CPU): the same tokens as the eager step and as AR, greedy and
sampled, and no recompilation across the steps of a request once the engine has warmed up."""

from __future__ import annotations

import pytest
import torch

from engine_utils import build_tiny_engines, greedy, hf_greedy, load_engine, random_prompts, record_tree_steps
from trt_redrafter.config import SamplingConfig, Speculation
from trt_redrafter.runtime.generate import generate

# inductor compiles C++ on first use (a minute on 2 cores); core (every test but the host-composed trees', whose
# variants are graphs of their own, also compiled at TP 2 in test_tp.py): the CPU default (`--compile auto` at TP 1)
# is inductor, so the fast tier runs its parity
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
core = pytest.mark.core

PROMPT_LENS = [5, 11, 3, 8, 14]  # more prompts than max_batch_size=4: batches of 4 and 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("compiled"), seed=31, num_beams=4, draft_len=3,
                                       kv_block_size=16, num_heads=4, num_kv_heads=2)
    prompts = random_prompts(384, PROMPT_LENS, seed=31)
    eager = load_engine(engines[1])
    ar = [r.output_ids for r in generate(eager, prompts, greedy(40), "ar")]
    return base, engines[1], prompts, ar


@pytest.fixture(scope="module")
def compiled(tiny):
    return load_engine(tiny[1], compile="inductor")


@core
def test_compiled_greedy_redrafter_and_ar_equal_eager_ar_and_hf(tiny, compiled):
    base, _, prompts, ar = tiny
    assert compiled.compiler.mode == "inductor"
    res = generate(compiled, prompts, greedy(40), "redrafter")
    assert [r.output_ids for r in res] == ar
    assert all(r.draft_tokens > 0 for r in res)  # trees were drafted and verified (the random drafter is rarely right)
    assert [r.output_ids for r in generate(compiled, prompts, greedy(40), "ar")] == ar
    assert ar[:2] == [hf_greedy(base, p, 40) for p in prompts[:2]]


def test_compiled_ngram_and_mixed_trees_equal_ar(tiny, compiled):
    """Trees composed on the host are packed at the start of the compiled step (its other variants)."""
    _, _, prompts, ar = tiny
    for proposer in ("ngram", "mixed"):
        res = generate(compiled, prompts, greedy(40), proposer=proposer)
        assert [r.output_ids for r in res] == ar, proposer
        # the tiny model falls into loops: its own context has matches, drafted and accepted through the host trees
        assert sum(r.accepted_draft_tokens for r in res) >= 10, (proposer, [r.accepted_draft_tokens for r in res])


@core
def test_sampled_redrafter_equals_sampled_ar_eager_and_compiled(tiny, compiled):
    """Counter-based noise keyed by (seed, position): exact acceptance emits AR's own draws."""
    _, engine_dir, prompts, _ = tiny
    params = [SamplingConfig(max_tokens=30, temperature=0.8, top_k=50, top_p=0.9, seed=s) for s in range(len(prompts))]
    eager = load_engine(engine_dir)
    ar = [r.output_ids for r in generate(eager, prompts, params, "ar")]
    assert [r.output_ids for r in generate(eager, prompts, params, "redrafter")] == ar
    assert [r.output_ids for r in generate(compiled, prompts, params, "redrafter")] == ar
    assert len({tuple(o) for o in ar}) == len(ar)  # really sampled: different seeds, different outputs
    # the sampled tree steps ran in a unit of their own, compiled as one that draws noise; the greedy ones did not
    units = compiled.launcher._units
    assert units[(True, True)].draws and not units[(True, False)].draws


@core
def test_units_that_draw_noise_store_values_used_twice(monkeypatch):
    """A sampled step's unit compiles with a low `realize_opcount_threshold` (runtime/graphs.py: its noise's rounds
    are stored, not inlined into each of their two uses, which took minutes of compiling); greedy steps' units keep
    inductor's default, and so do units that are not compiled by inductor."""
    from trt_redrafter.runtime import graphs

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    cpu = torch.device("cpu")
    assert graphs.Unit(lambda x: x, "inductor", cpu, "step", draws=True).draws
    assert seen[-1]["realize_opcount_threshold"] == graphs.DRAWS_REALIZE_OPS
    graphs.Unit(lambda x: x, "inductor", cpu, "step")
    assert "realize_opcount_threshold" not in seen[-1]
    graphs.Unit(lambda x: x, "off", cpu, "step", draws=True)
    assert len(seen) == 2


@core
def test_compiled_step_does_not_recompile_across_steps(tiny, compiled):
    """After warm-up, a request's steps (KV crossing blocks, trees of varying width) and both batch shapes run
    the graphs compiled at load; a recompile would raise under `fail_on_recompile`."""
    _, _, prompts, _ = tiny
    generate(compiled, prompts, greedy(60), "redrafter")  # the first sampled/greedy variants compile here
    generate(compiled, prompts, greedy(60), "ar")
    torch.compiler.set_stance("fail_on_recompile")
    try:
        long = [p * 3 for p in prompts[:4]]  # longer contexts, other lengths, other tree widths
        res = generate(compiled, long, greedy(70), "redrafter")
        res += generate(compiled, long[:1], greedy(70), "redrafter")
        res += generate(compiled, long, greedy(70), "ar")
    finally:
        torch.compiler.set_stance("default")
    assert all(len(r.output_ids) == 70 for r in res)


@core
def test_the_compiled_ar_step_is_one_graph_for_every_batch_size(tiny):
    """The AR step's batch is an unbacked size on the CPU (`Compiler.mark_any_batch`): the graph compiled at batch 2
    runs batch 1 without compiling another (a dynamic size would specialize 1), and its tokens are AR's."""
    from trt_redrafter.config import RuntimeConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.runtime.engine import Engine

    _, engine_dir, prompts, ar = tiny
    cold = Engine.load(engine_dir, Dist(0, 1, torch.device("cpu")),
                       RuntimeConfig(device="cpu", compile="inductor", speculate="full"), warmup=False)
    two = generate(cold, prompts[:2], greedy(8), "ar")  # its AR graph compiles here, at batch 2
    torch.compiler.set_stance("fail_on_recompile")
    try:
        one = generate(cold, prompts[2:3], greedy(40), "ar")
    finally:
        torch.compiler.set_stance("default")
    assert [r.output_ids for r in two] == [a[:8] for a in ar[:2]] and one[0].output_ids == ar[2]


@core
def test_compiled_root_only_steps_run_the_one_tree_graph(tiny, compiled):
    """`--speculate 1`: every step verifies its root alone and drafts the next trees, the fixed cost of speculating.
    It verifies one node, not two (the width an unbacked size: the graph compiled at the whole tree's width runs
    it), recompiles nothing, and emits AR's tokens."""
    _, _, prompts, ar = tiny
    launcher = compiled.launcher
    verified, verify_width = [], launcher.verify_width
    launcher.verify_width = lambda width, kept: verified.append(verify_width(width, kept)) or verified[-1]
    speculation, compiled.policy.speculation = compiled.policy.speculation, Speculation(False, 1)
    torch.compiler.set_stance("fail_on_recompile")
    try:
        res = generate(compiled, prompts, greedy(40), "redrafter")
    finally:
        torch.compiler.set_stance("default")
        compiled.policy.speculation, launcher.verify_width = speculation, verify_width
    assert [r.output_ids for r in res] == ar
    assert set(verified) == {1} and len(verified) >= 39  # every decode step a tree step (40 tokens: >= 39 steps)


@core
def test_compiled_every_beam_count_runs_the_one_tree_graph(tiny, compiled):
    """`--draft-beams 1` and `2` on the compiled engine: the drafter's beam count is an unbacked size, so the tree
    graph compiled at load drafts any count without a recompile, and the tokens are AR's. (The trained pair's
    acceptance at every count: test_draft_beams.)"""
    _, _, prompts, ar = tiny
    launcher, policy = compiled.launcher, compiled.policy
    assert launcher.beam_options == [1, 2, 4]
    generate(compiled, prompts, greedy(40), "redrafter")  # the greedy variants, compiled by now or here
    seen = record_tree_steps(launcher, lambda variant, beams, depth: beams)
    options = policy.beam_options
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for k in (1, 2):
            policy.beam_options, seen[:] = [k], []
            res = generate(compiled, prompts, greedy(40), "redrafter")
            assert [r.output_ids for r in res] == ar, k
            assert set(seen) == {k} and all(r.draft_tokens > 0 for r in res), k
    finally:
        torch.compiler.set_stance("default")
        del launcher.tree
        policy.beam_options = options


@core
def test_compiled_every_draft_depth_runs_the_one_tree_graph(tiny, compiled):
    """`--draft-depth 1` and `2` (of 3) on the compiled engine, with 4 beams and with 1: each drafting depth's rows
    are an unbacked size (none past the depth), so the tree graph compiled at load stops the search at any depth
    without a recompile; the steps verify nothing deeper (the nodes past the depth score SCORE_PAD and are not
    kept), and the tokens are AR's, greedy and sampled. (The trained pair's acceptance at every depth:
    test_draft_depth.)"""
    _, _, prompts, ar = tiny
    launcher, policy = compiled.launcher, compiled.policy
    assert launcher.depth_options == [1, 2, 3]
    generate(compiled, prompts, greedy(40), "redrafter")  # the greedy variants, compiled by now or here
    seen = record_tree_steps(launcher, lambda variant, beams, depth: depth)
    options, beam_options = policy.depth_options, policy.beam_options
    try:
        # sampled, one token deep: AR's draws (the sampled variants may compile here)
        params = [SamplingConfig(max_tokens=30, temperature=0.8, top_k=50, seed=s) for s in range(len(prompts))]
        sampled_ar = [r.output_ids for r in generate(compiled, prompts, params, "ar")]
        policy.depth_options = [1]
        res = generate(compiled, prompts, params, "redrafter")
        assert [r.output_ids for r in res] == sampled_ar and set(seen) == {1}
        assert all(r.draft_tokens > 0 for r in res)
        torch.compiler.set_stance("fail_on_recompile")
        for k, d in ((4, 1), (4, 2), (1, 1)):
            policy.depth_options, policy.beam_options, seen[:] = [d], [k], []
            res = generate(compiled, prompts, greedy(40), "redrafter")
            assert [r.output_ids for r in res] == ar, (k, d)
            assert set(seen) == {d} and all(r.draft_tokens > 0 for r in res), (k, d)
            # `draft_tokens` adds up the depth of the deepest node each tree step verified (the first tree, drafted
            # after the prompt, is whole: 3 deep)
            assert all(r.draft_tokens <= d * r.steps + 3 - d for r in res), (k, d, [r.draft_tokens for r in res])
    finally:
        torch.compiler.set_stance("default")
        del launcher.tree
        policy.depth_options, policy.beam_options = options, beam_options


@core
def test_the_torch_attention_traces_at_an_unbacked_tree_width():
    """Where the CPU has no AVX-512, the compiled tree step runs `torch_tree_attention`, at a tree width that is an
    unbacked size (`Compiler.mark_width`: one graph for every width, 1 included). It traces so (dynamo's fake
    tensors; no C++ compiled here) and gives the eager rows at widths 5 and 1."""
    from trt_redrafter.model.attention import AttentionMeta, torch_tree_attention

    g = torch.Generator().manual_seed(0)
    block, nblk, nh, nkv, D, most = 16, 3, 4, 2, 16, 7
    kc, vc = (torch.randn(2 * nblk * block, nkv, D, generator=g) for _ in range(2))
    table, ctx = torch.randperm(2 * nblk, generator=g)[:nblk][None], torch.tensor([20])
    q_all = torch.randn(1, most, nh, D, generator=g)
    tree_all = (torch.rand(1, most, most, generator=g) < 0.5).tril() | torch.eye(most, dtype=torch.bool)[None]

    def attend(width: torch.Tensor) -> torch.Tensor:  # as the step cuts its stored tree (Step.verify_tree)
        q, tree = q_all.index_select(1, width), tree_all.index_select(1, width).index_select(2, width)
        pos = ctx[:, None] + torch.arange(width.shape[0])
        meta = AttentionMeta(positions=pos, write_slots=pos, block_table=table, ctx_len=ctx, tree_mask=tree,
                             block_size=block).for_torch()
        return torch_tree_attention(q, kc, vc, meta, D ** -0.5)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    for T in (5, 1):
        width = torch.arange(T)
        torch._dynamo.decorators.mark_unbacked(width, 0)
        assert torch.equal(compiled(width), attend(width)), T


@core
def test_a_tree_steps_one_row_kernels_run_without_forking_threads():
    """Inductor sizes a kernel's threading by its size's hint at compile time, and an unbacked width has none (it
    assumes 8192): every kernel of a tree step forked and joined the CPU's threads, for one row too. The width is
    hinted at 1 (`Compiler.mark_width`): a one-row 128-wide kernel runs serially, as the AR graph's do, and a kernel
    with work enough for the threads stays parallel."""
    from torch._inductor.utils import run_and_get_code

    from trt_redrafter.runtime.graphs import Compiler

    def code_at_one_row(columns: int) -> str:  # a tree step's elementwise kernel: rows picked by the width
        x = torch.randn(64, columns)

        def step(width: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x.index_select(0, width))

        torch._dynamo.reset()
        width = torch.arange(1)
        Compiler("inductor", torch.device("cpu")).mark_width(width)
        out, (code, *_) = run_and_get_code(torch.compile(step, fullgraph=True), width)
        assert torch.equal(out, step(width))
        return code

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        narrow, wide = code_at_one_row(128), code_at_one_row(16384)
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert "cpp_fused" in narrow and "omp parallel" not in narrow, narrow
    assert "omp parallel" in wide, wide


@core
def test_the_torch_attention_traces_with_a_one_row_mask_beside_unbacked_query_rows():
    """A compiled TP step is split at the ranks' collectives (model/tp.py): a graph piece can receive the attention
    mask as an input whose rows dynamo specialized at 1 beside queries whose rows are an unbacked size. The mask is
    expanded to the queries' rows, so that traces (no C++ compiled here) and gives the eager rows."""
    from trt_redrafter.model.attention import AttentionMeta, torch_tree_attention

    g = torch.Generator().manual_seed(1)
    block, nblk, nh, nkv, D = 16, 2, 4, 2, 16
    kc, vc = (torch.randn(2 * nblk * block, nkv, D, generator=g) for _ in range(2))
    table, ctx = torch.tensor([[3, 1]]), torch.tensor([9])
    one = torch.zeros(1, 1, 1, dtype=torch.bool)
    full = AttentionMeta(positions=ctx[:, None], write_slots=ctx[:, None], block_table=table, ctx_len=ctx,
                         tree_mask=one | True, block_size=block).for_torch()

    def attend(q: torch.Tensor, kv_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        meta = AttentionMeta(positions=ctx[:, None], write_slots=ctx[:, None], block_table=table, ctx_len=ctx,
                             tree_mask=one, block_size=block, kv_slots=kv_slots, visible=visible)
        return torch_tree_attention(q, kc, vc, meta, D ** -0.5)

    q = torch.randn(1, 1, nh, D, generator=g)
    torch._dynamo.decorators.mark_unbacked(q, 1)
    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    assert full.visible.shape[2] == 1
    assert torch.equal(compiled(q, full.kv_slots, full.visible), attend(q, full.kv_slots, full.visible))
