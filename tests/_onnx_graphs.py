"""Tiny in-memory ONNX graphs for op-by-op tests: build one with onnx.helper, run it through
leanrnn (from a file, as users load it) and through onnxruntime (the oracle), and compare
outputs by shape, dtype and value (tests/tolerances.py for floats, exact otherwise)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, ValueInfoProto, helper, numpy_helper

import leanrnn
from tolerances import atol

_names = itertools.count()


def onnx_type(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def model(
    nodes,
    feeds: dict[str, np.ndarray],
    consts: dict[str, np.ndarray] | None = None,
    outputs: list[str] | None = None,
    opset: int = 13,
    out_dtypes: list | None = None,
    dynamic: bool = False,
) -> onnx.ModelProto:
    """A model of ``nodes``: ``feeds`` are graph inputs (declared with their exact shape, or no
    shape at all when ``dynamic``), ``consts`` initializers, ``outputs`` (default: every output
    of the last node) graph outputs. Output dtypes come from ``out_dtypes`` or ONNX's own shape
    inference (strict, so a malformed test model fails here, not in the code under test);
    output shapes are left undeclared."""
    nodes = list(nodes)
    consts = consts or {}
    if outputs is None:
        outputs = [o for o in nodes[-1].output if o]
    inputs = [
        helper.make_tensor_value_info(k, onnx_type(v.dtype), None if dynamic else v.shape)
        for k, v in feeds.items()
    ]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    g = helper.make_graph(nodes, "g", inputs, [ValueInfoProto(name=o) for o in outputs], inits)
    opsets = [helper.make_opsetid("", opset)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = max(helper.find_min_ir_version_for(opsets), 7)
    if out_dtypes is None:
        typed = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output
        out_types = [o.type.tensor_type.elem_type for o in typed]
    else:
        out_types = [onnx_type(d) for d in out_dtypes]
    for o, t in zip(m.graph.output, out_types, strict=True):
        o.CopyFrom(helper.make_tensor_value_info(o.name, t, None))
    return m


def node(op: str, inputs, outputs=("y",), name: str | None = None, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), name=name or f"{op}_node", **attrs)


def folded(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The same model with every graph input turned into an initializer holding ``feeds``:
    leanrnn then evaluates the whole graph at load (constant folding)."""
    f = onnx.ModelProto()
    f.CopyFrom(m)
    del f.graph.input[:]
    f.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in feeds.items())
    return f


def save(m: onnx.ModelProto, tmp_path) -> str:
    """``m`` written to a fresh file under ``tmp_path`` (leanrnn.load takes a path)."""
    path = tmp_path / f"m{next(_names)}.onnx"
    path.write_bytes(m.SerializeToString())
    return str(path)


def load(m: onnx.ModelProto, tmp_path) -> leanrnn.GraphModel:
    g = leanrnn.load(save(m, tmp_path))
    assert isinstance(g, leanrnn.GraphModel)
    return g


def run_leanrnn(m: onnx.ModelProto, feeds: dict[str, np.ndarray], tmp_path) -> list[np.ndarray]:
    return load(m, tmp_path).run(feeds)


def run_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_same(got, want, what: str = "") -> None:
    """Equal shape and dtype; values within atol(dtype) for floats, exactly equal otherwise."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}shape {got.shape}, expected {want.shape}"
    # numpy.testing's asserts only to explain a failure: they cost more than the whole case
    if got.dtype.kind == "f":
        tol = atol(got.dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            close = (got == want) | (np.abs(got - want) <= tol) | (np.isnan(got) & np.isnan(want))
        if not close.all():
            np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=what)
    elif not np.array_equal(got, want):
        np.testing.assert_array_equal(got, want, err_msg=what)


def check(
    m: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    tmp_path,
    expected=None,
    with_ort: bool = True,
    fold: bool = False,
) -> list[np.ndarray]:
    """Run ``m`` through leanrnn and onnxruntime and compare every output; ``expected`` (a list
    of arrays) is a second, numpy oracle, the only one when ``with_ort`` is False (for the few
    op/dtype pairs onnxruntime has no kernel for). With ``fold``, leanrnn also runs ``m``
    constant-folded (``folded``) and must give the same outputs. Returns leanrnn's outputs."""
    assert with_ort or expected is not None
    got = run_leanrnn(m, feeds, tmp_path)
    runs = [("", got)]
    if fold:
        runs.append(("folded: ", run_leanrnn(folded(m, feeds), {}, tmp_path)))
    oracles = [("numpy", expected)] if expected is not None else []
    if with_ort:
        oracles.append(("onnxruntime", run_ort(m, feeds)))
    for label, outs in runs:
        for oracle, want in oracles:
            assert len(outs) == len(want)
            for k, (g, w) in enumerate(zip(outs, want, strict=True)):
                assert_same(g, w, f"{label}output {k} vs {oracle}: ")
    return got


__all__ = [
    "TensorProto",
    "assert_same",
    "check",
    "folded",
    "load",
    "model",
    "node",
    "onnx_type",
    "run_leanrnn",
]
