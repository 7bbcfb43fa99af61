"""Hostile model files: truncated, bit-flipped, lying about shapes and sizes, pickles in disguise,
unknown ops, and a bounded fuzzer over valid files. Each must end in a leanrnn error with a
message that says what is wrong — never a crash, a hang, code execution or a giant allocation."""

from __future__ import annotations

import contextlib
import json
import pickle
import signal
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import traced_peak
from leanrnn.errors import LeanRNNError, ModelFormatError, UnsupportedOpError, WeightsError
from leanrnn.formats import native
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
    with traced_peak() as mem:
        msg = _expect_error(tmp_path, m.SerializeToString(), "big.onnx", WeightsError)
    assert "declares" in msg and mem.peak < 16 * MiB


def test_absurd_constant_of_shape_is_refused_at_load(tmp_path):
    huge = helper.make_node("ConstantOfShape", ["big_shape"], ["zeros"], name="bomb")
    add = helper.make_node("Add", ["out", "zeros"], ["sum"], name="add")
    m = _lstm_onnx(extra_nodes=[huge, add])
    m.graph.initializer.append(
        numpy_helper.from_array(np.array([1 << 20, 1 << 20], np.int64), "big_shape")
    )
    with traced_peak() as mem:
        msg = _expect_error(tmp_path, m.SerializeToString(), "bomb.onnx", ModelFormatError)
    assert "bomb" in msg and "refusing" in msg and mem.peak < 16 * MiB


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
    with traced_peak() as mem:
        _expect_error(tmp_path, bad, f"{case}.lrnn", ModelFormatError)
    assert mem.peak < 16 * MiB


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
    if hasattr(model, "graph"):  # both kinds have input_names now (one model protocol)
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
        with traced_peak() as mem:  # traced only while loading: tracing hypothesis too is slow
            try:
                _try_to_use(load(path))
            except LeanRNNError as e:
                assert str(e)
        assert mem.peak < 256 * MiB

    fuzz()


# ------------------------------------------------ declared counts bounded by what a file holds
@contextlib.contextmanager
def _no_hang(seconds: int = 20):
    """Fail (not hang the suite) if the body runs for minutes: a regression of a check that
    bounds work by the file makes these loads loop 2**31 times. Not a timing assertion: the
    bound is orders of magnitude above the milliseconds a refusal takes."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: work proportional to a declared size")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _rechecksummed(data: bytes, spec=None, graph=None) -> bytes:
    """``data`` (a .lrnn file) with its spec (kind "rnn") or graph JSON (kind "graph") edited by
    the given function and the checksum recomputed as the writer computes it: one region per
    packed RNN, in header order, then one for all constants. A hostile file that passes the
    integrity check, so only the size and consistency checks stand in its way."""
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    meta = header["__metadata__"]
    for key, edit in (("spec", spec), ("graph", graph)):
        if edit is not None:
            value = json.loads(meta[key])
            edit(value)
            meta[key] = json.dumps(value)
    offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    if meta["kind"] == "graph":
        prefixes = [f"rnn:{k}:" for k in json.loads(meta["graph"]).get("packed", {})] + ["const:"]
    else:
        prefixes = [""]
    regions = []
    for prefix in prefixes:
        spans = [o for k, o in offsets.items() if k.startswith(prefix)]
        lo, hi = min((o[0] for o in spans), default=0), max((o[1] for o in spans), default=0)
        if hi > lo:
            regions.append(np.frombuffer(body[lo:hi], np.uint8))
    del meta["checksum"]
    meta["checksum"] = native._checksum(meta, regions, int(meta["version"]))
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    return struct.pack("<Q", len(text)) + text + body


def _set(**kv):
    return lambda d: d.update(kv)


def _set_packed(**kv):
    return lambda g: g["packed"]["lstm"]["spec"].update(kv)


def _set_lstm_attrs(**kv):
    return lambda g: next(n for n in g["nodes"] if n["name"] == "lstm")["attrs"].update(kv)


def test_rechecksummed_file_is_valid(files, tmp_path):
    # the helper's checksum is the writer's: without an edit, the rewritten files load
    for kind in ("stack", "graph"):
        _load_bytes(tmp_path, _rechecksummed(files[kind]), f"same.{kind}.lrnn")


_HUGE_SPECS = {
    "layers": _set(num_layers=1 << 31),
    "layers_bidirectional": _set(num_layers=1 << 31, direction="bidirectional", activations=None),
    "hidden": _set(hidden_size=1 << 40),
    "input": _set(input_size=1 << 40),
    "all": _set(num_layers=1 << 31, hidden_size=1 << 40, input_size=1 << 40),
}


@pytest.mark.parametrize("case", sorted(_HUGE_SPECS))
def test_checksum_valid_stack_with_huge_declared_sizes(files, tmp_path, case):
    bad = _rechecksummed(files["stack"], spec=_HUGE_SPECS[case])
    with traced_peak() as mem:
        with _no_hang():
            msg = _expect_error(tmp_path, bad, f"{case}.lrnn", ModelFormatError)
    assert "the file holds 16 tensors" in msg and "checksum mismatch" not in msg, msg
    assert mem.peak < 16 * MiB


@pytest.mark.parametrize("case", ["layers", "hidden", "hidden_and_attr"])
def test_checksum_valid_graph_with_huge_declared_sizes(files, tmp_path, case):
    if case == "layers":
        edit = _set_packed(num_layers=1 << 31)
    elif case == "hidden":
        edit = _set_packed(hidden_size=1 << 40)
    else:  # the node agrees with its packed spec: only the file's bytes can refuse it

        def edit(g):
            _set_packed(hidden_size=1 << 40)(g)
            _set_lstm_attrs(hidden_size=1 << 40)(g)

    bad = _rechecksummed(files["graph"], graph=edit)
    with traced_peak() as mem:
        with _no_hang():
            msg = _expect_error(tmp_path, bad, f"g_{case}.lrnn", ModelFormatError)
    assert "the file holds 8 tensors" in msg and "'lstm'" in msg, msg
    assert mem.peak < 16 * MiB


def test_inspect_of_a_huge_declared_stack_ends_in_an_error(files, tmp_path, capsys):
    from leanrnn.cli import main

    p = tmp_path / "layers.lrnn"
    p.write_bytes(_rechecksummed(files["stack"], spec=_set(num_layers=1 << 31)))
    with _no_hang():
        assert main(["inspect", str(p)]) == 1
    assert "layers=2147483648" in capsys.readouterr().err


@pytest.mark.parametrize("dims", [[-1, "N", 3], [1.5, "N", 3], [{"a": 1}, "N", 3]])
def test_graph_input_dims_must_be_counts_names_or_unknown(files, tmp_path, dims):
    bad = _rechecksummed(files["graph"], graph=lambda g: g["inputs"][0].update(shape=dims))
    msg = _expect_error(tmp_path, bad, "dims.lrnn", ModelFormatError)
    assert "shape" in msg and "expected ints >= 0" in msg


def test_state_dict_layer_index_is_bounded_by_the_layers_present(tmp_path):
    sd = LSTM(3, 5, seed=1).state_dict()
    sd["weight_ih_l536870912"] = sd["weight_ih_l0"]
    with _no_hang():
        msg = _expect_error(tmp_path, _npz_bytes(sd), "layers.npz", WeightsError)
    assert "layer 536870912" in msg and "2 distinct layers" in msg
    sd = LSTM(3, 5, seed=1).state_dict()
    sd["weight_ih_l" + "9" * 5000] = sd["weight_ih_l0"]  # int() of it alone would refuse
    msg = _expect_error(tmp_path, _npz_bytes(sd), "digits.npz", WeightsError)
    assert "unexpected keys ['weight_ih_l999" in msg


# ------------------------------------------------------------------------------- zip bombs
def _deflated_zeros_member(z, name: str, nbytes: int, head: bytes = b"") -> None:
    """A deflated member: ``head`` then ``nbytes`` zero bytes (a multiple of 1 MiB)."""
    import zipfile

    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    chunk = bytes(1 << 20)
    with z.open(info, "w", force_zip64=True) as f:
        f.write(head)
        for _ in range(nbytes >> 20):
            f.write(chunk)


def _torch_bomb(path, inflate: int) -> None:
    """A real torch.save zip checkpoint, re-written with deflate, whose storage record
    declares (and inflates to) ``inflate`` bytes of zeros."""
    import io
    import zipfile

    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"weight_ih_l0": torch.zeros(4)}, buf)
    src = zipfile.ZipFile(buf)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                _deflated_zeros_member(out, info.filename, inflate)
            else:
                out.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED)


_PEAK_RSS = """
import sys
import torch
from leanrnn.errors import ModelFormatError
from leanrnn.loading import load

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = status("VmRSS:")
try:
    load(sys.argv[1])
    print("loaded")
except ModelFormatError as e:
    print(e)
print(status("VmHWM:") - before)
"""


def test_deflated_torch_checkpoint_is_refused_before_it_inflates(tmp_path):
    # torch.load's reader inflates a whole record before checking it, in C++ (tracemalloc
    # cannot see it): measure the peak RSS of a fresh process, after its imports
    import os
    import subprocess

    p = tmp_path / "bomb.pt"
    _torch_bomb(p, 64 * MiB)
    assert p.stat().st_size < MiB
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(p)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert "claims to inflate" in out[0] and "zip bomb" in out[0], out
    assert int(out[-1]) < 16 * MiB, out


def test_zip_members_together_may_not_inflate_past_the_cap(tmp_path):
    # each member an honest .npy of 1 MiB of zeros, within its own cap (1 MiB of slack); 48
    # of them inflate far beyond the archive's cap
    import io
    import zipfile

    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        npy, {"descr": "<f4", "fortran_order": False, "shape": (MiB // 4,)}
    )
    p = tmp_path / "many.npz"
    with zipfile.ZipFile(p, "w") as z:
        for i in range(48):
            _deflated_zeros_member(z, f"weight_ih_l{i}.npy", MiB, npy.getvalue())
    with traced_peak() as mem:
        msg = _expect_error(tmp_path, p.read_bytes(), "many.npz", ModelFormatError)
    assert "in all" in msg and "zip bomb" in msg and mem.peak < 8 * MiB


def test_stored_zip_member_lying_about_its_size_is_refused(files, tmp_path):
    # a stored (uncompressed) member's size is its stored size; the central directory's
    # file_size field says otherwise here
    import io
    import zipfile

    data = bytearray(files["pt"])
    z = zipfile.ZipFile(io.BytesIO(bytes(data)))
    info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    cd = data.index(info.filename.encode(), z.start_dir) - 46  # its central directory record
    assert data[cd : cd + 4] == b"PK\x01\x02"
    data[cd + 24 : cd + 28] = struct.pack("<I", 1 << 31)  # uncompressed size
    msg = _expect_error(tmp_path, bytes(data), "lying.pt", ModelFormatError)
    assert "claims to inflate" in msg


def test_torch_tensor_larger_than_its_storage_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    p = tmp_path / "expand.pt"
    torch.save({"weight_ih_l0": torch.zeros(1).expand(1 << 24)}, p)  # 64 MiB over 4 bytes
    msg = _expect_error(tmp_path, p.read_bytes(), "expand.pt", ModelFormatError)
    assert "larger than its storage" in msg and "[16777216]" in msg


def test_torch_views_within_their_storage_still_load(tmp_path):
    torch = pytest.importorskip("torch")
    from leanrnn.formats.checkpoint import read_torch

    m = torch.nn.GRU(3, 4, num_layers=2, bidirectional=True)
    sd = dict(m.state_dict())
    sd["transposed"] = sd["weight_ih_l0"].t()  # non-contiguous, within its storage
    torch.save(sd, tmp_path / "views.pt")
    got = read_torch(str(tmp_path / "views.pt"))
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(got[k], v.numpy())


# ------------------------------------------ graph .lrnn: the ONNX importer's checks, same file
@pytest.mark.parametrize(
    "case",
    ["hidden_size", "activation", "clip", "input_forget", "direction", "layout", "activations"],
)
def test_graph_node_contradicting_its_packed_spec_is_refused(files, tmp_path, case):
    edit, want = {
        "hidden_size": (_set_lstm_attrs(hidden_size=7), "hidden_size 7"),
        "activation": (
            _set_lstm_attrs(activations=[["sigmoid", 0, 0], ["relu", 0, 0], ["tanh", 0, 0]]),
            "disagree on activations",
        ),
        "clip": (_set_lstm_attrs(clip=3.0), "disagree on clip"),
        "input_forget": (_set_lstm_attrs(input_forget=True), "disagree on input_forget"),
        "direction": (_set_lstm_attrs(direction="sideways"), "direction='sideways'"),
        "layout": (_set_lstm_attrs(layout=2), "layout=2"),
        "activations": (_set_lstm_attrs(activations=[["sigmoid", 0, 0]]), "1 activations"),
    }[case]
    bad = _rechecksummed(files["graph"], graph=edit)
    msg = _expect_error(tmp_path, bad, f"{case}.lrnn", ModelFormatError)
    assert want in msg and "'lstm'" in msg and "checksum mismatch" not in msg, msg


@pytest.mark.parametrize("opset", [0, -3, 10**6, "17", 17.0, None])
def test_graph_with_an_invalid_opset_is_refused_like_onnx(files, tmp_path, opset):
    bad = _rechecksummed(files["graph"], graph=_set(opset=opset))
    msg = _expect_error(tmp_path, bad, "opset.lrnn", ModelFormatError)
    assert f"declares default-domain opset {opset!r}" in msg
    if isinstance(opset, int):  # the ONNX path refuses the same opset with the same check
        m = _lstm_onnx()
        m.opset_import[0].version = opset
        msg = _expect_error(tmp_path, m.SerializeToString(), "opset.onnx", ModelFormatError)
        assert f"declares default-domain opset {opset!r}" in msg


def test_packed_weights_of_a_non_rnn_node_are_refused(files, tmp_path):
    def edit(g):
        g["packed"]["head"] = g["packed"].pop("lstm")

    bad = _rechecksummed(files["graph"], graph=edit)
    msg = _expect_error(tmp_path, bad, "head.lrnn", ModelFormatError)
    assert "'head'" in msg and "no LSTM/GRU/RNN node" in msg


@pytest.mark.parametrize("name", [5, None, ["tanh"]])
def test_spec_with_a_non_string_activation_name_is_a_format_error(files, tmp_path, name):
    def edit(spec):
        spec["activations"] = [[{"name": name}, {"name": "tanh"}]]

    bad = _rechecksummed(files["stack"], spec=edit)
    msg = _expect_error(tmp_path, bad, "act.lrnn", ModelFormatError)
    assert "unknown activation" in msg
