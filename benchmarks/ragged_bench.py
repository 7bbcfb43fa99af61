"""Padded batches of sequences of different lengths: what a step costs once some samples have
ended. leanrnn's input projection leaves out row groups whose steps are all past their
sample's length (kernels.gemm.input_projection) and each step's recurrent GEMM runs up to the
last live sample (kernels.recurrent._live_end), so a batch ordered longest first computes only
the live rows, as PyTorch's packed sequences do; in input order a sample that ended rides along until every later one has too.

Side by side in one process, engines taking turns round after round (one untimed call each
time a turn opens), one thread each:

- leanrnn, lengths ordered longest first (what ``leanrnn score`` and ``leanrnn serve`` do)
- leanrnn, the same lengths in random order
- leanrnn, every sample all T steps (the dense work the padding would cost)
- torch: ``pack_padded_sequence(enforce_sorted=False)`` + ``nn.LSTM`` (sorts inside)
- onnxruntime: the ONNX LSTM node with ``sequence_lens``

    python benchmarks/ragged_bench.py                         # H=512, N=64, T=100
    python benchmarks/ragged_bench.py --hidden 256 --batch 32 --rounds 9

Lengths: log-normal (median T/3), at most T, the longest exactly T. Before anything is
timed, each engine's outputs are compared with leanrnn's in input order (max abs difference
printed; longest first must give the same bits).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from leanrnn.cli import positive_int

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def lengths_for(N: int, T: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(np.log(T / 3), 0.7, N)), 1, T).astype(np.int64)
    lens[rng.integers(N)] = T
    return lens


def _one_thread(ort):
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return so


def onnx_lstm(sd: dict, C: int, H: int, lengths: bool = True) -> bytes:
    """One ONNX LSTM node with PyTorch state dict ``sd``'s weights, taking X [T, N, C] and
    (``lengths``) sequence_lens [N]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from leanrnn.bench.problem import _to_onnx_order

    def w(key):
        return _to_onnx_order("lstm", np.asarray(sd[key], np.float32), H)

    inits = [numpy_helper.from_array(a, n) for a, n in (
        (w("weight_ih_l0")[None], "W"), (w("weight_hh_l0")[None], "R"),
        (np.concatenate([w("bias_ih_l0"), w("bias_hh_l0")])[None], "B"))]  # fmt: skip
    f32 = TensorProto.FLOAT
    ins = ["X", "W", "R", "B"] + (["sequence_lens"] if lengths else [])
    node = helper.make_node("LSTM", ins, ["Y"], hidden_size=H)
    feeds = [helper.make_tensor_value_info("X", f32, ["T", "N", C])]
    if lengths:
        feeds.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["N"]))
    graph = helper.make_graph(
        [node], "ragged", feeds,
        [helper.make_tensor_value_info("Y", f32, ["T", 1, "N", H])], inits)  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m.SerializeToString()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=positive_int, default=512)
    ap.add_argument("--input", type=positive_int, default=128)
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--steps", type=positive_int, default=100)
    ap.add_argument("--rounds", type=positive_int, default=7, help="turns per engine")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed calls per turn")
    args = ap.parse_args(argv)
    sys.path.insert(0, SRC)
    import leanrnn

    H, C, N, T = args.hidden, args.input, args.batch, args.steps
    model = leanrnn.LSTM(C, H, seed=0)
    model.threads = 1
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, N, C)).astype(np.float32)
    lens = lengths_for(N, T, 2)
    desc = np.argsort(-lens, kind="stable")
    x_desc, lens_desc = np.ascontiguousarray(x[:, desc]), lens[desc]
    full = np.full(N, T)

    runs = {
        "leanrnn, longest first": lambda: model(x_desc, lengths=lens_desc),
        "leanrnn, random order": lambda: model(x, lengths=lens),
        "leanrnn, all T steps": lambda: model(x, lengths=full),
    }
    want = model(x, lengths=lens)[0]
    checks = {"leanrnn, longest first": float(np.abs(model(x_desc, lengths=lens_desc)[0]
                                                     - want[:, desc]).max())}  # fmt: skip
    sd = model.state_dict()  # PyTorch's names and gate order
    try:
        import torch
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        torch.set_num_threads(1)
        tm = torch.nn.LSTM(C, H)
        tm.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()})
        tx, tl = torch.from_numpy(x), torch.from_numpy(lens)

        def torch_run():
            with torch.inference_mode():
                packed = pack_padded_sequence(tx, tl, enforce_sorted=False)
                return pad_packed_sequence(tm(packed)[0], total_length=T)[0]

        runs["torch packed"] = torch_run
        checks["torch packed"] = float(np.abs(torch_run().numpy() - want).max())
    except ImportError:
        print("torch: not installed, skipped")
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(onnx_lstm(sd, C, H), _one_thread(ort),
                                    providers=["CPUExecutionProvider"])  # fmt: skip
        feed = {"X": x, "sequence_lens": lens.astype(np.int32)}
        runs["onnxruntime sequence_lens"] = lambda: sess.run(None, feed)
        checks["onnxruntime sequence_lens"] = float(
            np.abs(sess.run(None, feed)[0][:, 0] - want).max()
        )
    except ImportError:
        print("onnxruntime: not installed, skipped")

    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
        for name in order:
            runs[name]()  # opens the turn untimed
            for _ in range(args.repeats):
                t = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t)
    live = lens.sum() / (N * T)
    print(f"LSTM C={C} H={H} N={N} T={T}, 1 thread; lengths log-normal, median "
          f"{int(np.median(lens))}, {100 * live:.0f}% of the padded steps live; "
          f"{args.rounds} turns x {args.repeats} calls each")  # fmt: skip
    base = np.median(times["leanrnn, longest first"])
    print(f"{'engine':<28}{'median ms':>10}{'best ms':>9}{'vs longest first':>18}{'max diff':>10}")
    for name, ts in times.items():
        m = np.median(ts)
        d = checks.get(name)
        print(f"{name:<28}{m * 1e3:>10.2f}{min(ts) * 1e3:>9.2f}{m / base:>17.2f}x"
              f"{'' if d is None else f'{d:>10.1e}'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
