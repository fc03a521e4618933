"""A STUB of TensorRT's compiled core module (`tensorrt_bindings/tensorrt.so`), for CPU tests of the plugin wrappers
against TensorRT's real Python plugin API.

TensorRT's `tensorrt.plugin` package is pure Python (`tensorrt_bindings/plugin/*.py` in the `tensorrt_cu12_bindings`
wheel); only the core it imports as `tensorrt` is compiled, and that needs libnvinfer and a GPU. `install()` puts this
module in its place as `tensorrt`, with the real `plugin` package found under it, so that registration, TensorRT's
signature validator (`plugin/_validate.py`), its plugin creator and its shape/type callbacks run unchanged. What is
stubbed is what the core would do: enums, the plugin registry (a dict), plugin fields, and the shape-expression
builder (integer arithmetic on constants, where TensorRT builds symbolic expressions). Nothing here runs a kernel or
builds an engine: that needs TensorRT itself (tests/test_tensorrt_plugins.py, GPU).

Names follow TensorRT 10.13's Python API (python/packages/tensorrt/plugin at NVIDIA/TensorRT v10.13).
"""

from __future__ import annotations

import enum
import importlib.util
import operator
import sys
import types
from pathlib import Path

STUB = True  # what a test asserts, so that it is never mistaken for TensorRT


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


float32, float16, int8, int32, bool, bfloat16, int64 = (DataType.FLOAT, DataType.HALF, DataType.INT8, DataType.INT32,
                                                        DataType.BOOL, DataType.BF16, DataType.INT64)


class PluginFieldType(enum.Enum):
    FLOAT16, FLOAT32, FLOAT64, INT8, INT16, INT32, CHAR, DIMS, UNKNOWN, BF16, INT64, FP8, INT4, FP4 = range(14)


class DimensionOperation(enum.Enum):
    SUM, PROD, MAX, MIN, SUB, EQUAL, LESS, FLOOR_DIV, CEIL_DIV = range(9)


class TensorFormat(enum.Enum):
    LINEAR = 0


class TensorRTPhase(enum.Enum):
    BUILD, RUNTIME = range(2)


class QuickPluginCreationRequest(enum.Enum):
    UNKNOWN, PREFER_JIT, PREFER_AOT, STRICT_JIT, STRICT_AOT = range(5)


class PluginArgType(enum.Enum):
    INT = 0


class PluginArgDataType(enum.Enum):
    INT8, INT16, INT32 = range(3)


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def log(self, severity, msg):
        pass


class Dims:
    MAX_DIMS = 8


# interfaces TensorRT's Python classes derive from (siblings: the plugin classes list several as bases)
class _Interface:
    def __init__(self, *a):
        pass


class IPluginV3(_Interface):
    pass


class IPluginV3QuickCore(_Interface):
    pass


class IPluginV3QuickBuild(_Interface):
    pass


class IPluginV3QuickRuntime(_Interface):
    pass


class IPluginV3QuickAOTBuild(_Interface):
    pass


class IPluginCreatorV3Quick(_Interface):
    pass


class IPluginCreatorV3One(IPluginCreatorV3Quick):
    pass


class ISymExpr(_Interface):
    pass


class ISymExprs(list):
    pass


class IExprBuilder:
    pass


class ITensor:
    """A network tensor (the stub network's inputs)."""

    def __init__(self, name: str = ""):
        self.name = name


class PluginTensorDesc:
    def __init__(self):
        self.type = None
        self.format = None


class DynamicPluginTensorDesc:
    pass


class PluginField:
    def __init__(self, name="", data=None, type=None):
        self.name, self.data, self.type = name, data, type


class PluginFieldCollection(list):
    pass


class IDimensionExpr:
    """A constant dimension: TensorRT's are symbolic; here every input extent is known."""

    def __init__(self, value: int):
        self.value = int(value)

    def is_constant(self) -> bool:
        return True

    def get_constant_value(self) -> int:
        return self.value

    def is_size_tensor(self) -> bool:
        return False


_OPS = {DimensionOperation.SUM: operator.add, DimensionOperation.PROD: operator.mul, DimensionOperation.MAX: max,
        DimensionOperation.MIN: min, DimensionOperation.SUB: operator.sub,
        DimensionOperation.EQUAL: lambda a, b: int(a == b), DimensionOperation.LESS: lambda a, b: int(a < b),
        DimensionOperation.FLOOR_DIV: operator.floordiv, DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b)}


class ExprBuilder(IExprBuilder):
    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(value)

    def operation(self, op: DimensionOperation, a: IDimensionExpr, b: IDimensionExpr) -> IDimensionExpr:
        return IDimensionExpr(_OPS[op](a.value, b.value))


class DimsExprs(list):
    def __init__(self, n: int = 0):
        super().__init__([None] * n)


class _Registry:
    def __init__(self):
        self.creators: dict[tuple[str, str, str], object] = {}

    def register_creator(self, creator, namespace: str) -> bool:
        self.creators[(creator.name, creator.plugin_version, namespace)] = creator
        return True

    def get_creator(self, name: str, version: str, namespace: str = ""):
        return self.creators.get((name, version, namespace))


_registry = _Registry()


def get_plugin_registry() -> _Registry:
    return _registry


def nptype(dtype):
    import numpy as np

    return {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT32: np.int32,
            DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.INT8: np.int8}[dtype]


class Network:
    """`INetworkDefinition.add_plugin` as TensorRT does it for a `tensorrt.plugin.op` call: create the plugin through
    the registered creator, then ask it for its outputs' types and shapes (the callbacks TensorRT calls at build)."""

    def __init__(self):
        self.layers = []

    def add_plugin(self, make):
        inputs, shape_inputs, plugin = make()
        layer = types.SimpleNamespace(inputs=inputs, plugin=plugin, num_outputs=plugin.get_num_outputs(),
                                      get_output=lambda i: ITensor(f"{plugin.plugin_name}:{i}"))
        self.layers.append(layer)
        return layer


def resolve(plugin, shapes: list[tuple[int, ...]], dtypes: list[DataType]):
    """The output (shape, dtype) list TensorRT would derive for input `shapes` and `dtypes`."""
    out_types = plugin.get_output_data_types(list(dtypes), [len(s) for s in shapes])
    dims = []
    for s in shapes:
        d = DimsExprs(len(s))
        for i, v in enumerate(s):
            d[i] = IDimensionExpr(v)
        dims.append(d)
    out_exprs = plugin.get_output_shapes(dims, [], ExprBuilder())
    return [(tuple(e.get_constant_value() for e in ex), t) for ex, t in zip(out_exprs, out_types)]


def install(bindings_dir: str | Path | None = None) -> types.ModuleType:
    """Make `import tensorrt` give this stub and `import tensorrt.plugin` give TensorRT's real plugin package."""
    if bindings_dir is None:
        spec = importlib.util.find_spec("tensorrt_bindings")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("tensorrt_bindings is not installed (pip install tensorrt_cu12_bindings)")
        bindings_dir = list(spec.submodule_search_locations)[0]
    if not (Path(bindings_dir) / "plugin" / "_validate.py").is_file():
        raise ImportError(f"{bindings_dir} has no plugin/_validate.py")
    me = sys.modules[__name__]
    me.__path__ = [str(bindings_dir)]  # the package path: tensorrt.plugin is the real one
    sys.modules["tensorrt"] = me
    return me
