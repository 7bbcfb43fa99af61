"""Session 44, from a red-team pass on the file system (not file contents): a file replaced
while it was being read was read as a mix of two versions, silently. `score` read each input's
header (a .npy's shape, a Parquet footer) before any work and its data later, through the file
opened again by name; `load` of an ONNX file parsed its skeleton, then opened it again by name
for each tensor and read at the old skeleton's offsets."""

from __future__ import annotations

import os
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# The rest of that pass: a score output replaced came back 0644 over a 0600 file; a path with
# '=' given to serve was split as NAME=PATH; `bench --from-json` read a FIFO for ever (and
# /dev/zero until memory ran out) and an --out that is a file ended in FileExistsError; a
# FIFO at the build's wisdom.json blocked every process's first training step; a relative
# LEANRNN_CACHE_DIR moved with each chdir (a kernel build of 3-11 minutes after each).


@pytest.mark.parametrize("ext", [".npz", ".parquet"])
def test_a_score_output_replaced_keeps_its_mode(tmp_path, ext):
    if ext == ".parquet":
        pytest.importorskip("pyarrow")
    x = np.random.default_rng(3).standard_normal((3, 4, 2)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / f"out{ext}"
    out.write_bytes(b"old")
    out.chmod(0o600)
    leanrnn.score(leanrnn.GRU(2, 3, seed=0), str(tmp_path / "x.npy"), str(out))
    assert out.stat().st_mode & 0o777 == 0o600 and out.stat().st_size > 3


def test_a_serve_path_holding_an_equals_sign_is_not_split(tmp_path, monkeypatch):
    import argparse

    from leanrnn.commands.serve import _model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run=3.lrnn").write_bytes(b"x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"holds '='.*run_3=run=3.lrnn"):
        _model("run=3.lrnn")
    assert _model("run_3=run=3.lrnn") == ("run_3", "run=3.lrnn")
    assert _model("a=elsewhere.lrnn") == ("a", "elsewhere.lrnn")  # (no such file: NAME=PATH)


def _cli(*args, timeout=60):
    import subprocess
    import sys

    from helpers import src_env

    return subprocess.run([sys.executable, "-m", "leanrnn", *args], capture_output=True,
                          text=True, timeout=timeout, env=src_env())  # fmt: skip


def test_bench_from_json_refuses_a_fifo_and_an_out_that_is_a_file(tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    r = _cli("bench", "--from-json", str(fifo))  # (waited for a writer for ever)
    assert r.returncode != 0 and "not a regular file" in r.stderr, r.stderr
    good = tmp_path / "good.json"
    good.write_text('{"rows": []}')
    (tmp_path / "taken").write_text("a file")
    r = _cli("bench", "--from-json", str(good), "--out", str(tmp_path / "taken"), "--no-plots")
    assert r.returncode != 0 and "expected a directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_fifo_in_the_build_s_wisdom_does_not_block(tmp_path, monkeypatch):
    from leanrnn.engine import products

    os.mkfifo(tmp_path / "wisdom.json")
    os.mkfifo(tmp_path / "wisdom.lock")
    monkeypatch.setattr(products, "_wisdom_path", lambda: tmp_path / "wisdom.json")
    assert products._remembered() is None  # (read for ever before)
    with products._wisdom_lock():  # (opened for ever before: no lock then, as without fcntl)
        pass


def test_a_relative_cache_dir_is_the_start_directory_s(tmp_path, monkeypatch):
    from leanrnn import config

    monkeypatch.setenv("LEANRNN_CACHE_DIR", "rel-cache")
    monkeypatch.chdir(tmp_path)
    assert config.cache_dir() == Path(config._START_DIR) / "rel-cache"
    monkeypatch.delenv("LEANRNN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # invalid (XDG): ignored
    assert config.cache_dir() == Path.home() / ".cache" / "leanrnn"


def test_an_onnx_model_of_many_external_files_loads_within_a_small_descriptor_limit(tmp_path):
    """A review of the fix above: it kept every external data file open for the whole load,
    and a model saved one file per tensor failed with "Too many open files"."""
    import resource
    import subprocess
    import sys

    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto as P
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from helpers import src_env

    rng = np.random.default_rng(6)
    names = [f"c{k}" for k in range(80)]
    inits = [nh.from_array(rng.standard_normal(8).astype(np.float32), n) for n in names]
    outs = [f"s{k}" for k in range(79)] + ["y"]
    nodes = [h.make_node("Add", [a, c], [o])
             for a, c, o in zip(["x", *outs[:-1]], names, outs, strict=True)]  # fmt: skip
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", P.FLOAT, [8])],
                     [h.make_tensor_value_info("y", P.FLOAT, [8])], inits)  # fmt: skip
    path = tmp_path / "many.onnx"
    onnx.save_model(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0)  # fmt: skip
    assert len(list(tmp_path.iterdir())) > 80
    want = sum(nh.to_array(t) for t in inits)
    code = (
        "import resource, numpy as np, leanrnn;"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (60, 60));"
        f"m = leanrnn.load({str(path)!r});"
        "print(repr(m(np.zeros(8, np.float32)).tolist()))"
    )
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 60
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=src_env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(eval(r.stdout), want, rtol=1e-6)


def test_a_ray_output_directory_made_new_has_the_umask_s_mode(tmp_path):
    """score --ray staged a new OUTPUT directory with mkdtemp (0700) and renamed it into
    place: other users could not read the results."""
    from leanrnn._files import current_umask
    from leanrnn.ray import _move_in, _staging

    out = str(tmp_path / "results")
    tmp = _staging(out)
    (Path(tmp) / "part-0.parquet").write_bytes(b"x")
    _move_in(tmp, out)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~current_umask()
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
    finally:
        os.umask(old)
