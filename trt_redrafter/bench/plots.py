"""PNG plots of a results document (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
STYLE = {"ar": "--", "redrafter": "-", "ngram": ":", "mixed": "-."}
LABEL = {"ar": "AR", "redrafter": "ReDrafter", "ngram": "N-gram", "mixed": "mixed"}


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise UserError("plots need matplotlib: pip install 'trt-redrafter[bench]' (or pass --no-plots).") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(doc: dict, what: str) -> str:
    m, c = doc.get("machine", {}), doc["config"]
    where = ", ".join(m.get("gpus") or []) or f"CPU x{m.get('affinity') or m.get('cpu_count')}"
    return f"{what}\n{where}; max_tokens {c.get('max_tokens')}, medians over {c.get('repeats')} repeat(s)"


def _finish(plt, fig, ax, ylabel: str, title: str, path: Path) -> Path:
    """Axis labels, grid, legend and title shared by every plot; save it and free the figure."""
    ax.set_xlabel("offered load (QPS, Poisson)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_all(doc: dict, out_dir: Path) -> dict[str, Path]:
    plt = _pyplot()
    files = {}
    tps = sorted({p["tp"] for p in doc["points"]})

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    for i, tp in enumerate(tps):
        for mode in STYLE:
            pts = sorted((p for p in doc["points"] if p["tp"] == tp and p["mode"] == mode), key=lambda p: p["qps"])
            pts = [p for p in pts if p["metrics"]["tpot_ms"]["median"] is not None]
            if pts:
                ax.plot([p["qps"] for p in pts], [p["metrics"]["tpot_ms"]["median"] for p in pts], STYLE[mode],
                        marker="o", color=COLORS[i % len(COLORS)], label=f"TP{tp} {LABEL[mode]}")
    ax.set_ylim(bottom=0)
    files["plot_ms_per_token"] = _finish(plt, fig, ax, "TPOT median (ms/token)", _title(doc, "ms/token vs QPS"),
                                         out_dir / "ms_per_token.png")

    if doc["speedups"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
        for i, tp in enumerate(tps):
            for mode in STYLE:
                ss = sorted((s for s in doc["speedups"] if s["tp"] == tp and s.get("mode", "redrafter") == mode
                             and s["speedup"] is not None), key=lambda s: s["qps"])
                if not ss:
                    continue
                x = [s["qps"] for s in ss]
                y = [s["speedup"] for s in ss]
                err = [[s["speedup"] - s["min"] for s in ss], [s["max"] - s["speedup"] for s in ss]]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=COLORS[i % len(COLORS)], ls=STYLE[mode],
                            label=f"TP{tp} {LABEL[mode]}")
        ax.axhline(1.0, color="gray", lw=0.8)
        files["plot_speedup"] = _finish(plt, fig, ax, "speedup = AR TPOT / speculative TPOT",
                                        _title(doc, "speedup over AR vs QPS (bars: min-max over repeats)"),
                                        out_dir / "speedup.png")
    return files
