"""The ``.lrnn`` checksum and format versions: the version-2 data digest against a slow pure-Python
twin, what it catches that version 1 could not, and version-1 files still loading."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leanrnn.errors import ModelFormatError
from leanrnn.formats import native
from leanrnn.formats.packing import PackedWeights
from leanrnn.loading import load, save
from leanrnn.memory.arena import aligned_empty
from leanrnn.nn import GRU, LSTM
from leanrnn.spec import RNNSpec

BLOCK = 4096  # bytes per block of the version-2 digest


def _digest_twin(data: bytes) -> str:
    """Version-2 region digest with Python ints: per 4 KiB block the sum of its little-endian
    64-bit words, then the plain and the (k+1)-weighted sums of the block sums, mod 2**64;
    the 0..7 tail bytes go to CRC-32."""
    import zlib

    n = len(data) // 8 * 8
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, n, 8)]
    per = BLOCK // 8
    sums = [sum(words[i : i + per]) % 2**64 for i in range(0, len(words), per)]
    total = sum(sums) % 2**64
    weighted = sum((k + 1) * s for k, s in enumerate(sums)) % 2**64
    return f"{total:016x}{weighted:016x}{zlib.crc32(data[n:]):08x}"


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=3 * BLOCK + 21))
def test_digest_matches_python_twin(data):
    got = native._checksum({}, [np.frombuffer(data, np.uint8)]).split("-", 1)[1]
    assert got == _digest_twin(data)


def test_digest_handles_large_sums():
    # all-ones words overflow every sum many times over: the digest wraps mod 2**64
    data = b"\xff" * (5 * BLOCK + 8 * 3 + 5)
    got = native._checksum({}, [np.frombuffer(data, np.uint8)]).split("-", 1)[1]
    assert got == _digest_twin(data)


def _data_start(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _swap_blocks(data: bytes, i: int, j: int) -> bytes:
    b = bytearray(data)
    s = _data_start(data)
    a, c = s + i * BLOCK, s + j * BLOCK
    b[a : a + BLOCK], b[c : c + BLOCK] = data[c : c + BLOCK], data[a : a + BLOCK]
    return bytes(b)


def test_swapped_blocks_are_caught(tmp_path):
    """Swapping two 4 KiB blocks of weights keeps every word, so a plain sum or XOR of words
    (the version-1 digest) cannot see it; the block-weighted sum does."""
    p = tmp_path / "m.lrnn"
    save(LSTM(64, 64, seed=0), p)
    data = p.read_bytes()
    bad = _swap_blocks(data, 1, 3)
    assert bad != data
    s = _data_start(data)
    v1 = [native._region_digest_v1(np.frombuffer(d[s:], np.uint64)) for d in (data, bad)]
    assert v1[0] == v1[1]  # what version 1 would have missed
    p.write_bytes(bad)
    with pytest.raises(ModelFormatError, match="checksum"):
        load(p)


def test_version_1_files_still_load(tmp_path, monkeypatch):
    model = GRU(4, 6, num_layers=2, seed=0)
    with monkeypatch.context() as m:
        m.setattr(native, "WRITTEN_VERSION", 1)  # write as leanrnn with format version 1 did
        save(model, tmp_path / "v1.lrnn")
    assert native.read_metadata(tmp_path / "v1.lrnn")["version"] == "1"
    back = load(tmp_path / "v1.lrnn")
    np.testing.assert_array_equal(back.weights.buffer, model.weights.buffer)
    # and a corrupt version-1 file is still refused
    data = bytearray((tmp_path / "v1.lrnn").read_bytes())
    data[-5] ^= 0x10
    (tmp_path / "bad.lrnn").write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="checksum"):
        load(tmp_path / "bad.lrnn")


def test_new_files_are_version_2_and_round_trip(tmp_path):
    model = LSTM(5, 7, num_layers=2, seed=3)
    save(model, tmp_path / "m.lrnn")
    # version 2 still: 3 (shared weights) is written only by a graph that shares
    assert (
        native.read_metadata(tmp_path / "m.lrnn")["version"] == str(native.WRITTEN_VERSION) == "2"
    )
    np.testing.assert_array_equal(load(tmp_path / "m.lrnn").weights.buffer, model.weights.buffer)


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=9 * BLOCK + 21),
    chunk_blocks=st.integers(1, 3),
    split=st.booleans(),
)
def test_a_region_read_in_chunks_gets_the_bytes_and_the_one_pass_digest(
    tmp_path_factory, data, chunk_blocks, split
):
    """read_regions sums each chunk as it arrives, on several threads: the bytes and the digests
    must be what one read and ``_region_digest`` over each whole region give, for any size
    (partial last block, a tail of under 8 bytes, an empty region) and chunk size."""
    path = tmp_path_factory.mktemp("r") / "r.bin"
    path.write_bytes(b"x" * 24 + data + data[::-1])  # the regions start past a "header"
    c = object.__new__(native._Container)
    c.path, c.op, c.data_start = str(path), "load", 24
    bufs = [aligned_empty(len(data)), aligned_empty(0), aligned_empty(len(data))]
    old = native._READ_CHUNK, native._PARALLEL_READ_BYTES
    native._READ_CHUNK, native._PARALLEL_READ_BYTES = chunk_blocks * BLOCK, 0 if split else 1 << 40
    try:
        with open(path, "rb") as f:
            digests = c.read_regions(
                f, [(0, bufs[0]), (0, bufs[1][:0]), (len(data), bufs[2])], native.VERSION
            )
    finally:
        native._READ_CHUNK, native._PARALLEL_READ_BYTES = old
    assert bufs[0].tobytes() == data and bufs[2].tobytes() == data[::-1]
    assert digests == [_digest_twin(data), "", _digest_twin(data[::-1])]


def test_a_file_cut_short_while_its_region_is_read_is_an_error(tmp_path):
    p = tmp_path / "m.lrnn"
    save(LSTM(64, 64, seed=0), p)
    c = native._Container(str(p), "load")
    size = c.data_size
    with open(p, "r+b") as f:
        f.truncate(c.data_start + size // 2)  # after the header was checked
    buf = aligned_empty(size)
    with open(p, "rb") as f, pytest.raises(ModelFormatError, match="truncated while reading"):
        c.read_regions(f, [(0, buf)], native.VERSION)


def test_a_load_reads_on_its_own_thread_when_no_thread_can_start(tmp_path, monkeypatch):
    """A process at its thread limit still loads: the share a thread would have read is read
    by the caller, so Thread.start's RuntimeError does not fail the load."""
    model = GRU(64, 128, seed=2)
    save(model, tmp_path / "m.lrnn")
    monkeypatch.setattr(native, "_READ_CHUNK", BLOCK)
    monkeypatch.setattr(native, "_PARALLEL_READ_BYTES", 0)

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(native.threading.Thread, "start", refuse)
    np.testing.assert_array_equal(load(tmp_path / "m.lrnn").weights.buffer, model.weights.buffer)


def test_a_large_model_loads_through_the_threaded_read(tmp_path):
    """Regions from _PARALLEL_READ_BYTES up are shared between threads: bytes equal, and a flip
    in the last chunk (read by another thread) is still caught."""
    model = LSTM(256, 512, num_layers=2, seed=1)
    assert model.weights.buffer.nbytes >= native._PARALLEL_READ_BYTES
    save(model, tmp_path / "m.lrnn")
    np.testing.assert_array_equal(load(tmp_path / "m.lrnn").weights.buffer, model.weights.buffer)
    data = bytearray((tmp_path / "m.lrnn").read_bytes())
    data[-100] ^= 0x01
    (tmp_path / "bad.lrnn").write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="checksum"):
        load(tmp_path / "bad.lrnn")


def test_a_newer_version_is_refused_with_advice(tmp_path):
    p = tmp_path / "m.lrnn"
    save(GRU(3, 4, seed=0), p)
    data = p.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["version"] = str(native.VERSION + 1)
    text = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with pytest.raises(ModelFormatError, match=rf"version '{native.VERSION + 1}'.*upgrade leanrnn"):
        load(p)


def test_is_native_tells_lrnn_from_plain_safetensors(tmp_path):
    save(GRU(3, 4, seed=0), tmp_path / "m.lrnn")
    assert native.is_native(tmp_path / "m.lrnn")
    plain = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "p.safetensors").write_bytes(struct.pack("<Q", len(plain)) + plain + bytes(4))
    assert not native.is_native(tmp_path / "p.safetensors")
    (tmp_path / "junk").write_bytes(struct.pack("<Q", 5) + b"{nope")
    assert not native.is_native(tmp_path / "junk")
    assert not native.is_native(tmp_path / "missing")


# ----------------------------------------- what the reader computes from a spec, before reading
_specs = st.builds(
    lambda cell, C, H, L, direction, proj: RNNSpec(
        cell,
        C,
        H,
        num_layers=L,
        direction=direction,
        proj_size=proj % H if cell == "lstm" else 0,
    ),
    st.sampled_from(["lstm", "gru", "rnn"]),
    st.integers(1, 40),
    st.integers(1, 40),
    st.integers(1, 4),
    st.sampled_from(["forward", "reverse", "bidirectional"]),
    st.integers(0, 39),
)


@settings(max_examples=40, deadline=None)
@given(_specs, st.sampled_from([np.float32, np.float64]))
def test_weight_floor_and_layout_match_the_packed_weights(spec, dtype):
    """The closed-form floor equals the per-layer sum of unpadded W and R, and bounds the real
    buffer from below; the computed layout is exactly the buffer PackedWeights allocates."""
    dtype = np.dtype(dtype)
    G, K, D = spec.gate_width, spec.output_size, spec.num_directions
    per_layer = sum(G * (spec.layer_input_size(i) + K) for i in range(spec.num_layers))
    floor = native._weight_floor(spec, dtype)
    assert floor == per_layer * D * dtype.itemsize
    pw = PackedWeights(spec, dtype)
    assert floor <= pw.nbytes
    want, nbytes = native._packed_layout(spec, dtype)
    assert nbytes == pw.nbytes
    assert want == {k: (v.shape, off, v.dtype) for k, v, off in native._region(pw)}
