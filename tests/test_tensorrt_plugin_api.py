"""The TensorRT plugin wrappers registered through TensorRT's real Python plugin API, on the CPU, with a stubbed core.

TensorRT's `tensorrt.plugin` package is pure Python; it ships in the `tensorrt_cu12_bindings` wheel
(`tensorrt_bindings/plugin/*.py`, installed by the `dev` extra) beside the compiled core `tensorrt.so`, which needs
libnvinfer and a GPU. Here the core is replaced by tests/tensorrt_stub_core.py (a STUB: enums, a dict for the plugin
registry, constant shape expressions) and everything else is TensorRT's own code: `@tensorrt.plugin.register` and
`@tensorrt.plugin.impl` with their signature validator (`plugin/_validate.py`), the plugin creator, the plugin's
attribute fields, and its output type and shape callbacks. Each case runs in a fresh interpreter, so the stub never
stands in for TensorRT anywhere else. Kernels inside a built engine are tests/test_tensorrt_plugins.py's (GPU).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
BINDINGS = importlib.util.find_spec("tensorrt_bindings")
pytestmark = pytest.mark.skipif(
    BINDINGS is None or not (Path(list(BINDINGS.submodule_search_locations)[0]) / "plugin" / "_validate.py").is_file(),
    reason="needs TensorRT's Python plugin package: pip install 'tensorrt_cu12_bindings>=10.11' (the dev extra)")

PRELUDE = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
import tensorrt_stub_core as core
core.install()
import tensorrt, tensorrt.plugin as trtp
assert tensorrt.STUB and trtp.__file__.endswith("tensorrt_bindings/plugin/__init__.py"), trtp.__file__
"""


def run(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = [  # (plugin, input shapes, input dtypes, attributes)
    ("beam_step", [(4, 3, 200), (4, 3)], ["float32", "float32"], {"num_beams": 3, "warp_top_k": 50}),
    ("beam_step", [(1, 1, 32000), (1, 1)], ["float32", "float32"], {"num_beams": 4, "warp_top_k": 0}),
    ("pack_beams", [(5, 4, 4)], ["int64"], {"pad_to": 13}),
    ("accept_tokens", [(5, 4, 4), (5, 4, 4)], ["int64", "int64"], {}),
    ("draw", [(9, 300), (9,), (9,)], ["float32", "int64", "int64"], {}),
]


def test_every_plugin_registers_and_is_validated_by_tensorrt():
    out = run("""
from trt_redrafter.plugins import tensorrt_plugins as tp
ids = tp.register_tensorrt_plugins()
from tensorrt.plugin._lib import QDP_REGISTRY
defs = {i: QDP_REGISTRY[i] for i in ids}
print(json.dumps({"ids": ids, "specs": sorted(tp.SPECS),
    "creators": sorted(f"{ns}::{name}" for name, _, ns in core.get_plugin_registry().creators),
    "impl": {i: d.impl_func is not None for i, d in defs.items()},
    "inputs": {i: list(d.input_tensor_names) for i, d in defs.items()},
    "attrs": {i: {k: v.__name__ for k, v in d.input_attrs.items()} for i, d in defs.items()},
    "outputs": {i: d.num_outputs for i, d in defs.items()}}))
""")
    from trt_redrafter.plugins.tensorrt_plugins import NAMESPACE, SPECS

    assert out["specs"] == sorted(SPECS) and len(SPECS) == 4
    assert sorted(out["ids"]) == out["creators"] == sorted(f"{NAMESPACE}::{n}" for n in SPECS)
    for name, spec in SPECS.items():
        pid = spec.plugin_id
        assert out["impl"][pid], f"{pid}: no impl registered"
        assert out["inputs"][pid] == [n for n, _ in spec.inputs]
        assert out["attrs"][pid] == {a: "int" for a in spec.attrs}  # real classes, not strings
        assert out["outputs"][pid] == len(spec.outputs)


@pytest.mark.parametrize("name,shapes,dtypes,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_add_plugin_gives_the_shapes_and_types_the_spec_declares(name, shapes, dtypes, attrs):
    """network.add_plugin(trtp.op.trt_redrafter.<name>(...)) as TensorRT runs it at build: the registered creator makes
    the plugin from its serialized attribute fields, then its type and shape callbacks run our descriptor."""
    out = run(f"""
from trt_redrafter.plugins import tensorrt_plugins as tp
net = core.Network()
shapes, dtypes, attrs = {shapes!r}, {dtypes!r}, {attrs!r}
layer = tp.add_plugin(net, {name!r}, *[core.ITensor(f"in{{i}}") for i in range(len(shapes))], **attrs)
by = {{"float32": core.DataType.FLOAT, "int64": core.DataType.INT64, "bool": core.DataType.BOOL}}
res = core.resolve(layer.plugin, [tuple(s) for s in shapes], [by[d] for d in dtypes])
print(json.dumps({{"attrs": {{k: int(v) for k, v in layer.plugin.attrs.items()}}, "num_outputs": layer.num_outputs,
                  "outputs": [[list(s), t.name] for s, t in res]}}))
""")
    from trt_redrafter.plugins.tensorrt_plugins import SPECS

    spec = SPECS[name]
    name_of = {"float32": "FLOAT", "int64": "INT64", "bool": "BOOL"}
    assert out["attrs"] == attrs
    assert out["num_outputs"] == len(spec.outputs)
    want = [[list(s), name_of[d]] for s, d in spec.output_shapes(*shapes, **attrs)]
    assert out["outputs"] == want


def test_trtllm_plugin_adds_the_layer_to_the_network_being_built_with_a_stub_tensorrt_llm_functional():
    """`trtllm_plugin` through TensorRT's plugin API; tensorrt_llm.functional is a STUB of the two names it uses
    (`default_trtnet`, `_create_tensor`): TensorRT-LLM itself cannot be installed here."""
    out = run("""
import types
net = core.Network()
functional = types.ModuleType("tensorrt_llm.functional")  # STUB: not TensorRT-LLM
functional.default_trtnet = lambda: net
functional._create_tensor = lambda trt_tensor, layer: ("Tensor", trt_tensor.name)
sys.modules["tensorrt_llm"] = types.ModuleType("tensorrt_llm")
sys.modules["tensorrt_llm.functional"] = functional
from trt_redrafter.plugins import tensorrt_plugins as tp
Wrapped = types.SimpleNamespace
outs = tp.trtllm_plugin("accept_tokens", Wrapped(trt_tensor=core.ITensor("beams")),
                        Wrapped(trt_tensor=core.ITensor("node_tokens")))
print(json.dumps({"outs": outs, "layers": len(net.layers), "inputs": [t.name for t in net.layers[0].inputs]}))
""")
    assert out["layers"] == 1 and out["inputs"] == ["beams", "node_tokens"]
    assert out["outs"] == [["Tensor", f"accept_tokens:{i}"] for i in range(3)]


def test_tensorrts_validator_refuses_string_annotations():
    """What `from __future__ import annotations` at the top of tensorrt_plugins.py did to every descriptor: the check
    is TensorRT's, and it is live here (so the registration test above would catch that line coming back)."""
    out = run("""
from typing import Tuple
def desc(x: "trtp.TensorDesc", k: "int") -> "trtp.TensorDesc":
    return x.like()
try:
    trtp.register("stringly::desc")(desc)
    print(json.dumps({"error": None}))
except TypeError as e:
    print(json.dumps({"error": str(e)}))
""")
    assert out["error"] and "issubclass" in out["error"]
    import ast

    tree = ast.parse((TESTS.parent / "trt_redrafter" / "plugins" / "tensorrt_plugins.py").read_text())
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body)
