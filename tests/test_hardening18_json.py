"""Session 44, from a red-team pass on machine-readable outputs: a spec built with numpy
floats (np.float32 clip or activation alpha) reached describe() and the .lrnn header, whose
JSON could not be written (a bare TypeError from save); `inspect --json` printed `Infinity`
for an ONNX node's clip=inf (not JSON: jq and JSON.parse refuse it); `bench --from-json` on a
results.json with a null (which the harness writes itself for a NaN) or a row it could not
read ended in a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import leanrnn
from helpers import src_env
from leanrnn.errors import SpecError
from leanrnn.formats.packing import pack
from leanrnn.spec import Activation, RNNSpec


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "leanrnn", *args], capture_output=True,
                          text=True, timeout=120, env=src_env())  # fmt: skip


def _layers(spec):
    from helpers import random_layers

    return random_layers(spec, np.random.default_rng(0), np.float32, scale=0.3)


def test_numpy_numbers_in_a_spec_are_python_floats(tmp_path):
    spec = RNNSpec("rnn", 2, 3, clip=np.float32(2.0),
                   activations=((Activation("leakyrelu", np.float32(0.1)),),))  # fmt: skip
    assert type(spec.clip) is float and type(spec.activations[0][0].alpha) is float
    m = leanrnn.Model(pack(spec, _layers(spec), np.float32))
    json.dumps(m.describe(1, 4))  # (TypeError: float32 is not JSON serializable)
    path = str(tmp_path / "m.lrnn")
    m.save(path)
    x = np.random.default_rng(1).standard_normal((4, 1, 2)).astype(np.float32)
    np.testing.assert_array_equal(leanrnn.load(path)(x)[0], m(x)[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_parameter_is_refused(bad):
    with pytest.raises(SpecError, match="expected a finite number"):
        Activation("leakyrelu", bad)


def test_an_infinite_clip_clips_nothing_and_inspect_json_is_strict(tmp_path):
    spec = RNNSpec("gru", 2, 3, clip=float("inf"))
    assert spec.clip is None
    m = leanrnn.Model(pack(spec, _layers(spec), np.float32))
    path = str(tmp_path / "g.lrnn")
    m.save(path)
    r = _cli("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))


def test_bench_from_json_with_nulls_or_unreadable_rows_is_one_line(tmp_path):
    from leanrnn.bench import report

    assert report.busy({"background_cores": None, "cores": 2, "config": {"threads": 1}}) is False
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"rows": [{"engine": "leanrnn", "config": None}]}))
    r = _cli("bench", "--from-json", str(bad), "--no-plots")
    assert r.returncode != 0 and "is not a bench results JSON this leanrnn reads" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
