"""A classifier head's product at few rows (a batch-1 sequence's steps), leanrnn's two ways of
finishing a width that is not a multiple of the 64-column panel, beside onnxruntime:
the last panel in a launch of its own into a one-panel tail (many rows), or every panel in one
launch into a padded tail, copied out (few rows on several threads: engine.products
packed_product). All in one process, taking turns sample by sample in a random order;
onnxruntime with its threads' spinning off, so that they do not take the cores from the
others' turns.

    python benchmarks/head_tail.py                      # 1000 classes, K=512, 30/100/200 rows
    python benchmarks/head_tail.py --rows 100 --threads 2 --classes 1000 --samples 400
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from leanrnn.cli import positive_int


def _runs(pm, a, out, tails, threads, sync, product, sess) -> dict:
    """{name: a call running one product}: leanrnn's with each tail, onnxruntime's if any."""
    runs = {k: (lambda k=k: product(pm, a, out[k], tails[k], threads, sync)) for k in tails}
    if sess is not None:
        runs["onnxruntime"] = lambda: sess.run(None, {"a": a})
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[30, 100, 200])
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--classes", type=positive_int, default=1000, help="M, the head's width")
    ap.add_argument("--inputs", type=positive_int, default=512, help="K")
    ap.add_argument("--samples", type=positive_int, default=400)
    ap.add_argument("--exact-width", action="store_true",
                    help="the padded tail exactly the panels' width (its rows a power of two "
                    "apart at 16 panels: what the quarter panel more avoids)")  # fmt: skip
    args = ap.parse_args(argv)
    before = None
    try:
        import leanrnn

        before = leanrnn.get_num_threads()
        return _run(args)
    finally:
        if before is not None:
            leanrnn.set_num_threads(before)  # as it was: a test calls main() in its process


def _run(args) -> int:
    import leanrnn
    from leanrnn.bench.report import cpu_line
    from leanrnn.engine.products import (
        PANEL,
        PackedMatmul,
        packed_product,
        padded_tail_fits,
        padded_tail_width,
        shares_threads,
    )
    from leanrnn.kernels import abi

    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        ort = None
    print(cpu_line())
    K, M = args.inputs, args.classes
    rng = np.random.default_rng(0)
    B = rng.standard_normal((K, M)).astype(np.float32)
    bias = rng.standard_normal(M).astype(np.float32)
    pm = PackedMatmul.of(B, bias)
    U = pm.W.shape[0]
    blob = None
    if ort is not None:
        g = helper.make_graph(
            [helper.make_node("Gemm", ["a", "B", "bias"], ["y"])], "head",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, K])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(B, "B"), numpy_helper.from_array(bias, "bias")],
        )  # fmt: skip
        blob = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        blob.ir_version = 8
        blob = blob.SerializeToString()
    print(f"head {K} -> {M} (+bias), ms per product (median of {args.samples}; ratio to "
          "leanrnn's one-panel tail)")  # fmt: skip
    print(f"{'rows':>5}{'thr':>4}{'one-panel tail':>16}{'padded tail':>20}{'onnxruntime':>18}")
    for threads in args.threads:
        leanrnn.set_num_threads(threads)
        sync = np.zeros(abi.sync_size(threads), np.int64)
        sess = None
        if blob is not None:
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
        for R in args.rows:
            a = rng.standard_normal((R, K)).astype(np.float32)
            out = {k: np.empty((R, M), np.float32) for k in ("one", "padded")}
            width = U * PANEL if args.exact_width else padded_tail_width(U)
            tails = {"one": np.empty((R, PANEL), np.float32),
                     "padded": np.empty((R, width), np.float32)}  # fmt: skip
            runs = _runs(pm, a, out, tails, threads, sync, packed_product, sess)
            for f in runs.values():
                f()
                f()
            if not np.array_equal(out["one"], out["padded"]):
                raise SystemExit("the two tails' products differ")
            times: dict = {k: [] for k in runs}
            shuffle = np.random.default_rng(R * 10 + threads)
            for _ in range(args.samples):
                # a random order each time: each takes its turn after each other alike (after
                # onnxruntime's turn its 2 MiB of weights, not leanrnn's, are in cache)
                for k in shuffle.permutation(list(runs)):
                    t0 = time.perf_counter()
                    runs[k]()
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            cells = [f"{med['one']:10.3f}"]
            for k in ("padded", "onnxruntime"):
                cells.append(f"{med[k]:10.3f} ({med[k] / med['one']:.2f}x)" if k in med
                             else f"{'-':>18}")  # fmt: skip
            note = ""
            if threads == 1 or not shares_threads(pm, R):
                note = "  (one thread: the padded tail's first panel, the same launches)"
            elif not padded_tail_fits(pm, R, 4):
                note = "  (the graph plans no padded tail here)"
            print(f"{R:>5}{threads:>4}{cells[0]:>16}" + "".join(f"{c:>18}" for c in cells[1:])
                  + note)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
