"""Loading and running real model files: leanrnn's native format vs ONNX, and leanrnn vs
onnxruntime on the same ONNX file.

Part 1 (the load bar): a 2-layer LSTM, C = H = 512, loaded from .lrnn and from .onnx with
``leanrnn.load``. Bars: .lrnn loads at least 5x faster, and its peak memory during the load is
at most the weights plus 10%.

Part 2 (the run bar): embedding -> 2-layer LSTM(512) -> linear, exported by torch.onnx.export
(or built with onnx.helper if torch is missing), run by leanrnn and by onnxruntime on the same
file with the same thread count, at N = 1 and N = 64. Bars: leanrnn at least as fast, with a
lower peak memory.

Every memory measurement runs in its own fresh subprocess; part 2's times come from both engines
loaded in their own processes and taking turns (``interleaved``). Peak memory is the growth of the process's
resident high-water mark (VmHWM, reset through /proc/self/clear_refs right before the measured
section) over the resident size at that moment, so imports and the interpreter do not count;
part 2 also reports the whole process's high-water mark ('process', a cold process: interpreter,
numpy, the engine's own imports and everything after), which is what a deployment pays.

    python benchmarks/bench_load.py                 # both parts
    python benchmarks/bench_load.py --part load     # part 1 only (a few seconds)
    python benchmarks/bench_load.py --threads 1 --steps 50 --repeats 3 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from leanrnn.cli import positive_int

H = 512
VOCAB = 10_000
CLASSES = 1_000


# --------------------------------------------------------------------------- memory probes
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak_since(base: int) -> int:
    return _status("VmHWM") - base


# ---------------------------------------------------------------------------------- models
def _lstm_layers(x: str, u, inits: list, nodes: list, layers: int = 2) -> str:
    """Append ``layers`` ONNX LSTM(H) nodes (weights drawn by ``u``) after tensor ``x``, each
    followed by the Squeeze of its direction axis; returns the last output's name. Needs an
    int64 initializer "axes" = [1] among ``inits``."""
    from onnx import helper, numpy_helper

    for layer in range(layers):
        names = [f"W{layer}", f"R{layer}", f"B{layer}"]
        inits += [
            numpy_helper.from_array(a, n)
            for a, n in zip((u(1, 4 * H, H), u(1, 4 * H, H), u(1, 8 * H)), names, strict=True)
        ]
        nodes.append(helper.make_node("LSTM", [x, *names], [f"Y{layer}"], hidden_size=H))
        nodes.append(helper.make_node("Squeeze", [f"Y{layer}", "axes"], [f"y{layer}"]))
        x = f"y{layer}"
    return x


def _lstm_onnx(path: str, seed: int = 0) -> None:
    """2-layer LSTM (C = H = 512) as two ONNX LSTM nodes, weights as initializers."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    k = 1 / np.sqrt(H)

    def u(*shape):
        return rng.uniform(-k, k, shape).astype(np.float32)

    inits, nodes = [numpy_helper.from_array(np.array([1], np.int64), "axes")], []
    x = _lstm_layers("x", u, inits, nodes)
    g = helper.make_graph(
        nodes,
        "lstm2",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", H])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with open(path, "wb") as f:
        f.write(m.SerializeToString())


def _tagger_onnx(path: str, seed: int = 0) -> str:
    """embedding -> 2-layer LSTM(512) -> linear; torch.onnx.export when torch is installed."""
    try:
        import torch
    except ImportError:
        return _tagger_onnx_helper(path, seed)
    torch.manual_seed(seed)

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, H)
            self.lstm = torch.nn.LSTM(H, H, num_layers=2)
            self.head = torch.nn.Linear(H, CLASSES)

        def forward(self, tokens):
            return self.head(self.lstm(self.emb(tokens))[0])

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Tagger().eval(),
            (torch.zeros(4, 2, dtype=torch.long),),
            path,
            dynamo=False,
            input_names=["tokens"],
            output_names=["logits"],
            dynamic_axes={"tokens": {0: "T", 1: "N"}},
        )
    return "torch.onnx.export"


def _tagger_onnx_helper(path: str, seed: int) -> str:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    k = 1 / np.sqrt(H)

    def u(*shape):
        return rng.uniform(-k, k, shape).astype(np.float32)

    inits = [
        numpy_helper.from_array(rng.standard_normal((VOCAB, H)).astype(np.float32), "emb"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
        numpy_helper.from_array(u(H, CLASSES), "head_w"),
        numpy_helper.from_array(u(CLASSES), "head_b"),
    ]
    nodes = [helper.make_node("Gather", ["emb", "tokens"], ["e"])]
    x = _lstm_layers("e", u, inits, nodes)
    nodes += [
        helper.make_node("MatMul", [x, "head_w"], ["mm"]),
        helper.make_node("Add", ["mm", "head_b"], ["logits"]),
    ]
    g = helper.make_graph(
        nodes,
        "tagger",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["T", "N"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    return "onnx.helper"


# ---------------------------------------------------------------------------------- children
def child_load(path: str, repeats: int) -> dict:
    import leanrnn  # noqa: F401  (imports and numba set-up are not part of the measurement)
    from leanrnn.loading import load

    if path.endswith(".onnx"):
        import onnx  # noqa: F401  (read_onnx imports it lazily; not part of the load)
    base = _reset_peak()
    t0 = time.perf_counter()
    model = load(path)
    first = time.perf_counter() - t0
    peak = _peak_since(base)
    weights = (
        model.weights.nbytes
        if hasattr(model, "weights")
        else sum(pw.nbytes for pw in model.graph.packed.values())
    )
    del model
    times = [first]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        m = load(path)
        times.append(time.perf_counter() - t0)
        del m
    return {"first_s": first, "best_s": min(times), "peak_bytes": peak, "weight_bytes": weights}


def _warm_up(engine: str, threads: int) -> None:
    """Start the engine's runtime on a tiny unrelated LSTM (numba loads its compiled kernels,
    onnxruntime sets up its allocators and thread pool), so only the model is measured."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w = [
        numpy_helper.from_array(rng.standard_normal((1, 16, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((1, 16, 4)).astype(np.float32), "R"),
    ]
    node = helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=4)
    g = helper.make_graph(
        [node],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        w,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    x = np.zeros((3, 2, 4), np.float32)
    if engine == "leanrnn":
        from leanrnn.onnx_backend import LeanRNNBackend

        LeanRNNBackend.prepare(m).run([x])
    else:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )


def _engine(engine: str, path: str, batch: int, steps: int, threads: int, warm: bool):
    """(run, feeds, base): ``engine`` loaded on ``path`` after the peak was reset (base: the
    resident size then), its feeds of T x N tokens (the same in every process)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (steps, batch)).astype(np.int64)
    if engine == "leanrnn":
        import leanrnn
        from leanrnn.loading import load

        leanrnn.set_num_threads(threads)
        if warm:
            _warm_up(engine, threads)
        base = _reset_peak()
        return load(path).run, [tokens], base
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if warm:
        _warm_up(engine, threads)
    base = _reset_peak()
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return (lambda f: sess.run(None, f)), {name: tokens}, base


def child_run(
    engine: str,
    path: str,
    batch: int,
    steps: int,
    threads: int,
    repeats: int,
    out_path: str,
    warm: bool,
) -> dict:
    run, feeds, base = _engine(engine, path, batch, steps, threads, warm)
    out = run(feeds)  # warm-up (plans memory, compiles nothing new: numba cache is warm)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run(feeds)
        times.append(time.perf_counter() - t0)
    peak = _peak_since(base)
    np.save(out_path, out[0])
    return {
        "median_s": statistics.median(times),
        "best_s": min(times),
        "peak_bytes": peak,
        "process_peak_bytes": _status("VmHWM"),
    }


def child_turns(engine: str, path: str, batch: int, steps: int, threads: int) -> None:
    """The timing worker: the engine loaded (warm), then for every line k read from stdin one
    untimed run and k timed ones, their seconds printed as a JSON list, until stdin closes."""
    run, feeds, _ = _engine(engine, path, batch, steps, threads, True)
    run(feeds)
    print("ready", flush=True)
    for line in sys.stdin:
        run(feeds)  # the turn's first call: the caches and threads the other engine left
        times = []
        for _ in range(int(line)):
            t0 = time.perf_counter()
            run(feeds)
            times.append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)


RUN_WALL = "(wall time of a run)"  # the breakdown's key for a whole run's time
WARM_S = 1.0  # a breakdown child's untimed runs first: at least this long, and 2 runs


def _warm_runs(run) -> None:
    """Run ``run`` untimed for WARM_S seconds and at least twice: a fresh process's first
    runs took 1.0-1.8x the time of later ones here (the kernel team's threads, first touches
    of the arena), and a breakdown of few runs is taken right after."""
    end, n = time.perf_counter() + WARM_S, 0
    while n < 2 or time.perf_counter() < end:
        run()
        n += 1


def _medians(per_run: list[dict]) -> dict:
    """{key: median over runs} of per-run {key: seconds} (a key a run lacks counts 0 there)."""
    keys = {k for d in per_run for k in d}
    return {k: statistics.median(d.get(k, 0.0) for d in per_run) for k in keys}


def child_breakdown(engine: str, path: str, batch: int, steps: int, threads: int,
                    runs: int) -> dict:  # fmt: skip
    """{"op name": median seconds per run} of ``engine``'s nodes over ``runs`` runs after the
    warm-up (_warm_runs), and RUN_WALL: leanrnn's from GraphModel.run(times=...) and a clock
    around each run, onnxruntime's from its own profile (ort_node_times)."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (steps, batch)).astype(np.int64)
    _warm_up(engine, threads)
    if engine == "leanrnn":
        import leanrnn
        from leanrnn.loading import load

        leanrnn.set_num_threads(threads)
        model = load(path)
        _warm_runs(lambda: model.run([tokens]))
        per_run = []
        for _ in range(runs):
            times: dict = {}
            t0 = time.perf_counter()
            model.run([tokens], times=times)
            per_run.append({**times, RUN_WALL: time.perf_counter() - t0})
        return _medians(per_run)
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tmp, "ort")
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        feeds = {sess.get_inputs()[0].name: tokens}
        _warm_runs(lambda: sess.run(None, feeds))
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            return ort_node_times(json.load(f), runs)


def ort_node_times(events: list[dict], runs: int) -> dict:
    """{"op name": median seconds per run} of the nodes in the last ``runs`` runs of an
    onnxruntime profile (the runs before them: the warm-up), and RUN_WALL: the median of
    those runs' "model_run" spans. A node event belongs to the run whose span holds its
    start; the "_kernel_time" events are the nodes' own (onnxruntime also logs their input
    preparation, "_fence_before"/"_after")."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")  # fmt: skip
    if len(spans) <= runs:
        raise RuntimeError(f"onnxruntime's profile holds {len(spans)} runs, not {runs} and a "
                           "warm-up")  # fmt: skip
    spans = spans[-runs:]
    per_run: list[dict] = [{RUN_WALL: (b - a) * 1e-6} for a, b in spans]
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        i = next((i for i, (a, b) in enumerate(spans) if a <= e["ts"] < b), None)
        if i is not None:
            key = f"{e.get('args', {}).get('op_name', '?')} {name[: -len('_kernel_time')]}"
            per_run[i][key] = per_run[i].get(key, 0.0) + e["dur"] * 1e-6
    return _medians(per_run)


def _named_copy(path: str) -> str:
    """``path``'s model with every unnamed node given the name leanrnn's import gives it
    (op_type_i, i its place among all nodes), saved beside it: onnxruntime numbers unnamed
    nodes its own way, and the breakdown pairs the two engines' nodes by name."""
    import onnx

    m = onnx.load(path)
    for i, n in enumerate(m.graph.node):
        n.name = n.name or f"{n.op_type}_{i}"
    named = path + ".named.onnx"
    onnx.save(m, named)
    return named


def breakdown(path: str, batch: int, steps: int, threads: int, runs: int) -> list[tuple]:
    """[(key, leanrnn seconds or None, onnxruntime seconds or None)], medians per run of the
    model at ``path``, whose nodes all have names (_named_copy): both engines' nodes paired by
    ONNX node name (key "op name", leanrnn's op where both have the
    node; a node one engine fused away — onnxruntime's bias Add after a MatMul, say — has the
    other's time only), slowest first; then ("sum of nodes", ...) and (RUN_WALL, ...). Each
    engine in its own process."""
    args = [path, str(batch), str(steps), str(threads), str(runs)]
    res = {e: _spawn(["breakdown", e, *args], threads) for e in ("leanrnn", "onnxruntime")}
    walls = [res[e].pop(RUN_WALL) for e in ("leanrnn", "onnxruntime")]
    by_name = {e: {k.split(" ", 1)[1]: (k, v) for k, v in res[e].items()} for e in res}
    lean, ort_ = by_name["leanrnn"], by_name["onnxruntime"]
    rows = []
    for name in {**ort_, **lean}:
        key = (lean.get(name) or ort_[name])[0]
        rows.append((key, lean.get(name, (None, None))[1], ort_.get(name, (None, None))[1]))
    rows.sort(key=lambda r: -max(r[1] or 0.0, r[2] or 0.0))
    rows.append(("sum of nodes", sum(res["leanrnn"].values()), sum(res["onnxruntime"].values())))
    rows.append((RUN_WALL, *walls))
    return rows


def part_breakdown(tmp: str, threads: int, steps: int, batches: list[int], runs: int) -> None:
    """Where the tagger's time goes in each engine, node by node (issue 13 asked what the
    N=64 graph loses to onnxruntime: the head, the embedding or the LSTMs)."""
    path = os.path.join(tmp, "tagger.onnx")
    if not os.path.exists(path):
        _tagger_onnx(path)
    named = _named_copy(path)  # once for every batch
    for n in batches:
        print(f"\n== where the time goes, N={n}, T={steps}, {threads} thread(s): median of {runs} "
              "runs per node (leanrnn: GraphModel.run(times=...); onnxruntime: its profile, "
              "kernel times in whole us)")  # fmt: skip
        print(f"{'node':<32}{'leanrnn':>12}{'onnxruntime':>14}")
        for key, a, b in breakdown(named, n, steps, threads, runs):
            if max(a or 0.0, b or 0.0) < 1e-4 and key != "sum of nodes":
                continue  # shape arithmetic and views
            cell = [f"{v * 1e3:10.2f}ms" if v is not None else f"{'-':>12}" for v in (a, b)]
            print(f"{key[:31]:<32}{cell[0]:>12}{cell[1]:>14}")


SETTLE_S = 0.05  # pause before each turn: the other engine's spinning threads go idle


def interleaved(path: str, batch: int, steps: int, threads: int, rounds: int,
                per_turn: int) -> dict:  # fmt: skip
    """{engine: {"median_s", "best_s"}}: both engines loaded in their own processes, taking
    ``rounds`` turns of ``per_turn`` timed runs each while the other waits on a pipe, the
    order rotating — so a slow spell of this shared machine falls on both alike (one process
    after the other, the tagger's N=64 ratio moved 0.85 -> 0.78 between two runs minutes
    apart on a Zen 3)."""
    engines = ("leanrnn", "onnxruntime")
    workers = {}
    try:
        for e in engines:
            workers[e] = subprocess.Popen(
                [sys.executable, __file__, "--child", "turns", e, path, str(batch), str(steps),
                 str(threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(threads),
            )  # fmt: skip
        for e, w in workers.items():
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {e} timing worker failed to start")
        times: dict = {e: [] for e in engines}
        for r in range(rounds):
            for e in engines[r % 2 :] + engines[: r % 2]:
                time.sleep(SETTLE_S)
                workers[e].stdin.write(f"{per_turn}\n")
                workers[e].stdin.flush()
                times[e] += json.loads(workers[e].stdout.readline())
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
    return {e: {"median_s": statistics.median(t), "best_s": min(t)} for e, t in times.items()}


def _env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["LEANRNN_NUM_THREADS"] = str(threads)
    return env


def _spawn(args: list[str], threads: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True,
        text=True,
        env=_env(threads),
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ parts
def _mib(n: float) -> str:
    return f"{n / (1 << 20):8.1f} MiB"


def part_load(tmp: str, repeats: int, trials: int) -> bool:
    from leanrnn.loading import convert

    onnx_path = os.path.join(tmp, "lstm2.onnx")
    lrnn_path = os.path.join(tmp, "lstm2.lrnn")
    _lstm_onnx(onnx_path)
    convert(onnx_path, lrnn_path)
    res = {}
    for label, path in (("onnx", onnx_path), (".lrnn", lrnn_path)):
        runs = [_spawn(["load", path, str(repeats)], 1) for _ in range(trials)]
        res[label] = {
            "best_s": statistics.median(r["best_s"] for r in runs),
            "first_s": statistics.median(r["first_s"] for r in runs),
            "peak_bytes": statistics.median(r["peak_bytes"] for r in runs),
            "weight_bytes": runs[0]["weight_bytes"],
        }
    print(
        f"\n== Load a 2-layer LSTM, C=H={H} ({os.path.getsize(onnx_path) / 1e6:.1f} MB ONNX, "
        f"{os.path.getsize(lrnn_path) / 1e6:.1f} MB .lrnn); median of {trials} processes"
    )
    print(f"{'from':<8}{'first load':>12}{'best load':>12}{'peak memory':>16}{'weights':>16}")
    for label, r in res.items():
        print(
            f"{label:<8}{r['first_s'] * 1e3:10.1f}ms{r['best_s'] * 1e3:10.1f}ms"
            f"{_mib(r['peak_bytes']):>16}{_mib(r['weight_bytes']):>16}"
        )
    speedup = res["onnx"]["first_s"] / res[".lrnn"]["first_s"]
    ratio = res[".lrnn"]["peak_bytes"] / res[".lrnn"]["weight_bytes"]
    ok_speed, ok_mem = speedup >= 5, ratio <= 1.10
    print(
        f"bar: .lrnn >= 5x faster than ONNX (first load in a fresh process): {speedup:.1f}x "
        f"-> {'PASS' if ok_speed else 'FAIL'}"
    )
    print(
        f"bar: .lrnn peak <= weights + 10%: peak/weights = {ratio:.3f} -> "
        f"{'PASS' if ok_mem else 'FAIL'}"
    )
    return ok_speed and ok_mem


def part_run(tmp: str, threads: int, steps: int, repeats: int, batches: list[int],
             rounds: int = 6) -> bool:  # fmt: skip
    path = os.path.join(tmp, "tagger.onnx")
    how = _tagger_onnx(path)
    print(
        f"\n== embedding({VOCAB}) -> 2-layer LSTM({H}) -> linear({CLASSES}), {how}; "
        f"T={steps}, {threads} thread(s); times: median and best of {rounds} turns x "
        f"{repeats} runs per engine, the two engines loaded in their own processes taking "
        "turns (interleaved); memory: each engine in fresh processes"
    )
    print(
        "peak memory: growth of the process's peak RSS from after imports ('cold', engine "
        "start-up included) or from after running a tiny LSTM ('warm', the model alone); "
        "'process': the whole cold process's peak RSS"
    )
    print(
        f"{'N':>4}{'engine':>12}{'median':>12}{'best':>12}{'peak cold':>14}{'peak warm':>14}"
        f"{'process':>14}"
    )
    ok = True
    for n in batches:
        res = {}
        timed = interleaved(path, n, steps, threads, rounds, repeats)
        for engine in ("leanrnn", "onnxruntime"):
            out = os.path.join(tmp, f"{engine}_{n}.npy")
            runs = {
                w: _spawn(
                    ["run", engine, path, str(n), str(steps), str(threads), str(repeats), out, w],
                    threads,
                )
                for w in ("cold", "warm")
            }
            r = res[engine] = {
                **timed[engine],
                "cold": runs["cold"]["peak_bytes"],
                "warm": runs["warm"]["peak_bytes"],
                "process": runs["cold"]["process_peak_bytes"],
            }
            print(
                f"{n:>4}{engine:>12}{r['median_s'] * 1e3:10.1f}ms{r['best_s'] * 1e3:10.1f}ms"
                f"{_mib(r['cold']):>14}{_mib(r['warm']):>14}{_mib(r['process']):>14}"
            )
        diff = float(
            np.max(
                np.abs(
                    np.load(os.path.join(tmp, f"leanrnn_{n}.npy"))
                    - np.load(os.path.join(tmp, f"onnxruntime_{n}.npy"))
                )
            )
        )
        lean, ort_ = res["leanrnn"], res["onnxruntime"]
        faster = lean["median_s"] <= ort_["median_s"]
        kinds = ("cold", "warm", "process")
        leaner = {w: lean[w] < ort_[w] for w in kinds}
        mem = ", ".join(
            f"{lean[w] / ort_[w]:.2f}x {w} ({'PASS' if leaner[w] else 'FAIL'})" for w in kinds
        )
        print(
            f"     N={n}: leanrnn {ort_['median_s'] / lean['median_s']:.2f}x the speed of "
            f"onnxruntime ({'PASS' if faster else 'FAIL'}); peak memory {mem};"
            f" max |diff| = {diff:.2e}"
        )
        ok = ok and faster and all(leaner.values()) and diff < 1e-3
    return ok


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        role, rest = sys.argv[2], sys.argv[3:]
        if role == "turns":
            engine, path, n, t, threads = rest
            child_turns(engine, path, int(n), int(t), int(threads))
            return 0
        if role == "load":
            res = child_load(rest[0], int(rest[1]))
        elif role == "breakdown":
            engine, path, n, t, threads, runs = rest
            res = child_breakdown(engine, path, int(n), int(t), int(threads), int(runs))
        else:
            engine, path, n, t, threads, reps, out, warm = rest
            res = child_run(
                engine, path, int(n), int(t), int(threads), int(reps), out, warm == "warm"
            )
        print(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=positive_int, default=100, help="T for the run part")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--trials", type=positive_int, default=3, help="processes per load measurement")
    p.add_argument("--rounds", type=positive_int, default=6,
                   help="turns per engine of the interleaved run timing (--repeats runs each)")  # fmt: skip
    p.add_argument("--batches", default="1,64")
    p.add_argument("--part", choices=["load", "run", "all"], default="all")
    p.add_argument("--breakdown", type=int, default=0, metavar="RUNS",
                   help="after the run part, each engine's time per node, the median of RUNS "
                   "runs at every batch (0: none)")  # fmt: skip
    args = p.parse_args()
    from leanrnn.bench.report import cpu_line

    print(cpu_line())
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("load", "all"):
            ok &= part_load(tmp, args.repeats, args.trials)
        if args.part in ("run", "all"):
            batches = [int(b) for b in args.batches.split(",")]
            ok &= part_run(tmp, args.threads, args.steps, args.repeats, batches, args.rounds)
            if args.breakdown:
                part_breakdown(tmp, args.threads, args.steps, batches, args.breakdown)
    print("\nall bars pass" if ok else "\nsome bars FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
