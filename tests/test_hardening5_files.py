"""Hostile files, round five: a sub-kilobyte ONNX file folding into gigabytes, .npy headers that
break numpy's parser, duplicate initializers, absurd ranks and integers in safetensors headers,
torch's advice on refused pickles, empty external tensors, and what the .lrnn checksum sees."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile

import numpy as np
import pytest

from helpers import traced_peak
from leanrnn.engine.graph import passes
from leanrnn.errors import ModelFormatError
from leanrnn.formats import native
from leanrnn.loading import load, save

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

MiB = 1 << 20


def _save_onnx(path, nodes, inits, x_shape=(5, 1, 3), out="Y", opset=17) -> str:
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return str(path)


def _lstm_parts(H=4, C=3, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((1, 4 * H, C)).astype(np.float32)
    R = rng.standard_normal((1, 4 * H, H)).astype(np.float32)
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, name="lstm")
    return node, W, R


# ------------------------------------------------------------------------- 1. folding budget
def test_fold_skips_constant_nodes_whose_outputs_nobody_reads(tmp_path):
    """The red-team file: ConstantOfShape nodes of 64 MB each, outputs unused, in a file of
    under 1 KB. Nothing reads them, so folding must not make them at all."""
    lstm, W, R = _lstm_parts()
    nodes = [lstm] + [
        helper.make_node("ConstantOfShape", ["S"], [f"Z{i}"], name=f"z{i}") for i in range(3)
    ]
    inits = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(R, "R"),
        numpy_helper.from_array(np.array([4000, 4000], np.int64), "S"),
    ]
    p = _save_onnx(tmp_path / "unused.onnx", nodes, inits)
    assert os.path.getsize(p) < 1024
    with traced_peak() as mem:
        m = load(p)
    assert mem.peak < 8 * MiB, mem.peak
    y = m.run({"X": np.ones((5, 1, 3), np.float32)})[0]
    assert y.shape == (5, 1, 1, 4)


def _add_chain(tmp_path, k: int, shape, make) -> str:
    """X + f(Z0) + f(Z1) + ... with Zi = ConstantOfShape(shape): every folded value is read."""
    nodes, prev = [], "X"
    for i in range(k):
        nodes.append(helper.make_node("ConstantOfShape", ["S"], [f"Z{i}"], name=f"z{i}"))
        z = make(nodes, i)
        nodes.append(helper.make_node("Add", [prev, z], [f"A{i}"], name=f"add{i}"))
        prev = f"A{i}"
    inits = [
        numpy_helper.from_array(np.array(shape, np.int64), "S"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
    ]
    return _save_onnx(tmp_path / "chain.onnx", nodes, inits, x_shape=[1, shape[1]], out=prev)


def test_fold_budget_covers_all_folded_constants_alive(tmp_path, monkeypatch):
    """Each ConstantOfShape alone is under the limit (slack + the file's constants); together
    the ones alive are not. Refused before the one over budget is allocated."""
    monkeypatch.setattr(passes, "FOLD_SLACK_BYTES", MiB)
    p = _add_chain(tmp_path, 4, [256, 1024], lambda nodes, i: f"Z{i}")  # 1 MiB each
    with traced_peak() as mem, pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert msg.startswith("[load]") and "refusing" in msg and "ConstantOfShape" in msg, msg
    assert "z1" in msg and "folded constants alive" in msg, msg
    assert mem.peak < 3 * MiB, mem.peak


def test_fold_budget_counts_what_folding_creates_and_drops(tmp_path, monkeypatch):
    """ConstantOfShape then Gather of one row: little stays alive, but every node still makes
    512 KiB from nothing. That growth adds up over the pass and is refused too."""
    monkeypatch.setattr(passes, "FOLD_SLACK_BYTES", MiB)

    def row(nodes, i):
        nodes.append(helper.make_node("Gather", [f"Z{i}", "zero"], [f"G{i}"], name=f"g{i}"))
        return f"G{i}"

    p = _add_chain(tmp_path, 4, [128, 1024], row)  # 512 KiB each: never two alive at once
    with traced_peak() as mem, pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert "refusing" in msg and "z2" in msg and "ConstantOfShape" in msg, msg
    assert "beyond what it read" in msg, msg
    assert mem.peak < 3 * MiB, mem.peak


def test_fold_within_budget_still_folds(tmp_path, monkeypatch):
    monkeypatch.setattr(passes, "FOLD_SLACK_BYTES", MiB)
    p = _add_chain(tmp_path, 2, [64, 1024], lambda nodes, i: f"Z{i}")  # 256 KiB each
    m = load(p)
    x = np.ones((1, 1024), np.float32)
    np.testing.assert_array_equal(m.run({"X": x})[0], np.ones((64, 1024), np.float32))


def test_fold_budget_lets_weights_widen_at_load(tmp_path, monkeypatch):
    """float16 weights Cast to float32, int8 ones DequantizeLinear'd: the folded copies take
    twice / four times the file's bytes but hold no more values. A byte budget refused such
    models once their weights passed the slack (~22 MB of int8 at the real 64 MiB)."""
    monkeypatch.setattr(passes, "FOLD_SLACK_BYTES", MiB)
    H = C = 320  # W and R: 409,600 values each, 1.6 MB as float16 (more than the slack)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((1, 4 * H, C)).astype(np.float16)
    R = rng.standard_normal((1, 4 * H, H)).astype(np.float16)
    casts = [helper.make_node("Cast", [n + "16"], [n], to=TensorProto.FLOAT) for n in "WR"]
    lstm = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, name="lstm")
    p16 = _save_onnx(tmp_path / "f16.onnx", [*casts, lstm],
                     [numpy_helper.from_array(W, "W16"), numpy_helper.from_array(R, "R16")],
                     x_shape=(2, 1, C))  # fmt: skip
    p32 = _save_onnx(tmp_path / "f32.onnx", [lstm],
                     [numpy_helper.from_array(W.astype(np.float32), "W"),
                      numpy_helper.from_array(R.astype(np.float32), "R")], x_shape=(2, 1, C))  # fmt: skip
    x = rng.standard_normal((2, 1, C)).astype(np.float32)
    np.testing.assert_array_equal(load(p16).run({"X": x})[0], load(p32).run({"X": x})[0])

    # int8 weights, 4 bytes a value once dequantized, chained into a MatMul
    q = rng.integers(-127, 128, (C, 1024)).astype(np.int8)  # 327,680 values: 4x in bytes
    dq = helper.make_node("DequantizeLinear", ["Q", "s", "z"], ["Wq"])
    mm = helper.make_node("MatMul", ["X", "Wq"], ["Y"])
    inits = [numpy_helper.from_array(q, "Q"), numpy_helper.from_array(np.float32(0.01), "s"),
             numpy_helper.from_array(np.int8(0), "z")]  # fmt: skip
    pq = _save_onnx(tmp_path / "q.onnx", [dq, mm], inits, x_shape=(2, C))
    xq = rng.standard_normal((2, C)).astype(np.float32)
    want = xq.astype(np.float64) @ (q.astype(np.float64) * np.float32(0.01))
    np.testing.assert_allclose(load(pq).run({"X": xq})[0], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- 2. .npy header in .npz
def _npz_with_header(path, header: bytes, data: int):
    header = header + b" " * ((-(10 + len(header) + 1)) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\0" * data
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("weight_ih_l0.npy", npy)
    return str(path)


@pytest.mark.parametrize(
    "header, data",
    [
        (b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 3", 48),  # tokenize.TokenError
        (b"{'descr': '<f4', 'fortran_order': False, 'shape': " + b"(" * 300 + b")" * 300, 48),
        (b"{'descr': '<f4', 'fortran_order': False, 'shape': (" + b"1, " * 100 + b")}", 4),
        (b"{'descr': '<f4', 'fortran_order': False, 'shape': (-4, -3)}", 48),
    ],
    ids=["unterminated", "nested", "rank100", "negative"],
)
def test_npz_malformed_member_header_names_file_and_member(tmp_path, header, data):
    p = _npz_with_header(tmp_path / "x.npz", header, data)
    with pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert msg.startswith("[load]") and "x.npz" in msg and "weight_ih_l0.npy" in msg, msg
    assert "header" in msg, msg


# ---------------------------------------------------------------- 3. duplicate initializers
def test_onnx_duplicate_initializer_is_refused(tmp_path):
    lstm, W, R = _lstm_parts()
    inits = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(R, "R"),
        numpy_helper.from_array(W + 1, "W"),
    ]
    p = _save_onnx(tmp_path / "dup.onnx", [lstm], inits)
    with pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert msg.startswith("[load_onnx]") and "'W'" in msg and "initializers" in msg, msg


# ----------------------------------------------------------- 4. safetensors: rank, big ints
def _safetensors(path, header: bytes, data: bytes = b"") -> str:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)
    return str(path)


def test_safetensors_rank_over_numpy_limit_is_a_format_error(tmp_path):
    h = json.dumps(
        {"weight_ih_l0": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}
    ).encode()
    p = _safetensors(tmp_path / "rank.safetensors", h, b"\0" * 4)
    with pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert "weight_ih_l0" in msg and "100 dims" in msg and "64" in msg, msg


def test_safetensors_huge_json_integer_is_a_format_error(tmp_path):
    h = b'{"a":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,4]}}'
    p = _safetensors(tmp_path / "bigint.safetensors", h, b"\0" * 4)
    with pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert msg.startswith("[load]") and "header" in msg, msg
    assert "set_int_max_str_digits" not in msg, msg


def test_graph_lrnn_const_entry_of_rank_100_is_a_format_error(tmp_path):
    lstm, W, R = _lstm_parts()
    nodes = [lstm, helper.make_node("Add", ["Y", "k"], ["Z"], name="add")]
    inits = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(R, "R"),
        numpy_helper.from_array(np.ones((1,), np.float32), "k"),
    ]
    save(load(_save_onnx(tmp_path / "g.onnx", nodes, inits, out="Z")), tmp_path / "g.lrnn")
    data = (tmp_path / "g.lrnn").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k.startswith("const:"))
    header[key]["shape"] = [1] * 100
    p = _safetensors(tmp_path / "dims.lrnn", json.dumps(header).encode(), data[8 + n :])
    with pytest.raises(ModelFormatError) as info:
        load(p)
    assert key in str(info.value) and "dims" in str(info.value), str(info.value)


# -------------------------------------------------------------------- 5. refused pickles
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_refused_pickle_names_the_global_and_gives_no_unsafe_advice(tmp_path):
    pytest.importorskip("torch")
    p = tmp_path / "evil.pt"
    p.write_bytes(b"\x80\x02" + pickle.dumps({"w": _Evil()}, protocol=2)[2:])
    with pytest.raises(ModelFormatError) as info:
        load(p)
    msg = str(info.value)
    assert f"{os.system.__module__}.system" in msg, msg  # posix.system: the refused global
    assert "never" in msg and "unpickl" in msg, msg
    assert "False" not in msg and "Re-running" not in msg, msg


# -------------------------------------------------------------- 6. empty external tensors
def test_empty_external_initializer_reads_as_empty_array(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    E = TensorProto()
    E.name, E.data_type = "E", TensorProto.FLOAT
    E.dims.extend([0, 3])
    E.data_location = TensorProto.EXTERNAL
    e = E.external_data.add()
    e.key, e.value = "location", "empty.bin"
    n = helper.make_node("Concat", ["E", "X"], ["Z"], axis=0, name="cat")
    p = _save_onnx(tmp_path / "m.onnx", [n], [E], x_shape=[2, 3], out="Z")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(load(p).run({"X": x})[0], x)


# --------------------------------------------------------------- 7. what the checksum sees
def test_region_digest_catches_and_misses_what_its_docstring_says():
    rng = np.random.default_rng(0)
    b = native._BLOCK_WORDS
    words = rng.integers(0, 2**63, 4 * b, dtype=np.uint64)
    bit = np.uint64(1 << 7)
    words[1] |= bit  # word 1 has bit 7 set, word 2 has it clear
    words[2] &= ~bit
    base = native._region_digest(words)

    def digest(edit) -> str:
        w = words.copy()
        edit(w)
        return native._region_digest(w)

    def swap(w, i, j):
        w[i], w[j] = w[j].copy(), w[i].copy()

    # caught: one flipped bit, one changed word, two whole blocks swapped
    assert digest(lambda w: w.__setitem__(5, w[5] ^ np.uint64(8))) != base
    assert digest(lambda w: w.__setitem__(5, w[5] + np.uint64(12345))) != base
    assert digest(lambda w: swap(w, slice(0, b), slice(b, 2 * b))) != base
    # missed: two words swapped inside one block; the same bit flipped 1 -> 0 in one word
    # and 0 -> 1 in another of the same block
    assert digest(lambda w: swap(w, 1, 2)) == base

    def opposite_flips(w):
        w[1] ^= bit  # 1 -> 0
        w[2] ^= bit  # 0 -> 1

    assert digest(opposite_flips) == base
    doc = " ".join(native._region_digest.__doc__.split())
    assert "does not" in doc and "within one block" in doc and "swapped or moved" not in doc, doc
