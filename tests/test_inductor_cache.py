"""Where inductor's compiled kernels are kept (runtime/loading.py `keep_inductor_cache`)."""

from __future__ import annotations


def test_tp_ranks_compile_into_their_own_inductor_caches(tmp_path, monkeypatch):
    """Ranks compile the same graphs at once: each gets its own directory under the engine's `.cache/inductor`, and a
    TORCHINDUCTOR_CACHE_DIR the user set at start-up wins over the engine directory. Both under a directory of the
    step kernels' sources: kernels compiled against other sources (another version's op schemas) are not found (an
    engine's kept graphs failed at their first op call after linear_w8a8 took one more argument)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from trt_redrafter.runtime import costs, loading

    monkeypatch.setattr(loading, "USER_INDUCTOR_CACHE", default_cache_dir())  # torch's own, written on first use
    kernels = f"kernels-{costs.kernel_sources_digest()}"
    for rank, world, want in ((0, 1, tmp_path / "e" / ".cache" / "inductor" / kernels),
                              (1, 2, tmp_path / "e" / ".cache" / "inductor" / kernels / "rank1")):
        loading.keep_inductor_cache(tmp_path / "e", rank, world)
        assert loading.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(want) and want.is_dir()
    monkeypatch.setattr(loading, "USER_INDUCTOR_CACHE", str(tmp_path / "mine"))
    loading.keep_inductor_cache(tmp_path / "e", 0, 2)
    assert loading.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / kernels / "rank0")
    monkeypatch.setattr(costs, "kernel_sources_digest", lambda: "0123456789abcdef")  # other kernel sources
    loading.keep_inductor_cache(tmp_path / "e", 0, 2)
    assert loading.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / "kernels-0123456789abcdef" / "rank0")


def test_the_users_inductor_cache_is_not_torchs_default(tmp_path):
    """Importing the runtime makes inductor write its default directory into TORCHINDUCTOR_CACHE_DIR; the engine must
    not take that for the user's choice (it did: every engine's kernels went to /tmp, none beside the engine), and
    must keep a directory the user did set."""
    import os
    import subprocess
    import sys

    code = "import trt_redrafter.runtime.engine, trt_redrafter.runtime.loading as e; print(repr(e._users_inductor_cache()))"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None", out.stdout
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(str(tmp_path / "mine")), out.stdout
