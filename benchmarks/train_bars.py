"""The training issue's bars (issue 15): leanrnn.train.Trainer vs torch.nn.LSTM/GRU, side by side.

    python benchmarks/train_bars.py [--out bench-out/train-bars] [--rounds 3] [--max-time 1.5]
        [--cells lstm,gru] [--hidden 128,512] [--batch 32,64] [--threads 1,2] [--steps 1000]
        [--only speed|memory|examples] [--example-steps 300] [--example-threads 2]

1. **Speed.** One training step — forward, then backward of loss = sum(y * dy) for a fixed dy, no
   optimizer — of a single-layer cell with C = H, T = 100, for every (cell, H, N, threads):
   leanrnn (``Trainer.forward`` + ``Trainer.backward``) vs torch's default (oneDNN) path vs torch
   inside ``torch.backends.mkldnn.flags(enabled=False)``; the faster torch is the peer. Both
   sides compute the same gradients: input (torch's x requires grad, as leanrnn always returns
   dx) and every weight and bias, accumulated (grads zeroed before each step, untimed).
   Each round is a fresh process per thread count that runs the three engines *interleaved* on
   the same weights and inputs, a turn of ``--block`` steps each, back to back as a training
   loop runs them, the first of a turn untimed (the engine order rotates every rep, with a short
   pause at each switch so one engine's spinning threads do not steal the next one's cores), so
   a spell of load on this shared machine hits all of them alike. Reported per row: the median
   step over all reps of all rounds; ratio = torch's / leanrnn's (> 1: leanrnn faster); the bar
   is >= 1.3 at H <= 128 and >= 1.1 above. The same ratio in process CPU seconds is shown
   beside it: on 1 thread it holds up when other processes take the cores. Before timing, each row checks leanrnn's gradients
   against torch's (bench.problem.TOLERANCE, relative to the largest value, on a fixed sample
   of every gradient plus its norm).
2. **Memory.** A training step of a 2-layer LSTM, H = max(--hidden) (512), N = max(--batch)
   (64), T = --steps (1000), on max(--threads) (2) threads, each in a fresh process: torch,
   leanrnn storing the whole sequence, leanrnn recomputing (``Trainer(recompute=True)``, segments
   of ~sqrt(T)). Peak = VmHWM after resetting it (/proc/self/clear_refs) minus RSS just before
   the step, with the weights, the trainer, x and dy already made and touched (a warm-up step at
   T = 8 loaded the kernels): everything the step allocates counts, outputs (y, dx) and
   gradient buffers included (they are reported too). Bars: recompute <= 1/10 of torch's peak
   and <= 1.35x leanrnn's own time without recomputation (judged on wall time; the ratio in
   process CPU seconds is shown beside it, as the variants run one after another and a spell of
   load on a shared machine hits one more than the other); no-recompute peak <= torch's. The
   gradients of all three must agree (to rounding: the segments differ, so the order of the
   weight-gradient sums does too).
3. **End to end** (``--only examples``). Both examples (examples/forecast.py: GRU(64) -> Linear
   on the sunspots; examples/char_lm.py: a character LSTM on the standard library's sources) at
   their default budget (or ``--example-steps``), each engine -- torch.nn, leanrnn.torch,
   numpy-only leanrnn -- in its own process (peak memory is per process) from one initial-weights
   file, ``--rounds`` times with the engine order rotating. All three start from the same
   weights and see the same data in the same order, so their losses differ by float32 rounding
   only (the gradients' summation order): the bar's "within run-to-run noise" is a final train
   and validation loss within LOSS_RTOL of torch's (relative; measured: ~1e-5). Reported per
   engine: the final losses and their relative difference from torch's, the median wall time
   of the training loop (import and data loading excluded) and torch's / its (> 1: faster), the
   peak RSS; a row passes if its losses are within LOSS_RTOL and its wall time is below
   torch's.

4. **Mixed precision** (``--only autocast``; issue 14 item 5, no bar of its own). The speed rows'
   training step under ``torch.autocast("cpu", torch.bfloat16)``: torch's module (oneDNN's bf16
   path, AMX where the CPU has it) and leanrnn in both its modes (``Trainer(autocast=...)``:
   bf16 forward kernels, float32 backward through the rounded weights): ``"bf16"``, what
   ``leanrnn.torch`` runs under autocast by default (float32-accurate activations, two bf16 products
   each), and ``"bf16-act"`` (activations rounded to bf16 as torch's autocast does: one
   product), beside both float32 steps, interleaved as above. Reported: the medians, each
   leanrnn autocast step against torch's and against leanrnn's float32 step, and each
   autocast engine's gradient error (relative to the largest value) against torch's float32
   gradients; the run fails if a leanrnn mode's error exceeds torch's.

Writes ``train_bars.json`` and ``train_bars.md`` in --out, prints the tables with the CPU line
(ISA, caches) and the load average. Exit status 1 if a bar is missed or a gradient is wrong.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from leanrnn.cli import nonnegative_float, positive_int

ENGINES = ("leanrnn", "torch", "torch-nodnnl")
TORCHES = ("torch", "torch-nodnnl")
# (torch float32 first: the gradients' reference in speed_child)
AUTOCAST_ENGINES = ("torch", "torch-bf16", "leanrnn", "leanrnn-bf16", "leanrnn-bf16act")
_LEAN_AUTOCAST = {"leanrnn": None, "leanrnn-bf16": "bf16", "leanrnn-bf16act": "bf16-act"}
SPEED_T = 100
SETTLE_S = 0.05  # pause before each engine's turn: the previous engine's spinning threads idle
# Steps per engine's turn (--block): the first of a turn is a warm-up, untimed — after the
# pause and the other engine's steps, a 2-vCPU VM was seen to run a 2-thread step 1.3-2x slower
# than in a loop (its idle vCPU and caches coming back: LSTM H=128 N=32, 9.5 ms back to back,
# 12-20 ms after a 50 ms sleep), which a training loop, running steps back to back, never
# pays. 1: every step timed after a pause (the method of sessions 9-19).
BLOCK = 3
MIN_REPS = 3  # per engine, row and round, however long a step takes
MAX_REPS = 200
SAMPLE = 256  # values of each gradient compared between engines
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_NAMES = ("forecast", "char_lm")
EXAMPLE_ENGINES = ("torch", "leanrnn-torch", "numpy")
# Final losses of engines that start from the same weights and data: float32 rounding apart
# (different summation orders, compounded over the steps; measured ~1e-5 relative after 300
# steps). A wrong gradient moves them by far more (the test's curves move ~10% in 8 steps).
LOSS_RTOL = 1e-3


def _ratio(a: float, b: float) -> float:
    """a / b; NaN when b is 0 (a toy run's peak can fall below the page counters' resolution)."""
    return a / b if b else float("nan")


def speed_bar(H: int) -> float:
    """The speed bar for hidden size H: 1.3x at H <= 128, 1.1x above."""
    return 1.3 if H <= 128 else 1.1


# ----------------------------------------------------------------------------- child side
def _fingerprint(arrays: dict) -> dict:
    """A fixed sample and the norm of every array: enough to tell a wrong gradient from float32
    rounding without shipping megabytes between processes."""
    out = {}
    for k, a in arrays.items():
        flat = np.asarray(a, np.float64).ravel()
        idx = np.linspace(0, flat.size - 1, min(SAMPLE, flat.size)).astype(np.int64)
        out[k] = {"norm": float(np.linalg.norm(flat)), "sample": flat[idx].tolist()}
    return out


def rel_error(got: dict, want: dict) -> float:
    """Worst relative difference between two fingerprints: sample differences over the largest
    sampled value, and the norms' relative difference; inf if they do not hold the same arrays."""
    if set(got) != set(want):
        return float("inf")
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        ws, gs = np.array(w["sample"]), np.array(g["sample"])
        if ws.shape != gs.shape:
            return float("inf")
        scale = max(float(np.abs(ws).max(initial=0.0)), 1e-30)
        worst = max(worst, float(np.abs(gs - ws).max(initial=0.0)) / scale)
        worst = max(worst, abs(g["norm"] - w["norm"]) / max(w["norm"], 1e-30))
    return worst if np.isfinite(worst) else float("inf")


def _state_dict(cell: str, H: int, C: int, layers: int, seed: int = 0) -> dict:
    """PyTorch-named float32 weights, torch's U(-1/sqrt(H), 1/sqrt(H)), from numpy alone (the
    leanrnn child needs no torch)."""
    G = {"lstm": 4, "gru": 3}[cell] * H
    rng = np.random.default_rng(seed)
    k = 1.0 / np.sqrt(H)
    sd = {}
    for layer in range(layers):
        cin = C if layer == 0 else H
        for name, shape in (("weight_ih", (G, cin)), ("weight_hh", (G, H)), ("bias_ih", (G,)),
                            ("bias_hh", (G,))):  # fmt: skip
            sd[f"{name}_l{layer}"] = rng.uniform(-k, k, size=shape).astype(np.float32)
    return sd


def _inputs(T: int, N: int, C: int, H: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, N, C), dtype=np.float32)
    dy = rng.uniform(-1.0, 1.0, size=(T, N, H)).astype(np.float32)
    return x, dy


class LeanStep:
    """leanrnn's training step: Trainer.forward, Trainer.backward(tape, dy)."""

    def __init__(self, sd: dict, x, dy, threads: int, **trainer_kw) -> None:
        import leanrnn
        from leanrnn.train import Trainer

        leanrnn.set_num_threads(threads)
        self.model = leanrnn.from_state_dict(sd)
        self.tr = Trainer(self.model, threads=threads, **trainer_kw)
        self.set_inputs(x, dy)

    def set_inputs(self, x, dy) -> None:
        self.x, self.dy = x, dy
        self.y = self.dx = None

    def zero(self) -> None:
        self.tr.zero_grad()
        self.y = self.dx = None

    def step(self) -> None:
        tape = self.tr.forward(self.x)
        self.dx = self.tr.backward(tape, self.dy)[0]
        self.y = tape.y

    def grads(self) -> dict:
        from leanrnn.formats import torch_format

        g = torch_format.to_state_dict(self.tr.spec, self.tr.gradients())
        return {"y": self.y, "dx": self.dx, **{k: g[k] for k in sorted(g)}}


class TorchStep:
    """torch's training step: y = m(x), torch.autograd.backward(y, dy); x requires grad."""

    def __init__(self, sd: dict, x, dy, threads: int, cell: str, onednn: bool = True,
                 autocast: bool = False) -> None:  # fmt: skip
        import torch

        self.torch = torch
        torch.set_num_threads(threads)
        layers = 1 + max(int(k.rsplit("_l", 1)[1]) for k in sd)
        cls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
        C, H = sd["weight_ih_l0"].shape[1], sd["weight_hh_l0"].shape[1]
        self.m = cls(C, H, num_layers=layers)
        with torch.no_grad():
            self.m.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
        self.onednn = onednn
        self.autocast = autocast
        self.set_inputs(x, dy)

    def set_inputs(self, x, dy) -> None:
        self.x = self.torch.from_numpy(x).requires_grad_(True)
        self.dy = self.torch.from_numpy(dy)
        self.y = None

    def zero(self) -> None:
        self.m.zero_grad(set_to_none=True)
        self.x.grad = None
        self.y = None

    def step(self) -> None:
        torch = self.torch
        with torch.backends.mkldnn.flags(enabled=self.onednn):
            with torch.autocast("cpu", torch.bfloat16, enabled=self.autocast):
                y, _ = self.m(self.x)
            torch.autograd.backward(y, self.dy.to(y.dtype))  # (outside autocast, as loops do)
        self.y = y

    def grads(self) -> dict:
        g = {k: p.grad.numpy() for k, p in self.m.named_parameters()}
        return {"y": self.y.detach().float().numpy(), "dx": self.x.grad.numpy(),
                **{k: g[k] for k in sorted(g)}}  # fmt: skip


def _make(engine: str, sd, x, dy, threads: int, cell: str):
    if engine in _LEAN_AUTOCAST:
        return LeanStep(sd, x, dy, threads, autocast=_LEAN_AUTOCAST[engine])
    return TorchStep(sd, x, dy, threads, cell, onednn=(engine != "torch-nodnnl"),
                     autocast=engine == "torch-bf16")  # fmt: skip


def _settle() -> None:
    gc.collect()
    time.sleep(SETTLE_S)


def speed_child(job: dict) -> dict:
    """One round on one thread count: every (cell, H, N) row, the engines interleaved."""
    import torch

    threads = job["threads"]
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    rows = []
    for cell in job["cells"]:
        for H in job["hidden"]:
            for N in job["batch"]:
                T = job["T"]
                sd = _state_dict(cell, H, H, 1)
                x, dy = _inputs(T, N, H, H)
                eng = {e: _make(e, sd, x, dy, threads, cell) for e in job["engines"]}
                # warm-up step (kernels loaded, arenas and allocator caches made), then the
                # gradients compared with torch's plain ATen path
                prints = {}
                for name, e in eng.items():
                    e.zero()
                    e.step()
                    prints[name] = _fingerprint(e.grads())
                ref = "torch-nodnnl" if "torch-nodnnl" in prints else next(iter(prints))
                err = {n: rel_error(p, prints[ref]) for n, p in prints.items()}
                samples: dict[str, list[float]] = {n: [] for n in eng}
                cpu: dict[str, list[float]] = {n: [] for n in eng}
                names = list(eng)
                t_start = time.perf_counter()
                rep = 0
                block = job.get("block", BLOCK)
                while rep < MAX_REPS:
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in order:
                        e = eng[name]
                        _settle()
                        for i in range(block):
                            e.zero()
                            c0, t0 = time.process_time(), time.perf_counter()
                            e.step()
                            if i or block == 1:
                                samples[name].append(time.perf_counter() - t0)
                                cpu[name].append(time.process_time() - c0)
                    rep += 1
                    if rep >= job["min_reps"] and time.perf_counter() - t_start >= job["max_time"]:
                        break
                del eng
                gc.collect()
                rows.append(dict(cell=cell, H=H, N=N, T=T, threads=threads, samples=samples,
                                 cpu_samples=cpu, grad_rel_error=err,
                                 grad_reference=ref))  # fmt: skip
    return {"rows": rows}


MEM_WARM_T = 8


def memory_child(job: dict) -> dict:
    """One training step of a 2-layer LSTM in this fresh process: its peak beyond what was
    there before (weights, trainer, x, dy) and its time."""
    from leanrnn.bench.harness import hwm, reset_peak, rss

    H, N, T, threads, variant = job["H"], job["N"], job["T"], job["threads"], job["variant"]
    sd = _state_dict("lstm", H, H, 2)
    x, dy = _inputs(T, N, H, H)
    if variant == "torch":
        import torch

        torch.set_num_interop_threads(1)
        e = TorchStep(sd, x, dy, threads, "lstm")
        extra = {}
    else:
        e = LeanStep(sd, x, dy, threads, recompute=variant == "leanrnn-recompute")
        extra = {"plan": {k: v for k, v in e.tr.plan(N, T).items() if k != "plan"}}
    # warm-up on a few steps: kernels, thread pools and the gradient buffers touched (leanrnn's
    # small warm-up arena is replaced by the measured step's)
    e.set_inputs(x[:MEM_WARM_T], dy[:MEM_WARM_T])
    e.zero()
    e.step()
    e.set_inputs(x, dy)
    e.zero()
    gc.collect()
    rss()  # the first read of /proc allocates a page itself
    ok = reset_peak()
    r0 = rss()
    c0, t0 = time.process_time(), time.perf_counter()
    e.step()
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    peak = hwm() - r0
    grads = e.grads()
    outputs = grads["y"].nbytes + grads["dx"].nbytes
    return dict(peak=peak, seconds=dt, cpu_seconds=cpu, outputs_bytes=outputs, hwm_reset=ok,
                fingerprint=_fingerprint(grads), **extra)  # fmt: skip


def child_main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    res = speed_child(job) if job["kind"] == "speed" else memory_child(job)
    Path(argv[1]).write_text(json.dumps(res))
    return 0


# ----------------------------------------------------------------------------- parent side
def spawn(job: dict, threads: int, timeout: float = 7200.0) -> dict:
    """Run ``job`` in a fresh interpreter (this file, ``--child``) with ``threads`` enforced
    through the environment; the result dict, or {"error": ...}. ``background_cores``: CPU used
    by everything but the child while it ran (how loaded the shared machine was)."""
    from leanrnn.bench.harness import _busy_cpu_s, _children_cpu_s, child_env

    with tempfile.TemporaryDirectory(prefix="leanrnn-train-bars-") as d:
        jp, rp = Path(d) / "job.json", Path(d) / "result.json"
        jp.write_text(json.dumps(job))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(jp), str(rp)]
        busy0, mine0, t0 = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=child_env(threads), capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        wall = time.perf_counter() - t0
        others = (_busy_cpu_s() - busy0) - (_children_cpu_s() - mine0)
        if not rp.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            return {"error": f"child exited {proc.returncode}: " + " | ".join(tail)}
        res = json.loads(rp.read_text())
        res["child_wall_s"] = wall
        res["background_cores"] = max(0.0, others / wall) if wall > 0 else float("nan")
        return res


def run_speed(cells, hidden, batch, threads, rounds: int, max_time: float, T: int = SPEED_T,
              min_reps: int = MIN_REPS, engines=ENGINES, log=print, save=None,
              block: int = BLOCK) -> dict:  # fmt: skip
    """Every round: one fresh process per thread count (their order alternating between rounds),
    each running all rows with the engines interleaved. Returns {"rows": [...], "rounds": [...]};
    ``save(partial)`` is called after every child (a long run interrupted keeps what it did)."""
    per_round = []
    for r in range(rounds):
        order = list(threads) if r % 2 == 0 else list(reversed(threads))
        for t in order:
            job = dict(kind="speed", threads=t, cells=list(cells), hidden=list(hidden),
                       batch=list(batch), T=T, max_time=max_time, min_reps=min_reps,
                       engines=list(engines), block=block)  # fmt: skip
            log(f"speed round {r + 1}/{rounds}, {t} thread(s) ...")
            res = spawn(job, t)
            res.update(round=r, threads=t, loadavg=os.getloadavg())
            per_round.append(res)
            if "error" in res:
                log(f"  error: {res['error']}")
            if save is not None:
                save({"rows": merge_speed(per_round), "rounds": per_round})
    return {"rows": merge_speed(per_round), "rounds": per_round}


def merge_speed(per_round: list[dict]) -> list[dict]:
    """One row per (cell, H, N, threads): the median step of each engine over all its reps in
    all rounds, torch's faster path, the ratio and the bar."""
    acc: dict[tuple, dict] = {}
    for res in per_round:
        for row in res.get("rows", []):
            key = (row["cell"], row["H"], row["N"], row["threads"])
            a = acc.setdefault(key, dict(cell=row["cell"], H=row["H"], N=row["N"], T=row["T"],
                                         threads=row["threads"], samples={}, cpu_samples={},
                                         round_medians={}, grad_rel_error={}))  # fmt: skip
            for name, s in row["samples"].items():
                a["samples"].setdefault(name, []).extend(s)
                a["round_medians"].setdefault(name, []).append(statistics.median(s))
            for name, s in row.get("cpu_samples", {}).items():
                a["cpu_samples"].setdefault(name, []).extend(s)
            for name, e in row["grad_rel_error"].items():
                a["grad_rel_error"][name] = max(a["grad_rel_error"].get(name, 0.0), e)
    from leanrnn.bench.problem import TOLERANCE

    rows = []
    for key in sorted(acc, key=lambda k: (k[0], k[1], k[2], k[3])):
        a = acc[key]
        med = {n: statistics.median(s) for n, s in a["samples"].items() if s}
        peers = {n: med[n] for n in TORCHES if n in med}
        a["median_s"] = med
        a["reps"] = {n: len(s) for n, s in a["samples"].items()}
        if "leanrnn" in med and peers:
            best = min(peers, key=peers.get)
            a["peer"] = best
            a["ratio"] = peers[best] / med["leanrnn"]
            a["bar"] = speed_bar(a["H"])
            a["passed"] = a["ratio"] >= a["bar"]
            # how much faster leanrnn must get to meet the bar (1 when it does)
            a["speedup_needed"] = max(1.0, a["bar"] / a["ratio"])
            # The same ratio in process CPU seconds: on one thread, a check that holds up when
            # other processes take the cores (wall time then measures the scheduler too); on
            # two it also counts the cycles threads spin waiting for each other.
            cpu = {n: statistics.median(s) for n, s in a["cpu_samples"].items() if s}
            a["cpu_median_s"] = cpu
            if "leanrnn" in cpu and best in cpu and cpu["leanrnn"] > 0:
                a["cpu_ratio"] = cpu[best] / cpu["leanrnn"]
        a["grads_ok"] = all(e <= TOLERANCE for e in a["grad_rel_error"].values())
        rows.append(a)
    return rows


def run_memory(H: int, N: int, T: int, threads: int, rounds: int = 1, log=print) -> dict:
    """Each variant in its own fresh process, ``rounds`` times, interleaved; the median of each
    figure, and the bars."""
    variants = ("torch", "leanrnn", "leanrnn-recompute")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            log(
                f"memory round {r + 1}/{rounds}: {v}, LSTM x2 H={H} N={N} T={T}, {threads} thread(s) ..."
            )
            res = spawn(dict(kind="memory", variant=v, H=H, N=N, T=T, threads=threads), threads)
            res["loadavg"] = os.getloadavg()
            runs[v].append(res)
            if "error" in res:
                log(f"  error: {res['error']}")
    out = dict(H=H, N=N, T=T, layers=2, threads=threads, runs=runs, variants={})
    for v, rs in runs.items():
        good = [x for x in rs if "error" not in x]
        if not good:
            out["variants"][v] = {"error": rs[-1].get("error", "failed")}
            continue
        out["variants"][v] = dict(
            peak=statistics.median(x["peak"] for x in good),
            seconds=statistics.median(x["seconds"] for x in good),
            cpu_seconds=statistics.median(x.get("cpu_seconds", float("nan")) for x in good),
            outputs_bytes=good[0]["outputs_bytes"],
            background_cores=statistics.median(x["background_cores"] for x in good),
            plan=good[0].get("plan"),
        )
    V = out["variants"]
    if all("error" not in V[v] for v in variants):
        t, s, rc = V["torch"], V["leanrnn"], V["leanrnn-recompute"]
        fp = {v: runs[v][0]["fingerprint"] for v in variants}
        from leanrnn.bench.problem import TOLERANCE

        out["bars"] = [
            dict(bar="recompute peak <= 1/10 of torch's", value=_ratio(rc["peak"], t["peak"]),
                 target=0.1, passed=rc["peak"] <= t["peak"] / 10),
            dict(bar="recompute time <= 1.35x no-recompute time",
                 value=_ratio(rc["seconds"], s["seconds"]),
                 target=1.35, passed=rc["seconds"] <= 1.35 * s["seconds"],
                 cpu_value=_ratio(rc["cpu_seconds"], s["cpu_seconds"])),
            dict(bar="no-recompute peak <= torch's", value=_ratio(s["peak"], t["peak"]),
                 target=1.0, passed=s["peak"] <= t["peak"]),
        ]  # fmt: skip
        # different segments (T vs ~sqrt(T)) sum the weight gradients in a different order, so
        # the two agree to rounding, not to the bit (same segments would: tests/test_train.py)
        out["recompute_rel_error"] = rel_error(fp["leanrnn-recompute"], fp["leanrnn"])
        out["grad_rel_error"] = rel_error(fp["leanrnn"], fp["torch"])
        out["grads_ok"] = max(out["recompute_rel_error"], out["grad_rel_error"]) <= TOLERANCE
    return out


def run_examples(names, steps: int | None, threads: int, rounds: int, log=print) -> dict:
    """Each example's three engines, each in its own process (examples/*.py --engine E --json),
    from one initial-weights file per example, ``rounds`` times with the engine order rotating
    (a spell of load on a shared machine then hits each engine in turn). Returns
    {"rows": [...], "runs": {example: {engine: [record, ...]}}}."""
    budget = [] if steps is None else ["--steps", str(steps)]
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="leanrnn-examples-") as d:
        for name in names:
            script = str(EXAMPLES / f"{name}.py")
            common = [*budget, "--threads", str(threads), "--quiet"]
            init = os.path.join(d, f"{name}_init.npz")
            subprocess.run([sys.executable, script, *common, "--dump-init", init], check=True)
            runs[name] = {e: [] for e in EXAMPLE_ENGINES}
            for r in range(rounds):
                k = r % len(EXAMPLE_ENGINES)
                for e in EXAMPLE_ENGINES[k:] + EXAMPLE_ENGINES[:k]:
                    out = os.path.join(d, f"{name}_{e}_{r}.json")
                    log(f"examples round {r + 1}/{rounds}: {name} --engine {e} ...")
                    proc = subprocess.run([sys.executable, script, *common, "--engine", e,
                                           "--init", init, "--json", out],
                                          capture_output=True, text=True)  # fmt: skip
                    if proc.returncode != 0 or not os.path.exists(out):
                        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
                        runs[name][e].append({"error": " | ".join(tail)})
                        log(f"  error: {runs[name][e][-1]['error']}")
                        continue
                    runs[name][e].append(json.loads(Path(out).read_text()))
    return {"rows": merge_examples(runs), "runs": runs}


def merge_examples(runs: dict) -> list[dict]:
    """One row per (example, engine): final losses (of the first good run: every run of an
    engine computes the same numbers), their relative difference from torch's, the median wall
    time and peak, the ratio to torch's wall time, and pass/fail."""
    rows = []
    for name, per in runs.items():
        good = {e: [r for r in rs if "error" not in r] for e, rs in per.items()}
        ref = good.get("torch") or []
        for e, rs in good.items():
            row = dict(example=name, engine=e, runs=len(rs))
            if not rs:
                row.update(error=(per[e][-1] if per[e] else {}).get("error", "no run"),
                           passed=False)  # fmt: skip
                rows.append(row)
                continue
            r0 = rs[0]
            row.update(steps=r0["steps"], train_loss=r0["train_loss"][-1],
                       val_loss=r0["val_loss"][-1],
                       wall_s=statistics.median(r["wall_s"] for r in rs),
                       walls=[r["wall_s"] for r in rs],
                       peak_mib=statistics.median(r["peak_mib"] or 0.0 for r in rs))  # fmt: skip
            if ref:
                t = ref[0]
                row["train_rel_diff"] = _rel(row["train_loss"], t["train_loss"][-1])
                row["val_rel_diff"] = _rel(row["val_loss"], t["val_loss"][-1])
                row["ratio"] = _ratio(statistics.median(r["wall_s"] for r in ref), row["wall_s"])
                same = max(row["train_rel_diff"], row["val_rel_diff"]) <= LOSS_RTOL
                row["passed"] = e == "torch" or (same and row["ratio"] > 1.0)
            else:
                row["passed"] = False
            rows.append(row)
    return rows


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def examples_table(rows: list[dict]) -> str:
    head = (
        "| example | engine | steps | train loss | vs torch | val loss | vs torch | wall s "
        "| torch / it | peak MiB | bar |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['example']} | {r['engine']} | error: {r['error']} |")
            continue
        torch_row = r["engine"] == "torch"
        d = {k: "" if torch_row or k not in r else f"{r[k]:.1e}"
             for k in ("train_rel_diff", "val_rel_diff")}  # fmt: skip
        bar = "(reference)" if torch_row else ("pass" if r["passed"] else "MISS")
        ratio = "" if torch_row or "ratio" not in r else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['example']} | {r['engine']} | {r['steps']} | {r['train_loss']:.5f} | "
                     f"{d['train_rel_diff']} | {r['val_loss']:.5f} | {d['val_rel_diff']} | "
                     f"{r['wall_s']:.2f} | {ratio} | {r['peak_mib']:.0f} | {bar} |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tables
def _ms(s: float | None) -> str:
    from leanrnn.bench.report import fmt_time

    return fmt_time(s)


def _mib(b: float | None) -> str:
    from leanrnn.bench.report import fmt_bytes

    return fmt_bytes(b)


def speed_table(rows: list[dict]) -> str:
    head = ("| cell | H | N | thr | leanrnn | torch (oneDNN) | torch (no oneDNN) | ratio | bar "
            "| result | ratio in CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        med = r["median_s"]
        if "ratio" in r:
            res = "pass" if r["passed"] else f"miss: leanrnn needs {r['speedup_needed']:.2f}x"
            ratio, bar = f"{r['ratio']:.2f}x", f">= {r['bar']}x"
        else:
            res, ratio, bar = "not measured", "—", "—"
        if not r["grads_ok"]:
            res += f"; WRONG gradients (rel {max(r['grad_rel_error'].values()):.1e})"
        cells = [_ms(med.get(n)) + (" *" if r.get("peer") == n else "") for n in ENGINES]
        cr = f"{r['cpu_ratio']:.2f}x" if "cpu_ratio" in r else "—"
        lines.append(f"| {r['cell'].upper()} | {r['H']} | {r['N']} | {r['threads']} | "
                     f"{' | '.join(cells)} | {ratio} | {bar} | {res} | {cr} |")  # fmt: skip
    return "\n".join(lines)


def autocast_table(rows: list[dict]) -> tuple[str, bool]:
    """The mixed-precision rows, and whether both of leanrnn's autocast modes' gradients were
    no less accurate than torch's in every row."""
    head = ("| cell | H | N | thr | torch f32 | torch autocast | leanrnn f32 | leanrnn bf16 | "
            "leanrnn bf16-act | bf16 / bf16-act vs torch autocast | vs leanrnn f32 | "
            "grad error torch autocast / bf16 / bf16-act |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines, ok = [head], bool(rows)
    modes = ("leanrnn-bf16", "leanrnn-bf16act")

    def ratios(med: dict, base: str) -> str:  # base's time over each mode's
        return " / ".join(f"{med[base] / med[m]:.2f}x" if med.get(m) and base in med else "—"
                          for m in modes)  # fmt: skip

    for r in rows:
        med, err = r["median_s"], r["grad_rel_error"]
        cells = [_ms(med.get(n)) for n in AUTOCAST_ENGINES]
        et = err.get("torch-bf16", float("nan"))
        el = [err.get(m, float("nan")) for m in modes]
        ok &= all(e <= et for e in el)
        lines.append(f"| {r['cell'].upper()} | {r['H']} | {r['N']} | {r['threads']} | "
                     f"{' | '.join(cells)} | {ratios(med, 'torch-bf16')} | {ratios(med, 'leanrnn')} | "
                     f"{et:.1e} / {el[0]:.1e} / {el[1]:.1e} |")  # fmt: skip
    return "\n".join(lines), ok


def memory_table(m: dict) -> str:
    lines = [f"2-layer LSTM, H={m['H']}, N={m['N']}, T={m['T']}, {m['threads']} thread(s):", "",
             "| variant | peak beyond weights & inputs | of which y + dx | the rest | time | "
             "other load |", "|---|---|---|---|---|---|"]  # fmt: skip
    for v, r in m["variants"].items():
        if "error" in r:
            lines.append(f"| {v} | error: {r['error']} | | |")
            continue
        name = v
        if r.get("plan"):
            p = r["plan"]
            name += f" (segment {p['segment']}, arena {_mib(p['arena_bytes'])})"
        lines.append(f"| {name} | {_mib(r['peak'])} | {_mib(r['outputs_bytes'])} | "
                     f"{_mib(max(0, r['peak'] - r['outputs_bytes']))} | "
                     f"{_ms(r['seconds'])} ({_ms(r.get('cpu_seconds'))} CPU) | "
                     f"{r['background_cores']:.1f} cores |")  # fmt: skip
    V = m["variants"]
    if all("error" not in V.get(v, {"error": 1}) for v in ("torch", "leanrnn-recompute")):
        t, rc = V["torch"], V["leanrnn-recompute"]
        rest = max(0, rc["peak"] - rc["outputs_bytes"]) / max(1, t["peak"] - t["outputs_bytes"])
        # a toy run's torch peak can read 0 (what it allocates stays below VmHWM's last high)
        share = t["outputs_bytes"] / t["peak"] if t["peak"] > 0 else float("nan")
        lines.append(f"\nBoth sides return y and dx (torch's x requires grad): "
                     f"{share:.3f} of torch's peak. Beyond them, "
                     f"leanrnn recomputing needs {rest:.3f} of what torch does.")  # fmt: skip
    if "bars" in m:
        lines += ["", "| bar | measured | result |", "|---|---|---|"]
        for b in m["bars"]:
            cpu = f"; in CPU s {b['cpu_value']:.3f}" if "cpu_value" in b else ""
            lines.append(f"| {b['bar']} | {b['value']:.3f} (target {b['target']}){cpu} | "
                         f"{'pass' if b['passed'] else 'miss'} |")  # fmt: skip
        lines.append(f"\ngradients, relative error: leanrnn recomputing vs storing "
                     f"{m['recompute_rel_error']:.1e}, leanrnn vs torch {m['grad_rel_error']:.1e}"
                     + ("" if m["grads_ok"] else " — WRONG"))  # fmt: skip
    return "\n".join(lines)


def _load_line(per_round: list[dict]) -> str:
    bg = [r["background_cores"] for r in per_round if "background_cores" in r]
    if not bg:
        return ""
    return (f"Other processes kept {min(bg):.1f}-{max(bg):.1f} of the "
            f"{os.cpu_count()} cores busy while the speed rounds ran.")  # fmt: skip


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/train-bars"))
    ap.add_argument("--cells", type=lambda s: tuple(s.split(",")), default=("lstm", "gru"))
    ap.add_argument("--hidden", type=_ints, default=(128, 512))
    ap.add_argument("--batch", type=_ints, default=(32, 64))
    ap.add_argument("--threads", type=_ints, default=(1, 2))
    ap.add_argument(
        "--rounds", type=positive_int, default=3, help="fresh processes per thread count"
    )
    ap.add_argument("--max-time", type=nonnegative_float, default=1.5,
                    help=f"sampling seconds per row and round (at least {MIN_REPS} steps per engine)")  # fmt: skip
    ap.add_argument("--steps", type=positive_int, default=1000, help="T of the memory bar's step")
    ap.add_argument("--speed-steps", type=positive_int, default=SPEED_T, help="T of the speed rows")
    ap.add_argument("--block", type=positive_int, default=BLOCK, help="steps per engine's turn in the "
                    "speed rows, the first untimed (1: each step timed after a pause)")  # fmt: skip
    ap.add_argument(
        "--mem-rounds", type=positive_int, default=1, help="fresh processes per memory variant"
    )
    ap.add_argument("--only", choices=("speed", "memory", "examples", "autocast"), default=None)
    ap.add_argument("--examples", type=lambda s: tuple(s.split(",")), default=EXAMPLE_NAMES,
                    help="with --only examples: which examples")  # fmt: skip
    ap.add_argument("--example-steps", type=positive_int, default=None,
                    help="optimizer steps of each example run (default: the example's own)")  # fmt: skip
    ap.add_argument("--example-threads", type=positive_int, default=2)
    a = ap.parse_args(argv)

    from leanrnn.bench.harness import machine_info
    from leanrnn.bench.report import cpu_line

    res: dict = {
        "argv": argv,
        "machine": machine_info(),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    a.out.mkdir(parents=True, exist_ok=True)

    def saver(key: str):
        """save(partial): res[key] = partial, written out (an interrupted run keeps it)."""

        def save(partial: dict) -> None:
            res[key] = partial
            (a.out / "train_bars.json").write_text(json.dumps(res, indent=1, default=float))

        return save

    if a.only == "examples":
        res["examples"] = run_examples(a.examples, a.example_steps, a.example_threads, a.rounds)
    if a.only == "autocast":
        res["autocast"] = run_speed(a.cells, a.hidden, a.batch, a.threads, a.rounds, a.max_time,
                                    T=a.speed_steps, engines=AUTOCAST_ENGINES,
                                    save=saver("autocast"), block=a.block)  # fmt: skip
    if a.only not in ("memory", "examples", "autocast"):
        res["speed"] = run_speed(a.cells, a.hidden, a.batch, a.threads, a.rounds, a.max_time,
                                 T=a.speed_steps, save=saver("speed"), block=a.block)  # fmt: skip
    if a.only not in ("speed", "examples", "autocast"):
        res["memory"] = run_memory(max(a.hidden), max(a.batch), a.steps, max(a.threads),
                                   a.mem_rounds)  # fmt: skip
    res["machine"]["loadavg_end"] = os.getloadavg()

    load = f"load average {res['machine']['loadavg'][0]:.2f} at start, {res['machine']['loadavg_end'][0]:.2f} at end"
    parts = [cpu_line() + f"; {load}", ""]
    ok = True
    if "speed" in res:
        rows = res["speed"]["rows"]
        parts += [f"## Training step speed (T={a.speed_steps}, C=H; median of {a.rounds} round(s), "
                  "engines interleaved; ratio = faster torch (*) / leanrnn)", "",
                  speed_table(rows), "", _load_line(res["speed"]["rounds"]), ""]  # fmt: skip
        ok &= bool(rows) and all(r.get("passed") and r["grads_ok"] for r in rows)
    if "autocast" in res:
        table, good = autocast_table(res["autocast"]["rows"])
        parts += [f"## Mixed precision: the training step under torch.autocast(bfloat16) (T="
                  f"{a.speed_steps}, C=H; median of {a.rounds} round(s), engines interleaved; "
                  "gradient error relative to torch's float32 gradients)", "", table, "",
                  _load_line(res["autocast"]["rounds"]), ""]  # fmt: skip
        ok &= good
    if "examples" in res:
        rows = res["examples"]["rows"]
        parts += [f"## End to end: the examples ({a.example_threads} threads, median wall time of "
                  f"{a.rounds} run(s) per engine; losses within {LOSS_RTOL:g} relative of "
                  "torch's, wall time below torch's)", "", examples_table(rows), ""]  # fmt: skip
        ok &= bool(rows) and all(r["passed"] for r in rows)
    if "memory" in res:
        m = res["memory"]
        parts += ["## Training step memory", "", memory_table(m), ""]
        ok &= all(b["passed"] for b in m.get("bars", [{"passed": False}])) and m.get(
            "grads_ok", False
        )
    text = "\n".join(parts)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "train_bars.json").write_text(json.dumps(res, indent=1, default=float))
    (a.out / "train_bars.md").write_text(text + "\n")
    print(text)
    print(f"results: {a.out / 'train_bars.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
