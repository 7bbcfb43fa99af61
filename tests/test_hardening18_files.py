"""Session 44, from a red-team pass on the file system (not file contents): a file replaced
while it was being read was read as a mix of two versions, silently. `score` read each input's
header (a .npy's shape, a Parquet footer) before any work and its data later, through the file
opened again by name; `load` of an ONNX file parsed its skeleton, then opened it again by name
for each tensor and read at the old skeleton's offsets."""

from __future__ import annotations

import os

import numpy as np
import pytest

import leanrnn
from leanrnn.score.data import DataError, Source


def test_an_npy_replaced_after_its_header_was_read_is_refused(tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 6, 3)).astype(np.float32)
    path = str(tmp_path / "b.npy")
    np.save(path, x)
    src = Source(path, 3, np.float32)
    np.save(tmp_path / "new.npy", x.reshape(4, 3, 3))  # same bytes, another shape
    os.replace(tmp_path / "new.npy", path)
    with pytest.raises(DataError, match="changed while it was being scored"):
        list(src.pieces(1 << 20))
    # (it scored 2 rows of the new bytes read as [2, 6, 3]); the file as it is now reads
    pieces = list(Source(path, 3, np.float32).pieces(1 << 20))
    assert sum(len(p.seqs) for p in pieces) == 4


def test_an_npz_replaced_after_its_header_was_read_is_refused(tmp_path):
    x = np.random.default_rng(1).standard_normal((2, 6, 3)).astype(np.float32)
    path = str(tmp_path / "b.npz")
    np.savez(path, x=x)
    src = Source(path, 3, np.float32)
    np.savez(tmp_path / "new.npz", x=x.reshape(4, 3, 3))
    os.replace(tmp_path / "new.npz", path)
    with pytest.raises(DataError, match="changed while it was being scored"):
        list(src.pieces(1 << 20))


def test_a_parquet_file_replaced_after_its_footer_was_read_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def write(path, n):
        seqs = [np.full((3, 2), k, np.float32).tolist() for k in range(n)]
        pq.write_table(pa.table({"x": seqs}), path)

    path = str(tmp_path / "b.parquet")
    write(path, 2)
    src = Source(path, 2, np.float32)
    write(str(tmp_path / "new.parquet"), 5)
    os.replace(tmp_path / "new.parquet", path)
    with pytest.raises(DataError, match="changed while it was being scored"):
        list(src.pieces(1 << 20))  # (it read 2 of the new file's 5 rows)


def test_an_onnx_file_replaced_in_the_middle_of_its_load_is_read_whole(tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto as P
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from leanrnn.formats import onnx_import

    rng = np.random.default_rng(2)
    inits = [nh.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in (("W", (1, 16, 3)), ("R", (1, 16, 4)), ("B", (1, 32)))]  # fmt: skip
    g = h.make_graph([h.make_node("LSTM", ["x", "W", "R", "B"], ["Y"], hidden_size=4)], "g",
                     [h.make_tensor_value_info("x", P.FLOAT, [5, 2, 3])],
                     [h.make_tensor_value_info("Y", P.FLOAT, None)], inits)  # fmt: skip
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    model.doc_string = "retrained " * 40  # the same model, its bytes 400 further on
    onnx.save(model, str(tmp_path / "new.onnx"))
    strip = onnx_import._strip_raw_data

    def strip_then_replaced(*args):
        out = strip(*args)
        os.replace(tmp_path / "new.onnx", path)  # a deployer's atomic replace lands now
        return out

    monkeypatch.setattr(onnx_import, "_strip_raw_data", strip_then_replaced)
    m = leanrnn.load(path)
    x = rng.standard_normal((5, 2, 3)).astype(np.float32)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(m.run({"x": x})[0], want[0], rtol=0, atol=1e-5)  # (0.94 off)
