"""Round trips from PyTorch: models exported with torch.onnx.export load with leanrnn.load and
match torch; .onnx -> .lrnn -> load gives identical outputs; state dicts saved as PyTorch
checkpoints, .safetensors and .npz load into the same model."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from helpers import max_err, torch_export, torch_tagger
from tolerances import atol

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from leanrnn import GraphModel  # noqa: E402
from leanrnn.loading import convert, load, save  # noqa: E402
from leanrnn.nn import GRU, LSTM  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.onnx]
TOL = atol(np.float32)  # float32 leanrnn vs float32 torch


class BiGRU(torch.nn.Module):
    def __init__(self, c=12, h=20):
        super().__init__()
        self.gru = torch.nn.GRU(c, h, bidirectional=True, batch_first=True)

    def forward(self, x):
        y, h = self.gru(x)
        return y, h


@pytest.fixture(scope="module")
def tagger():
    torch.manual_seed(0)
    return torch_tagger(vocab=53, emb=24, hidden=40, classes=7)


@pytest.fixture(scope="module")
def bigru():
    torch.manual_seed(1)
    return BiGRU().eval()


def test_tagger_torchscript_export_matches_torch(tagger, tmp_path):
    path = torch_export(
        tagger,
        (torch.zeros(5, 3, dtype=torch.long),),
        tmp_path / "tagger.onnx",
        dynamo=False,
        names=(["tokens"], ["logits"]),
        dynamic={"tokens": {0: "T", 1: "N"}},
    )
    model = load(path)
    assert isinstance(model, GraphModel)
    assert [n.op for n in model.rnn_nodes] == ["LSTM", "LSTM"]
    rng = np.random.default_rng(0)
    for T, N in ((5, 3), (11, 1), (2, 8)):  # dynamic axes: every shape re-plans
        tokens = rng.integers(0, 53, (T, N))
        with torch.no_grad():
            want = tagger(torch.from_numpy(tokens)).numpy()
        got = model(tokens)
        assert got.shape == want.shape == (T, N, 7)
        assert max_err(got, want) <= TOL


def test_tagger_dynamo_export_matches_torch(tagger, tmp_path):
    tokens = np.random.default_rng(1).integers(0, 53, (6, 4))
    path = torch_export(
        tagger,
        (torch.from_numpy(tokens),),
        tmp_path / "tagger_dynamo.onnx",
        dynamo=True,
        names=(["tokens"], ["logits"]),
    )
    model = load(path)
    with torch.no_grad():
        want = tagger(torch.from_numpy(tokens)).numpy()
    assert max_err(model(tokens), want) <= TOL


@pytest.mark.parametrize("dynamo", [False, True])
def test_bidirectional_gru_export_matches_torch(bigru, tmp_path, dynamo):
    x = np.random.default_rng(2).standard_normal((3, 9, 12)).astype(np.float32)
    path = torch_export(
        bigru,
        (torch.from_numpy(x),),
        tmp_path / "bigru.onnx",
        dynamo=dynamo,
        names=(["x"], ["y", "h"]),
    )
    model = load(path)
    with torch.no_grad():
        want_y, want_h = (t.numpy() for t in bigru(torch.from_numpy(x)))
    y, h = model(x)
    assert y.shape == want_y.shape == (3, 9, 40) and h.shape == want_h.shape == (2, 3, 20)
    assert max_err(y, want_y) <= TOL
    assert max_err(h, want_h) <= TOL


def test_onnx_to_lrnn_gives_identical_outputs(tagger, bigru, tmp_path):
    tokens = np.random.default_rng(3).integers(0, 53, (7, 2))
    x = np.random.default_rng(4).standard_normal((2, 5, 12)).astype(np.float32)
    cases = [
        (
            torch_export(
                tagger,
                (torch.from_numpy(tokens),),
                tmp_path / "t.onnx",
                dynamo=False,
                names=(["tokens"], ["logits"]),
                dynamic={"tokens": {0: "T", 1: "N"}},
            ),
            tokens,
        ),
        (
            torch_export(
                bigru,
                (torch.from_numpy(x),),
                tmp_path / "g.onnx",
                dynamo=False,
                names=(["x"], ["y", "h"]),
            ),
            x,
        ),
    ]
    for onnx_path, inp in cases:
        lrnn = convert(onnx_path, tmp_path / (onnx_path.stem + ".lrnn"))
        a, b = load(onnx_path), load(lrnn)
        assert isinstance(b, GraphModel)
        out_a, out_b = a.run([inp]), b.run([inp])
        assert len(out_a) == len(out_b)
        for u, v in zip(out_a, out_b, strict=True):
            assert u.dtype == v.dtype and np.array_equal(u, v)
        # and the converted file is smaller than the graph it came from needs at run time
        assert b.graph.nodes and len(b.graph.nodes) <= len(a.graph.nodes)


def test_lrnn_of_a_stack_round_trips_exactly(tmp_path):
    m = LSTM(10, 17, num_layers=2, bidirectional=True, seed=5)
    path = save(m, tmp_path / "stack.lrnn")
    m2 = load(path)
    assert type(m2) is LSTM and m2.spec == m.spec
    assert np.array_equal(m2.weights.buffer, m.weights.buffer)
    x = np.random.default_rng(0).standard_normal((6, 3, 10)).astype(np.float32)
    (y1, (h1, c1)), (y2, (h2, c2)) = m(x), m2(x)
    assert np.array_equal(y1, y2) and np.array_equal(h1, h2) and np.array_equal(c1, c2)


def test_lrnn_is_a_plain_safetensors_file(tmp_path):
    """Any safetensors reader opens .lrnn files (the container is the standard one)."""
    st = pytest.importorskip("safetensors.numpy")
    m = GRU(5, 9, seed=0)
    path = save(m, tmp_path / "g.lrnn")
    tensors = st.load_file(str(path))
    assert set(tensors) == set(m.weights.tensors())
    for k, v in m.weights.tensors().items():
        assert np.array_equal(tensors[k], v)


# ------------------------------------------------------------------------------ state dicts
@pytest.fixture(scope="module")
def torch_lstm():
    torch.manual_seed(7)
    return torch.nn.LSTM(6, 11, num_layers=2, bidirectional=True).eval()


def _check_against_torch(model, module, batch_first=False):
    x = np.random.default_rng(5).standard_normal((4, 3, module.input_size)).astype(np.float32)
    with torch.no_grad():
        want, _ = module(torch.from_numpy(x))
    got = model(x)[0]
    assert max_err(got, want.numpy()) <= TOL


@pytest.mark.parametrize("fmt", ["pt", "pt_legacy", "safetensors", "npz", "prefixed"])
def test_state_dict_files_load(torch_lstm, tmp_path, fmt):
    sd = torch_lstm.state_dict()
    path = tmp_path / f"lstm.{fmt}"
    kwargs = {}
    if fmt == "pt":
        torch.save(sd, path)
    elif fmt == "pt_legacy":
        torch.save(sd, path, _use_new_zipfile_serialization=False)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    elif fmt == "npz":
        np.savez(path, **{k: v.numpy() for k, v in sd.items()})
        path = tmp_path / "lstm.npz.npz"
        (tmp_path / "lstm.npz").exists() or path.rename(tmp_path / "lstm.npz")
        path = next(tmp_path.glob("lstm.npz*"))
    else:  # an LSTM inside a bigger model: the prefix picks it
        full = {f"encoder.rnn.{k}": v for k, v in sd.items()}
        full["decoder.weight"] = torch.zeros(3, 3)
        torch.save({"state_dict": full}, path)
        kwargs["prefix"] = "encoder.rnn."
    model = load(path, **kwargs)
    assert type(model) is LSTM and model.spec.direction == "bidirectional"
    _check_against_torch(model, torch_lstm)
    # and on to the native format, bit for bit
    out = convert(path, tmp_path / "lstm.lrnn", **kwargs)
    assert np.array_equal(load(out).weights.buffer, model.weights.buffer)


def test_dynamo_export_with_external_data(bigru, tmp_path):
    """torch's default for the new exporter keeps weights in a side file; it must load."""
    x = np.random.default_rng(6).standard_normal((2, 4, 12)).astype(np.float32)
    path = tmp_path / "ext.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            bigru,
            (torch.from_numpy(x),),
            str(path),
            dynamo=True,
            external_data=True,
            input_names=["x"],
            output_names=["y", "h"],
        )
    assert any(p.name != "ext.onnx" for p in tmp_path.iterdir())  # the side file exists
    with torch.no_grad():
        want_y, _ = bigru(torch.from_numpy(x))
    assert max_err(load(path)(x)[0], want_y.numpy()) <= TOL


# ------------------------------------------------------------------------------------- CLI
def test_cli_convert_inspect_run(tagger, tmp_path, capsys):
    from leanrnn.cli import main

    onnx_path = torch_export(
        tagger,
        (torch.zeros(5, 3, dtype=torch.long),),
        tmp_path / "t.onnx",
        dynamo=False,
        names=(["tokens"], ["logits"]),
        dynamic={"tokens": {0: "T", 1: "N"}},
    )
    lrnn = tmp_path / "t.lrnn"
    assert main(["convert", str(onnx_path), str(lrnn)]) == 0
    capsys.readouterr()

    assert main(["inspect", str(lrnn), "--batch", "4", "--steps", "9", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == sum(p.numel() for p in tagger.parameters())
    assert [layer["op"] for layer in info["layers"] if "spec" in layer] == ["LSTM", "LSTM"]
    assert info["arena"]["input_shapes"] == {"tokens": [9, 4]}
    assert info["arena"]["total_bytes"] > 0
    assert main(["inspect", str(lrnn)]) == 0
    text = capsys.readouterr().out
    assert "parameters" in text and "planned arena" in text and "LSTM" in text

    tokens = np.random.default_rng(7).integers(0, 53, (6, 2))
    np.save(tmp_path / "x.npy", tokens)
    out = tmp_path / "y.npz"
    assert main(["run", str(lrnn), "--input", str(tmp_path / "x.npy"), "--output", str(out)]) == 0
    with torch.no_grad():
        want = tagger(torch.from_numpy(tokens)).numpy()
    assert max_err(np.load(out)["logits"], want) <= TOL


def test_cli_run_stack_with_lengths(tmp_path, capsys):
    from leanrnn.cli import main

    m = GRU(3, 5, seed=2)
    path = save(m, tmp_path / "g.lrnn")
    x = np.random.default_rng(8).standard_normal((7, 2, 3)).astype(np.float32)
    lengths = np.array([7, 3])
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "o.npz"
    args = [
        "run",
        str(path),
        "--input",
        str(tmp_path / "x.npy"),
        "--lengths",
        str(tmp_path / "l.npy"),
        "--output",
        str(out),
    ]
    assert main(args) == 0
    y, h = m(x, lengths=lengths)
    got = np.load(out)
    assert np.array_equal(got["y"], y) and np.array_equal(got["h_n"], h)
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == 3 * 5 * 3 + 3 * 5 * 5 + 2 * 3 * 5


def test_cli_reports_errors_cleanly(tmp_path, capsys):
    from leanrnn.cli import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x01garbage")
    assert main(["inspect", str(bad)]) == 1
    assert "leanrnn: error: [" in capsys.readouterr().err


def test_streamed_import_equals_in_memory_import(tagger, bigru, tmp_path):
    """From a file, weights are read straight from disk into gate order; from bytes, through the
    parsed protobuf. Both must give the same packed weights and constants, bit for bit."""
    from leanrnn.formats.onnx_import import read_onnx

    x = np.zeros((2, 3, 12), np.float32)
    paths = [
        torch_export(
            tagger,
            (torch.zeros(3, 2, dtype=torch.long),),
            tmp_path / "a.onnx",
            dynamo=False,
            names=(["tokens"], ["logits"]),
        ),
        torch_export(
            bigru,
            (torch.from_numpy(x),),
            tmp_path / "b.onnx",
            dynamo=False,
            names=(["x"], ["y", "h"]),
        ),
    ]
    for p in paths:
        a, b = read_onnx(p), read_onnx(p.read_bytes())
        assert a.packed.keys() == b.packed.keys() and a.packed
        for k in a.packed:
            assert np.array_equal(a.packed[k].buffer, b.packed[k].buffer)
        assert a.constants.keys() == b.constants.keys()
        for k in a.constants:
            assert np.array_equal(a.constants[k], b.constants[k])
