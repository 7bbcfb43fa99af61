"""Two (or more) builds of leanrnn on the same forward, interleaved: did a kernel change help?

Each build is a source tree (a git worktree of another commit, say) whose ``src`` is put first
on the path of its own worker process; each native build lives in the cache under its own
fingerprint, so the builds do not collide. The workers load the same random model and input,
check that their outputs agree bit for bit, then take turns: each round, every worker runs
``--reps`` forwards while the others wait on a pipe. This VM's slow and fast spells then fall
on every build alike; compare the medians' ratio, not absolute times.

    git worktree add /tmp/base HEAD~1
    python benchmarks/ab_builds.py base=/tmp/base new=. --cell lstm --hidden 512 --batch 64

Prints each build's median and best time per forward and its ratio to the first build.
Exit status 1 if the builds' outputs differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from leanrnn.cli import positive_int

# The worker: one forward of a single-layer model through Session.run(out=...), timed in turns.
_WORKER = r"""
import hashlib, sys, time
import numpy as np
import leanrnn

cell, H, N, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
leanrnn.set_num_threads(int(sys.argv[5]))
gates = {"lstm": 4, "gru": 3, "rnn": 1}[cell]
rng = np.random.default_rng(0)
k = 1 / np.sqrt(H)
sd = {f"{w}_l0": rng.uniform(-k, k, shape).astype(np.float32) for w, shape in (
    ("weight_ih", (gates * H, H)), ("weight_hh", (gates * H, H)),
    ("bias_ih", (gates * H,)), ("bias_hh", (gates * H,)))}
s = leanrnn.Model.from_state_dict(sd, cell=cell).session
x = rng.standard_normal((T, N, H)).astype(np.float32)
out = [np.empty((T, N, H), np.float32), np.empty((1, N, H), np.float32)]
states = [None]
if cell == "lstm":
    out.append(np.empty((1, N, H), np.float32))
    states.append(None)
s.run(x, *states, None, out=tuple(out))
sys.stdout.write(hashlib.sha256(out[0].tobytes()).hexdigest() + "\n")
sys.stdout.flush()
for line in sys.stdin:
    reps = int(line)
    t = time.perf_counter()
    for _ in range(reps):
        s.run(x, *states, None, out=tuple(out))
    sys.stdout.write(f"{(time.perf_counter() - t) / reps}\n")
    sys.stdout.flush()
"""


def _build(arg: str) -> tuple[str, Path]:
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = Path(arg).name or arg, arg
    src = Path(path).resolve() / "src"
    if not (src / "leanrnn").is_dir():
        raise SystemExit(f"ab_builds: {path!r} has no src/leanrnn (a leanrnn source tree?)")
    return name, src


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH (or PATH) of a leanrnn source tree")
    ap.add_argument("--cell", choices=("lstm", "gru", "rnn"), default="lstm")
    ap.add_argument("--hidden", type=positive_int, default=512, help="H = C")
    ap.add_argument("--batch", type=positive_int, default=64, help="N")
    ap.add_argument("--steps", type=positive_int, default=100, help="T")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--rounds", type=positive_int, default=16)
    ap.add_argument("--reps", type=positive_int, default=2, help="forwards per turn")
    args = ap.parse_args(argv)
    builds = [_build(b) for b in args.builds]
    workers = []
    for name, src in builds:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
        cmd = [sys.executable, "-c", _WORKER, args.cell, str(args.hidden), str(args.batch),
               str(args.steps), str(args.threads)]  # fmt: skip
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        workers.append((name, p))
    try:
        digests = {name: p.stdout.readline().strip() for name, p in workers}
        if len(set(digests.values())) != 1 or "" in digests.values():
            print(f"outputs differ between builds (or a worker failed): {digests}")
            return 1
        times: dict[str, list[float]] = {name: [] for name, _ in workers}
        for r in range(args.rounds):
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            for name, p in order:
                p.stdin.write(f"{args.reps}\n")
                p.stdin.flush()
                times[name].append(float(p.stdout.readline()))
    finally:
        for _, p in workers:
            p.stdin.close()
            p.wait()
    print(f"{args.cell} H={args.hidden} N={args.batch} T={args.steps} threads={args.threads}, "
          f"{args.rounds} rounds x {args.reps} forwards")  # fmt: skip
    first = statistics.median(times[workers[0][0]])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>12}  median {med * 1e3:9.2f} ms  best {min(ts) * 1e3:9.2f} ms  "
              f"ratio to {workers[0][0]} {med / first:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
