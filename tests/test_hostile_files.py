"""Hostile model files: truncated, bit-flipped, lying about shapes and sizes, pickles in disguise,
unknown ops, and a bounded fuzzer over valid files. Each must end in a leanrnn error with a
message that says what is wrong — never a crash, a hang, code execution or a giant allocation."""

from __future__ import annotations

import json
import pickle
import struct
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanrnn.errors import LeanRNNError, ModelFormatError, UnsupportedOpError, WeightsError
from leanrnn.loading import load, save
from leanrnn.nn import GRU, LSTM

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------------------------- fixtures
def _lstm_onnx(H=5, C=3, extra_nodes=(), w_shape=None, raw_override=None) -> onnx.ModelProto:
    """X -> LSTM -> Squeeze -> MatMul, weights as initializers."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((1, 4 * H, C)).astype(np.float32)
    R = rng.standard_normal((1, 4 * H, H)).astype(np.float32)
    Wt = numpy_helper.from_array(W, "W")
    if w_shape is not None:
        del Wt.dims[:]
        Wt.dims.extend(w_shape)
    if raw_override is not None:
        Wt.raw_data = raw_override
    inits = [
        Wt,
        numpy_helper.from_array(R, "R"),
        numpy_helper.from_array(rng.standard_normal((H, 2)).astype(np.float32), "head"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    nodes = [
        helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, name="lstm"),
        helper.make_node("Squeeze", ["Y", "axes"], ["y"], name="squeeze"),
        helper.make_node("MatMul", ["y", "head"], ["out"], name="head"),
        *extra_nodes,
    ]
    out = "out" if not extra_nodes else extra_nodes[-1].output[0]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", C])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _npz_bytes(arrays: dict) -> bytes:
    """An .npz like np.savez writes, with fixed timestamps so the fuzzer sees the same bytes
    on every run."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for k, v in sorted(arrays.items()):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(v), allow_pickle=False)
            z.writestr(
                zipfile.ZipInfo(f"{k}.npy", date_time=(2020, 1, 1, 0, 0, 0)), member.getvalue()
            )
    return buf.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    """Valid model files of every kind, as bytes."""
    d = tmp_path_factory.mktemp("valid")
    out = {"onnx": _lstm_onnx().SerializeToString()}
    (d / "m.onnx").write_bytes(out["onnx"])
    save(load(d / "m.onnx"), d / "graph.lrnn")
    save(GRU(4, 6, num_layers=2, seed=0), d / "stack.lrnn")
    m = LSTM(3, 5, seed=1)
    sd = m.state_dict()
    (d / "sd.npz").write_bytes(_npz_bytes(sd))
    for name in ("graph.lrnn", "stack.lrnn", "sd.npz"):
        out[name.split(".")[-1] if name == "sd.npz" else name.split(".")[0]] = (
            d / name
        ).read_bytes()
    torch = pytest.importorskip("torch")
    torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, d / "sd.pt")
    out["pt"] = (d / "sd.pt").read_bytes()
    for k, v in out.items():
        (d / f"check.{k}").write_bytes(v)
        load(d / f"check.{k}")  # all valid to begin with
    return out


def _load_bytes(tmp_path, data: bytes, name: str = "model.bin"):
    p = tmp_path / name
    p.write_bytes(data)
    return load(p)


def _expect_error(tmp_path, data: bytes, name="model.bin", cls=LeanRNNError) -> str:
    with pytest.raises(cls) as info:
        _load_bytes(tmp_path, data, name)
    msg = str(info.value)
    assert msg.startswith("[") and len(msg) > 30, msg  # "[operation] what came in; expected"
    return msg


# --------------------------------------------------------------------------------- truncation
@pytest.mark.parametrize("kind", ["onnx", "graph", "stack", "npz", "pt"])
def test_truncated_files_are_refused(files, tmp_path, kind):
    data = files[kind]
    cuts = sorted({0, 1, 7, 8, 9, 16, 100, len(data) // 3, len(data) // 2, len(data) - 1})
    for cut in cuts:
        _expect_error(tmp_path, data[:cut], f"m{cut}.{kind}")


def test_truncated_lrnn_names_the_problem(files, tmp_path):
    msg = _expect_error(tmp_path, files["stack"][:-100], "s.lrnn", ModelFormatError)
    assert "truncated" in msg or "data section" in msg


# --------------------------------------------------------------------------------- bit flips
@pytest.mark.parametrize("kind", ["stack", "graph"])
def test_every_bit_flip_in_a_native_file_is_caught(files, tmp_path, kind):
    """Header flips break the JSON, the sizes or the layout checks; data flips break the CRC."""
    data = bytearray(files[kind])
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    rng = np.random.default_rng(0)
    header_positions = range(0, 8 + n) if n < 2000 else rng.integers(0, 8 + n, 1500)
    data_positions = rng.integers(8 + n, len(data), 64)
    p = tmp_path / f"flip.{kind}"
    for pos in [*header_positions, *data_positions]:
        bit = 1 << int(rng.integers(0, 8))
        data[pos] ^= bit
        p.write_bytes(bytes(data))
        try:
            load(p)
        except LeanRNNError:
            pass
        else:
            # a flip that keeps the file valid must leave it meaning the same (e.g. JSON
            # whitespace padding turned into another whitespace character)
            assert bytes(data[pos : pos + 1]) in (b" ", b"\t", b"\n", b"\r"), pos
        data[pos] ^= bit


def test_data_bit_flip_reports_checksum(files, tmp_path):
    data = bytearray(files["stack"])
    data[-5] ^= 0x10
    msg = _expect_error(tmp_path, bytes(data), "f.lrnn", ModelFormatError)
    assert "checksum" in msg


# ---------------------------------------------------------------------- lies about sizes
def test_wrong_initializer_shape(tmp_path):
    m = _lstm_onnx(w_shape=[1, 20, 4])  # W holds 1*20*3 floats but claims 1*20*4
    msg = _expect_error(tmp_path, m.SerializeToString(), "w.onnx", WeightsError)
    assert "'W'" in msg and "[1, 20, 4]" in msg and "bytes" in msg


def test_initializer_shape_inconsistent_with_the_node(tmp_path):
    rng = np.random.default_rng(0)
    m = _lstm_onnx()
    bad = numpy_helper.from_array(rng.standard_normal((1, 20, 4)).astype(np.float32), "R")
    m.graph.initializer[1].CopyFrom(bad)  # R must be [1, 4H, H] = [1, 20, 5]
    msg = _expect_error(tmp_path, m.SerializeToString(), "r.onnx", WeightsError)
    assert "R has shape (1, 20, 4)" in msg and "[1, 20, 5]" in msg and "lstm" in msg


def test_absurd_initializer_dims_allocate_nothing(tmp_path):
    m = _lstm_onnx(w_shape=[1 << 20, 1 << 20, 1 << 20])
    tracemalloc.start()
    try:
        msg = _expect_error(tmp_path, m.SerializeToString(), "big.onnx", WeightsError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "declares" in msg and peak < 16 * MiB


def test_absurd_constant_of_shape_is_refused_at_load(tmp_path):
    huge = helper.make_node("ConstantOfShape", ["big_shape"], ["zeros"], name="bomb")
    add = helper.make_node("Add", ["out", "zeros"], ["sum"], name="add")
    m = _lstm_onnx(extra_nodes=[huge, add])
    m.graph.initializer.append(
        numpy_helper.from_array(np.array([1 << 20, 1 << 20], np.int64), "big_shape")
    )
    tracemalloc.start()
    try:
        msg = _expect_error(tmp_path, m.SerializeToString(), "bomb.onnx", ModelFormatError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "bomb" in msg and "refusing" in msg and peak < 16 * MiB


def _rewrite_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


@pytest.mark.parametrize("case", ["header_len", "tensor_shape", "spec_hidden", "offsets"])
def test_absurd_native_header_allocates_nothing(files, tmp_path, case):
    data = files["stack"]
    if case == "header_len":
        bad = struct.pack("<Q", 1 << 60) + data[8:]
    elif case == "tensor_shape":
        bad = _rewrite_header(data, lambda h: h["l0.d0.Wt"].update(shape=[1 << 40, 1 << 20]))
    elif case == "spec_hidden":

        def edit(h):
            spec = json.loads(h["__metadata__"]["spec"])
            spec["hidden_size"] = 1 << 30
            h["__metadata__"]["spec"] = json.dumps(spec)

        bad = _rewrite_header(data, edit)
    else:
        bad = _rewrite_header(data, lambda h: h["l0.d0.Wt"].update(data_offsets=[0, 1 << 50]))
    tracemalloc.start()
    try:
        _expect_error(tmp_path, bad, f"{case}.lrnn", ModelFormatError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB


def test_npz_member_lying_about_its_shape(tmp_path):
    import zipfile

    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4000000000,), }"
    npy = np.lib.format.magic(1, 0) + struct.pack("<H", 118) + header.ljust(117) + b"\n"
    p = tmp_path / "lie.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("weight_ih_l0.npy", npy + bytes(16))  # 4 floats, not 4e9
    msg = _expect_error(tmp_path, p.read_bytes(), "lie.npz", ModelFormatError)
    assert "declares" in msg and "holds 16" in msg


# ------------------------------------------------------------------------ pickles in disguise
class _Payload:
    """Unpickling this would create ``path`` (stands in for arbitrary code execution)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["model.pt", "model.onnx", "model.lrnn", "model.npz"])
def test_pickle_disguised_as_a_model_never_runs(tmp_path, name):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"weight_ih_l0": _Payload(str(marker))}, protocol=2)
    _expect_error(tmp_path, data, name, ModelFormatError)
    assert not marker.exists()


def test_malicious_torch_checkpoint_never_runs(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save({"weight_ih_l0": _Payload(str(marker))}, p)  # a real zip checkpoint
    assert not marker.exists()
    msg = _expect_error(tmp_path, p.read_bytes(), "evil.pt", ModelFormatError)
    assert "weights_only" in msg and not marker.exists()


def test_pickle_without_torch_is_refused_not_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    data = pickle.dumps({"weight_ih_l0": _Payload(str(marker))}, protocol=2)
    msg = _expect_error(tmp_path, data, "model.pt", ModelFormatError)
    assert "needs torch" in msg and not marker.exists()


# -------------------------------------------------------------------------------- unknown ops
def test_unknown_op_names_op_and_node(tmp_path):
    celu = helper.make_node("Celu", ["out"], ["c"], name="my_celu")
    m = _lstm_onnx(extra_nodes=[celu])
    msg = _expect_error(tmp_path, m.SerializeToString(), "celu.onnx", UnsupportedOpError)
    assert "'my_celu'" in msg and "'Celu'" in msg and "supported ops" in msg


def test_custom_domain_op_is_unsupported(tmp_path):
    node = helper.make_node("FusedThing", ["out"], ["f"], name="fused", domain="com.example")
    m = _lstm_onnx(extra_nodes=[node])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    msg = _expect_error(tmp_path, m.SerializeToString(), "custom.onnx", UnsupportedOpError)
    assert "com.example::FusedThing" in msg and "'fused'" in msg


def test_external_data_cannot_escape_the_model_directory(tmp_path):
    m = _lstm_onnx()
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../../etc/passwd"), ("offset", "0"), ("length", "240")):
        e = w.external_data.add()
        e.key, e.value = k, v
    msg = _expect_error(tmp_path, m.SerializeToString(), "ext.onnx", ModelFormatError)
    assert "relative path inside" in msg


# ------------------------------------------------------------------------------------ fuzzing
_mutation = st.tuples(
    st.sampled_from(["flip", "set", "truncate", "insert", "delete"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(0, 255),
)


def _mutate(data: bytes, mutations) -> bytes:
    b = bytearray(data)
    for op, where, value in mutations:
        if not b:
            break
        i = int(where * len(b))
        if op == "flip":
            b[i] ^= 1 << (value % 8)
        elif op == "set":
            b[i] = value
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b[i:i] = bytes([value]) * (1 + value % 4)
        else:
            del b[i : i + 1 + value % 4]
    return bytes(b)


def _try_to_use(model) -> None:
    """Run what loaded, on a small input, if its declared input is small."""
    if hasattr(model, "input_names"):
        feeds = {}
        for t in model.graph.inputs:
            dims = [d if isinstance(d, int) else 2 for d in (t.shape or ())]
            if not t.dtype or np.prod(dims) > 10_000:
                return
            feeds[t.name] = np.zeros(dims, t.dtype)
        model.run(feeds)
    else:
        model(np.zeros((2, 1, model.spec.input_size), model.dtype))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch on mutated bytes that look pickled
@pytest.mark.parametrize("kind", ["onnx", "graph", "stack", "npz"])
def test_fuzzed_files_fail_cleanly(files, tmp_path_factory, kind):
    path = tmp_path_factory.mktemp("fuzz") / f"fuzz.{kind}"

    @settings(
        max_examples=900,
        deadline=2000,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(_mutation, min_size=1, max_size=6))
    def fuzz(mutations):
        path.write_bytes(_mutate(files[kind], mutations))
        tracemalloc.start()  # traced only while loading: tracing hypothesis too is slow
        try:
            _try_to_use(load(path))
        except LeanRNNError as e:
            assert str(e)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 256 * MiB

    fuzz()
