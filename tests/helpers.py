"""Helpers shared by the test modules (test modules never import from each other)."""

from __future__ import annotations

import contextlib
import io
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import warnings

import numpy as np

from leanrnn.formats.packing import LayerWeights


def random_layers(spec, rng, dtype=np.float32, scale=0.5) -> list[list[LayerWeights]]:
    """Canonical (PyTorch gate order) weights for ``spec``: normal draws times ``scale`` (zero
    biases for a bias=False spec, which pack refuses otherwise)."""
    out = []
    G, H, K, P = spec.gate_width, spec.hidden_size, spec.output_size, spec.proj_size
    for layer in range(spec.num_layers):
        C = spec.layer_input_size(layer)
        dirs = []
        for _ in range(spec.num_directions):

            def r(*shape):
                return (rng.standard_normal(shape) * scale).astype(dtype)

            def b():  # drawn either way (the draws after stay the same); zero if bias=False
                v = r(G)
                return v if spec.bias else np.zeros_like(v)

            dirs.append(
                LayerWeights(
                    r(G, C),
                    r(G, K),
                    b(),
                    b(),
                    r(3, H) if spec.peepholes else None,
                    r(P, H) if P else None,
                )
            )
        out.append(dirs)
    return out


def max_err(a, b) -> float:
    """Max abs difference in float64 (0 for empty arrays); the shapes must match."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def torch_tagger(vocab: int, emb: int, hidden: int, classes: int):
    """A torch ``embedding -> 2-layer LSTM -> linear`` in eval mode: the sequence model ONNX
    exporters are asked for most. Weights come from torch's current seed."""
    import torch  # only the torch tests call this; the others run without torch

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, emb)
            self.lstm = torch.nn.LSTM(emb, hidden, num_layers=2)
            self.head = torch.nn.Linear(hidden, classes)

        def forward(self, tokens):
            return self.head(self.lstm(self.emb(tokens))[0])

    return Tagger().eval()


def torch_export(module, args, path, dynamo: bool, names=None, dynamic=None):
    """``torch.onnx.export`` to ``path`` with the weights inside the file, quietly (exporters
    warn and print). ``names``: (input names, output names); ``dynamic``: TorchScript's
    dynamic_axes (dynamo infers dynamic sizes itself)."""
    import torch

    kw = {"dynamo": dynamo}
    if names:
        kw["input_names"], kw["output_names"] = names
    if dynamo:
        kw["external_data"] = False
    elif dynamic:
        kw["dynamic_axes"] = dynamic
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), **kw)
    return path


class traced_peak:
    """``with traced_peak() as mem: ...`` then ``mem.peak``: the most bytes of Python
    allocations (tracemalloc) live at once inside the block, also when it raised."""

    peak = 0

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


# ------------------------------------------------------------------ leanrnn serve in a subprocess
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def src_env() -> dict:
    """This process's environment with this checkout's src first on PYTHONPATH (a child
    process then runs the code under test, not an installed copy)."""
    return dict(os.environ, PYTHONPATH=_SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _read_all(pipe, sink) -> None:
    """Every line of ``pipe`` to ``sink``; the pipe closed at its end (the process's exit).
    Left open, it was closed by the garbage collector whenever it ran, and the ResourceWarning
    landed in whatever test was recording warnings then (test_build_warnings, now and then)."""
    with pipe:
        for line in pipe:
            sink(line)


def launch_server(args: list[str], timeout: float = 60.0):
    """Start ``leanrnn serve ARGS --http-port 0 --grpc-port 0``; (process, http url, grpc url,
    log lines). Its stderr (JSON lines) is read as it comes, so the server never blocks on it."""
    env = src_env()
    cmd = [sys.executable, "-m", "leanrnn", "serve", *args, "--http-port", "0", "--grpc-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    logs: list[str] = []
    threading.Thread(target=_read_all, args=(proc.stdout, lines.put), daemon=True).start()
    threading.Thread(target=_read_all, args=(proc.stderr, logs.append), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        line = ""
    if "ready" not in line:
        proc.kill()
        proc.wait()
        time.sleep(0.5)  # the reader thread takes the last lines
        raise AssertionError(f"server did not start ({line!r}): {''.join(logs)}")
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return proc, fields["http"], fields["grpc"], logs


@contextlib.contextmanager
def served(d, name: str, model, *args: str):
    """``model`` saved in ``d`` and served as ``name`` (``leanrnn serve NAME=PATH ARGS``) for
    the block: {"model", "proc", "http", "grpc", "host", "port", "logs"}. Stopped after it,
    with exit status 0 asked, unless the block stopped it itself."""
    path = f"{d}/{name}.lrnn"
    model.save(path)
    proc, http_url, grpc_url, logs = launch_server([f"{name}={path}", *args])
    host, port = http_url.rsplit(":", 1)
    try:
        yield {"model": model, "proc": proc, "http": http_url, "grpc": grpc_url, "host": host,
               "port": int(port), "logs": logs}  # fmt: skip
    except BaseException:  # a failed test: the server must not outlive it (one ran for an hour)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    if proc.poll() is None:
        assert stop_server(proc) == 0


def grpc_health(url: str, service: str = "") -> str:
    """grpc.health.v1's status of ``service`` on the server at ``url``, by name ('SERVING',
    'NOT_SERVING'), or the status code's name when the call fails ('NOT_FOUND')."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(url) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10)  # fmt: skip
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def stop_server(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def finish_process(proc, timeout: float) -> str:
    """Wait for PROC (started with start_new_session=True) and return its output; past TIMEOUT
    seconds kill its whole process group, so a hung child and anything it started cannot
    outlive the test."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out = f"{out or ''}\n[killed after {timeout:g} s]"
    return out or ""


def fails_in_one_line(capsys, argv: list[str], *words: str) -> str:
    """Run ``leanrnn argv``; assert exit != 0 and a single `leanrnn: error:` line naming
    ``words``; return it."""
    from leanrnn import cli

    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc != 0, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanrnn: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def tile_gemm(name: str, dot: str | None = None, bf16: str | None = None):
    """panel_gemm1..4 of ISA ``name``'s tiles (float, reduced-weight and int8-dynamic alike:
    the panel's dtype picks; int8-dynamic's with the dot product ``dot``, default what
    _cpu.int8_dot picks; bf16 and int8 panels' rows on ``bf16``, "amx", "dpbf16" or "fma", default
    _cpu.bf16_dot's) behind one jit function ``run(nvec, P, poff, A, i0, i1, K, C, mode,
    bias)``, so each ISA's tile is tested on any machine (its machine code:
    ``run.inspect_asm()``)."""
    import numba

    from leanrnn.kernels import _cpu, _simd

    isa = _cpu.ISAS[name]
    tiles = _simd.tiles(isa)
    g1, g2, g3, g4 = (_simd.make(n, tiles, isa, dot, bf16) for n in (1, 2, 3, 4))

    @numba.njit
    def run(nvec, P, poff, A, i0, i1, K, C, mode, bias):
        ks, lda, ldc = P.shape[2], A.shape[1], C.shape[1]
        if nvec == 1:
            g1(P, poff, ks, A, 0, i0, i1, lda, K, C, 0, ldc, mode, bias, 0, 0, 0)
        elif nvec == 2:
            g2(P, poff, ks, A, 0, i0, i1, lda, K, C, 0, ldc, mode, bias, 0, 0, 0)
        elif nvec == 3:
            g3(P, poff, ks, A, 0, i0, i1, lda, K, C, 0, ldc, mode, bias, 0, 0, 0)
        else:
            g4(P, poff, ks, A, 0, i0, i1, lda, K, C, 0, ldc, mode, bias, 0, 0, 0)

    return run


def compile_recording(module):
    """torch.compile(module) on dynamo + AOTAutograd without inductor (whose C++ build takes
    minutes on 2 cores); returns (compiled, codes): the forward and backward graphs' code as
    they are compiled."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def keep(gm, _):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    return torch.compile(module, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)), codes


def bf16_act_twin(m32, x, hx, cell, h_seen):
    """The model Trainer(autocast="bf16-act") computes, one layer in float64 torch (an
    independent oracle): every product of a weight matrix rounded to bfloat16 by torch and a
    vector (x, h_prev) rounded to bfloat16 by torch, its gradient that of the product at the
    unrounded vector (the roundings pass gradients straight through); biases, states and the
    cell in float64. Which way each h_prev rounds is taken from ``h_seen`` ([T, N, H]: the
    engine's float32 h_prev of every step), where the float64 h_prev, ~1e-7 away, could sit
    across a bfloat16 rounding boundary (it did once in ~6000 roundings, and the runs parted
    by 2e-4): the rounded value is still torch's rounding of a float32 the engine computed.
    Returns y, the final states and the weights' leaves (for .grad)."""

    import torch

    def bf(t):
        return t.detach().to(torch.bfloat16).double()

    def product(v, seen, w):  # the value at the rounded ``seen``, the gradient of v @ w.T
        exact = v @ w.T
        return exact + (bf(seen) @ w.T - exact).detach()

    params = {}
    for name, p in m32.named_parameters():
        t = bf(p) if name.startswith(("weight_ih", "weight_hh")) else p.detach().double()
        params[name] = t.requires_grad_()
    W, R = params["weight_ih_l0"], params["weight_hh_l0"]
    b, bh = params["bias_ih_l0"], params["bias_hh_l0"]
    h, c = (hx[0][0], hx[1][0]) if cell == "LSTM" else (hx[0], None)
    out = []
    for t in range(x.shape[0]):
        gx = product(x[t], x[t], W) + b
        gh = product(h, torch.from_numpy(h_seen[t]).double(), R) + bh
        if cell == "LSTM":
            i, f, g, o = (gx + gh).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        elif cell == "GRU":
            xr, xz, xn = gx.chunk(3, dim=1)
            hr, hz, hn = gh.chunk(3, dim=1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            h = (1 - z) * torch.tanh(xn + r * hn) + z * h
        else:
            h = torch.tanh(gx + gh)
        out.append(h)
    states = [h[None]] + ([c[None]] if cell == "LSTM" else [])
    return torch.stack(out), states, params


class ServeCoreStub:
    """What serve's rpc.Servicer asks of its Core, with no engine behind it: every request is
    answered ``values`` (outputs by name) at once; limits, tokens and statistics pass."""

    metrics = None
    idle_timeout = 60.0

    def __init__(self, values: dict | None = None) -> None:
        self.values = {} if values is None else values

    def enter(self, protocol):  # --max-concurrency: not the point here
        pass

    def leave(self, protocol):
        pass

    def authorize(self, token):
        pass

    def io(self, model, what, seconds):  # (Triton's statistics: not the point here)
        pass

    def reserve(self, n, mine=0):  # (--max-queued-bytes: not the point here)
        pass

    def unreserve(self, n):
        pass

    def error(self, e, protocol, model=None):
        pass

    async def infer_held(self, p, protocol, json_bytes=0, arrival=None, submitted=None):
        if submitted is not None:  # queued at once, as the real one (stream order)
            submitted.set_result(None)
        return self.values, lambda: None

    class scheduler:  # a request's arrival (Scheduler.arriving): not the point here
        arriving = staticmethod(lambda model=None: 0)
        arrived = staticmethod(lambda token: None)


class GrpcContextStub:
    """What rpc.Servicer asks of a call's grpc.aio context."""

    def invocation_metadata(self):
        return ()

    def add_done_callback(self, fn):
        pass


def sigterm_seconds(proc, timeout: float = 60.0) -> float:
    """Send a server process SIGTERM; the seconds until it exited (with status 0, asserted)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=timeout) == 0
    return time.monotonic() - t0
