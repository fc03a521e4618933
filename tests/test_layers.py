"""The import graph of trt_redrafter against the layers its __init__ documents: no import from a lower layer to a
higher one, and no circle between modules. Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import trt_redrafter

PKG = Path(trt_redrafter.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """trt_redrafter modules that `path` imports (a `from X import name` counts X.name where that is a module)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names]
            # `from pkg import mod` imports the module; `from pkg import name` a name of pkg itself
            names = subs + ([target] if not all(_exists(n) for n in subs) else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("trt_redrafter.") and _exists(n))
    return out - {mod}


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in PKG.rglob("*.py")}


def _unit(module: str) -> str:
    return module.split(".")[1]


def test_every_unit_has_a_layer():
    layered = {u for layer in trt_redrafter.LAYERS for u in layer}
    units = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and any(p.rglob("*.py")))}
    assert units == layered, f"units without a layer: {units - layered}; layers naming nothing: {layered - units}"


def test_no_import_runs_up_a_layer():
    level = {u: i for i, layer in enumerate(trt_redrafter.LAYERS) for u in layer}
    graph = _graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the walk sees the package
    up = [f"{a} -> {b}" for a, targets in graph.items() if a != "trt_redrafter" for b in targets
          if b != "trt_redrafter" and level[_unit(b)] > level[_unit(a)]]
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(up))


def test_no_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_walk_sees_function_level_imports(tmp_path):
    """The checks above would miss a back-arrow hidden inside a function if the walk did not see it."""
    src = PKG / "backends" / "trtllm.py"
    found = _imports(src)
    assert "trt_redrafter.prompt_args" in found  # imported inside run_trtllm
    assert "trt_redrafter.runtime.distributed" in found
