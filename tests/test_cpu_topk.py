"""The CPU top-k kernel (trt_redrafter/cpu/topk.cpp) the drafter's beam search runs on a CPU: each row's k largest
values, descending, equal values in ascending index order (a stable descending sort's first k), through both of its
paths (the bound from 64 block maxima, and the plain scan for short rows, k > 64 and NaN-heavy rows); the engine's
CPU kernels use it (the beam search picks the literal algorithm's beams with it: tests/test_beam_search.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from trt_redrafter import cpu
from trt_redrafter.decoding.beam_search import select_beams_topk


@pytest.fixture(autouse=True)
def _kernels():
    if not cpu.available(torch.float32):
        pytest.skip("this CPU has no AVX-512")
    cpu.ops()  # on such a CPU the kernels must build: a failure here is a failure


def _reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable descending sort's first k (NaN, which sort puts first, moved after every number)."""
    key = torch.where(torch.isnan(x), torch.full_like(x, -float("inf")), x)
    nan_last = torch.isnan(x).to(torch.int64)
    # order by (number before NaN, value descending, index ascending): two stable sorts
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort(nan_last.gather(-1, order), dim=-1, stable=True).indices)
    idx = order[..., :k]
    return x.gather(-1, idx), idx


# (shape, k): the bound path (V >= 64 * 16, k <= 64), at k = 64 and past it (the scan), short rows (the scan), k = V
CASES = [((1, 4, 8192), 50), ((2, 1, 49152), 50), ((3, 2048), 4), ((8, 8192), 64), ((2, 8192), 65),
         ((5, 37), 3), ((3, 100), 100), ((1, 1000), 1), ((2, 3, 1100), 17)]


@pytest.mark.parametrize("shape,k", CASES)
def test_topk_equals_the_stable_sort(shape, k):
    g = torch.Generator().manual_seed(k)
    for x in (torch.randn(shape, generator=g) * 4,  # distinct values
              torch.randint(0, 12, shape, generator=g).float(),  # ties everywhere, also at the bound
              torch.randn(shape, generator=g).sort(dim=-1).values,  # ascending rows: every value enters the scan
              torch.full(shape, 2.5)):  # one value: the first k indices
        vals, idx = cpu.topk(x, k)
        ref_vals, ref_idx = _reference(x, k)
        assert vals.shape == idx.shape == (*shape[:-1], k) and idx.dtype == torch.int64
        assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)
        assert torch.equal(vals, torch.topk(x, k).values)


def test_topk_puts_nan_after_every_number():
    x = torch.tensor([[1.0, float("nan"), 3.0, 3.0, float("nan"), 2.0]])
    vals, idx = cpu.topk(x, 3)
    assert idx.tolist() == [[2, 3, 5]] and vals.tolist() == [[3.0, 3.0, 2.0]]
    vals, idx = cpu.topk(x, 6)
    assert idx.tolist() == [[2, 3, 5, 0, 1, 4]]
    row = torch.full((1, 4096), float("nan"))
    row[0, 100], row[0, 4000] = 1.0, 5.0  # fewer than k numbers in a row long enough for the bound
    vals, idx = cpu.topk(row, 4)
    assert idx.tolist() == [[4000, 100, 0, 1]] and vals[0, :2].tolist() == [5.0, 1.0]


def test_topk_refusals():
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="must be in"):
        cpu.topk(x, 11)
    with pytest.raises(RuntimeError, match="must be in"):
        cpu.topk(x, 0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.topk(x.double(), 2)


def test_topk_compiles_as_an_external_op():
    x = torch.randn(2, 4, 8192)
    f = torch.compile(lambda t: cpu.topk(t * 2, 50), backend="inductor", fullgraph=True)
    vals, idx = f(x)
    assert torch.equal(vals, cpu.topk(x * 2, 50)[0]) and torch.equal(idx, cpu.topk(x * 2, 50)[1])


def test_the_engines_cpu_kernels_draft_with_it(tmp_path):
    from engine_utils import build_tiny_engines, load_engine

    engine_dir = build_tiny_engines(tmp_path, seed=0, num_beams=2, draft_len=3)[1][1]
    select = load_engine(engine_dir).device_drafter.select  # auto on an AVX-512 CPU: the CPU kernels
    assert isinstance(select, functools.partial) and select.keywords["topk"] is cpu.topk
    assert load_engine(engine_dir, kernels="torch").device_drafter.select is select_beams_topk
