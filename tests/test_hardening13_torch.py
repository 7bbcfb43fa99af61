"""Session 39: ``leanrnn.torch`` under CPU autocast returned other dtypes than torch's own
modules for 24 of 84 input combinations a red-team pass tried: a packed LSTM (torch: float32,
it does not run oneDNN; leanrnn: bfloat16), a GRU given a bfloat16 input or h_0 (torch:
bfloat16, the state's dtype; leanrnn: float32), a projected LSTM's c_n from bfloat16 states.
Every combination of cell, projection, packing, input and state dtype, autocast dtype and
oneDNN on or off, against torch's module on the same weights."""

from __future__ import annotations

import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

CASES = [
    (cell, proj, packed, xdt, sdt)
    for cell, proj, packed, xdt, sdt in itertools.product(
        ["lstm", "gru", "rnn"],
        [0, 3],
        [False, True],
        [F32, BF16, F16, F64],
        [None, F32, BF16, F16, F64],
    )
    if not (proj and cell != "lstm")
]


def _module(cell, proj):
    torch.manual_seed(0)
    if cell == "lstm":
        return torch.nn.LSTM(5, 8, proj_size=proj)
    return torch.nn.GRU(5, 8) if cell == "gru" else torch.nn.RNN(5, 8)


def _dtypes(out, packed, lstm):
    y, h = out
    y = y.data if packed else y
    return (y.dtype, *(t.dtype for t in h)) if lstm else (y.dtype, h.dtype)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("adt", [BF16, torch.float16])
def test_autocast_output_dtypes_are_torchs(adt, onednn):
    wrong = []
    ran = 0
    with torch.backends.mkldnn.flags(enabled=onednn), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cell, proj, packed, xdt, sdt in CASES:
            tm = _module(cell, proj)
            lm = lt.from_module(tm)
            lstm = cell == "lstm"
            x = torch.randn(6, 3, 5).to(xdt)
            inp = (
                torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 4, 2])) if packed else x
            )
            hx = None
            if sdt is not None:  # h_0 (and c_0) in the state dtype
                h0 = torch.randn(1, 3, proj or 8).to(sdt)
                hx = (h0, torch.randn(1, 3, 8).to(sdt)) if lstm else h0
            with torch.autocast("cpu", adt):
                try:
                    want = _dtypes(tm(inp, hx), packed, lstm)
                except RuntimeError:  # oneDNN refuses some float16 autocast LSTMs itself
                    continue
                got = _dtypes(lm(inp, hx), packed, lstm)
            ran += 1
            if got != want:
                wrong.append((cell, proj, packed, xdt, sdt, "torch", want, "leanrnn", got))
    assert ran >= 80
    assert not wrong, "\n".join(map(str, wrong))
