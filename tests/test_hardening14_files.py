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
