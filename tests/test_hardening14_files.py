"""Session 40, from a red-team pass on model files across versions and processes: a load
during another process's atomic save mixed the two files (the path was opened by name three
times: size, header, data), a re-saved private model came back world-readable, and weights
shared by several RNN nodes of a graph were written, read and quantized once per node."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import ModelFormatError
from leanrnn.formats import native
from leanrnn.spec import RNNSpec


def _swap_after_header(monkeypatch, path, other):
    """Replace ``path`` by ``other`` (os.replace, as an atomic save does) right after its
    header was read, before the data is."""
    real = native._read_header

    def read_then_swap(*a, **k):
        out = real(*a, **k)
        os.replace(other, path)
        return out

    monkeypatch.setattr(native, "_read_header", read_then_swap)


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_during_an_atomic_replace_reads_one_file_whole(tmp_path, monkeypatch, verify):
    # same spec and size, other weights and batch_first: before, verify=True said "checksum
    # mismatch ... the file is corrupt" and verify=False gave one file's spec with the other's
    # weights
    a, b = leanrnn.LSTM(4, 8, seed=1), leanrnn.LSTM(4, 8, seed=2, batch_first=True)
    path, other = tmp_path / "m.lrnn", tmp_path / "new.lrnn"
    a.save(path)
    b.save(other)
    _swap_after_header(monkeypatch, path, other)
    got = native.load(path, verify=verify)
    assert got.buffer.tobytes() == a.weights.buffer.tobytes() and not got.spec.batch_first
    monkeypatch.undo()
    assert leanrnn.load(path).weights.buffer.tobytes() == b.weights.buffer.tobytes()


def test_resaving_a_model_keeps_the_files_permissions(tmp_path):
    path = tmp_path / "private.lrnn"
    m = leanrnn.GRU(3, 5, seed=0)
    m.save(path)
    os.chmod(path, 0o600)
    m.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fresh = tmp_path / "fresh.lrnn"
    m.save(fresh)  # a new file: the umask's mode, as open() gives
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o666 & ~umask


def test_a_file_too_short_for_its_spec_says_it_may_be_another_versions(tmp_path):
    path = tmp_path / "m.lrnn"
    leanrnn.LSTM(4, 8, seed=0).save(path)
    c = native._Container(str(path), "load")
    spec = native._spec(c.metadata["spec"], "load", str(path)).to_dict()
    spec["hidden_size"] = 64  # the file holds H=8's bytes
    with pytest.raises(ModelFormatError, match="another version: re-convert it"):
        native._check_packed(c, "", RNNSpec.from_dict(spec), np.dtype(np.float32))


# ---------------------------------------------------------------- weights shared by RNN nodes
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _decoder(path, steps=3, H=8):
    """An unrolled decoder as exporters write one: ``steps`` GRU nodes on the same W and R."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, prev = [], "x"
    for k in range(steps):
        nodes += [
            helper.make_node(
                "GRU", [prev, "W", "R"], [f"Y{k}", f"h{k}"], name=f"step{k}", hidden_size=H
            ),
            helper.make_node("Squeeze", [f"Y{k}", "ax"], [f"s{k}"]),
        ]
        prev = f"s{k}"
    inits = [
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, 3 * H, H)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, 3 * H, H)).astype(np.float32), "R"),
        numpy_helper.from_array(np.array([1], np.int64), "ax"),
    ]
    g = helper.make_graph(
        nodes, "dec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", H])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, path)
    return np.random.default_rng(1).standard_normal((5, 2, H)).astype(np.float32)


def _distinct(model) -> int:
    return len({id(pw) for pw in model.graph.packed.values()})


def test_weights_shared_by_rnn_nodes_are_written_read_and_quantized_once(tmp_path):
    # before: 3 regions in the file, 3 packings after its load and after quantize
    x = _decoder(tmp_path / "d.onnx")
    (want,) = ort.InferenceSession(str(tmp_path / "d.onnx")).run(None, {"x": x})
    m = leanrnn.load(tmp_path / "d.onnx")
    assert _distinct(m) == 1
    m.save(tmp_path / "d.lrnn")
    c = native._Container(str(tmp_path / "d.lrnn"), "load")
    assert set(c.groups) == {"rnn:step0:", "const:"} and c.metadata["version"] == "3"
    back = leanrnn.load(tmp_path / "d.lrnn")
    assert _distinct(back) == 1 and len(back.graph.packed) == 3
    np.testing.assert_allclose(back(x), want, rtol=1e-5, atol=1e-6)
    for model in (m, back):
        q = leanrnn.quantize(model, "bf16")
        assert _distinct(q) == 1
        np.testing.assert_allclose(q(x), want, atol=5e-2)
    d = back.describe(2, 5)
    assert d["weight_bytes"] == back.graph.packed["step0"].nbytes + sum(
        a.nbytes for a in back.graph.constants.values()
    )
    assert [lay.get("shares") for lay in d["layers"] if lay["op"] == "GRU"] == [
        None,
        "step0",
        "step0",
    ]


def _edit_graph(path, edit):
    """Rewrite a graph .lrnn's header JSON with ``edit(meta, graph)`` (its checksum goes stale:
    read with verify=False)."""
    import json
    import struct

    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    g = json.loads(meta["graph"])
    edit(meta, g)
    meta["graph"] = json.dumps(g)
    text = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda meta, g: meta.update(version="2"), "format version 2 has no shared weights"),
        (lambda meta, g: g["packed"].update(step1={"shares": "nope"}), "no node with packed"),
        (lambda meta, g: g["packed"].update(step1={"shares": "step2"}), "no node with packed"),
        (
            lambda meta, g: g["packed"].update(step1={"shares": "step0", "x": 1}),
            "holds more than 'shares'",
        ),
        (lambda meta, g: g["nodes"][2]["attrs"].update(hidden_size=9), "hidden_size"),
    ],
)
def test_a_hostile_share_is_refused(tmp_path, edit, words):
    _decoder(tmp_path / "d.onnx")
    leanrnn.load(tmp_path / "d.onnx").save(tmp_path / "d.lrnn")
    _edit_graph(tmp_path / "d.lrnn", edit)
    with pytest.raises(ModelFormatError, match=words):
        native.load(tmp_path / "d.lrnn", verify=False)


def test_inspect_and_plan_show_shared_weights_once(tmp_path, capsys):
    from leanrnn import cli

    _decoder(tmp_path / "d.onnx")
    assert cli.main(["inspect", str(tmp_path / "d.onnx")]) == 0
    out = capsys.readouterr().out
    assert out.count("(the weights of step0)") == 2 and "parameters:   384" in out  # 2*3*8*8
    assert cli.main(["plan", str(tmp_path / "d.onnx"), "--batch", "1", "--steps", "2"]) == 0
    assert "step2 (the weights of step0): GRU" in capsys.readouterr().out


def test_a_replaced_file_keeps_its_owner_but_not_special_bits(tmp_path):
    # (review of the fix above) setuid/setgid were copied onto the writer's new file; root's
    # save over a user's 0600 model left it root's, and the user locked out
    path = tmp_path / "m.lrnn"
    m = leanrnn.GRU(3, 5, seed=0)
    m.save(path)
    os.chmod(path, 0o4750)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    m.save(path)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o750
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (65534, 65534)


def test_an_unmarked_bf16_act_pickle_is_told_to_quantize_to_bf16_act():
    from leanrnn.formats.packing import PackedWeights, _packed_from_bytes

    pw = leanrnn.quantize(leanrnn.LSTM(4, 8, seed=0), "bf16-act").weights
    with pytest.raises(
        leanrnn.errors.WeightsError, match=r"leanrnn\.quantize\(model, 'bf16-act'\)"
    ):
        _packed_from_bytes(pw.spec, pw.dtype, "bf16-act", pw.buffer)
    assert isinstance(_packed_from_bytes(pw.spec, pw.dtype, "bf16-act", pw.buffer, "pairs"),
                      PackedWeights)  # fmt: skip


def test_a_replacing_write_is_private_until_it_takes_the_files_place(tmp_path):
    # (review) the mode was applied after the write: a private model's bytes sat in a temp
    # file of the umask's mode (often world-readable) for the whole write
    from leanrnn._files import replacing

    path = tmp_path / "m.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    with replacing(str(path)) as tmp, open(tmp, "wb") as f:
        assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o600
        f.write(b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(os.stat(path).st_mode) == 0o640
