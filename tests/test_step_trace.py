"""scripts/step_trace.py's sorting of a traced compiled step into parts (the trace itself needs a real engine and
minutes of compiling: docs/perf.md "CPU: what a tree step costs" runs it)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("step_trace", ROOT / "scripts" / "step_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _event(name, ts, dur, tid=1):
    return {"name": name, "ts": float(ts), "dur": float(dur), "tid": tid, "ph": "X"}


def test_a_traced_step_is_split_at_the_end_of_the_lm_head():
    st = _script()
    call = _event("## Call CompiledFxGraph abc ##", 0, 1000)
    events = [call,
              _event("trt_redrafter_cpu::linear", 10, 100),  # a layer's linear (verify)
              _event("trt_redrafter_cpu::tree_attention", 115, 20),
              _event("cpp_fused_add_rms_norm_0", 140, 5),  # a verify kernel
              _event("inner child", 141, 1),  # inside it: not counted again
              _event("trt_redrafter_cpu::linear", 150, 400),  # the largest linear: the lm_head ends the verify
              _event("cpp_fused_argmax_1", 560, 10),  # accept
              _event("trt_redrafter_cpu::linear_w8a8", 575, 50),  # the drafter (int8 weights and activations)
              _event("trt_redrafter_cpu::topk", 630, 30),
              _event("aoti_torch_cpu_sort_stable", 665, 20),  # pack's library op
              _event("trt_redrafter_cpu::linear", 700, 5, tid=2)]  # another thread: not this step's
    parts, after = st.parts_of_step(events, call)
    ms = {k: round(v * 1e3, 6) for k, v in parts.items()}  # back to microseconds
    assert {k: round(v * 1e3, 6) for k, v in after.items()} == {  # the kernels after the verify, by name (--top)
        "cpp_fused_argmax_1": 10, "trt_redrafter_cpu::linear_w8a8": 50, "trt_redrafter_cpu::topk": 30,
        "aoti_torch_cpu_sort_stable": 20}
    assert ms == {"verify linear": 500, "attention": 20, "verify other": 5, "drafter": 50, "topk": 30,
                  "after-verify kernels": 10, "library ops": 20,
                  "gaps": 1000 - (500 + 20 + 5 + 50 + 30 + 10 + 20), "step": 1000}
    assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(parts["step"])


def test_the_fused_beam_search_counts_as_the_drafter():
    st = _script()
    call = _event("## Call CompiledFxGraph abc ##", 0, 1000)
    events = [call, _event("trt_redrafter_cpu::linear", 10, 400),  # the lm_head
              _event("cpp_fused_argmax_1", 420, 10), _event("trt_redrafter_cpu::beam_draft", 440, 300)]
    parts, _ = st.parts_of_step(events, call)
    assert round(parts["drafter"] * 1e3, 6) == 300 and parts["topk"] == 0 and parts["after-verify kernels"] > 0
