"""What the kernels assume of the CPU they are compiled for: its vector ISA (register count and
width) and cache sizes, read at run time, and the register tile and cache blocking derived from
them by one rule — not one machine's constants.

Pure Python (no numba): kernels.native hashes ``signature()`` into the build's fingerprint, and
the bench reports print ``describe()`` beside their tables.

``LEANRNN_ISA=avx512|avx2|sse|neon`` forces the tile of that ISA (the code stays correct on any
CPU — LLVM splits or spills what the hardware lacks — so each tile path can be tested anywhere).
It changes the native build's fingerprint; numba's on-disk JIT cache does not see it, so with
the JIT backend it takes effect only for kernels compiled after it is set.
``LEANRNN_AMX=0`` keeps int8-dynamic's, bf16's and int8's tiles off AMX on a CPU that has it (see
int8_dot, bf16_dot).
"""

from __future__ import annotations

import functools
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .abi import B

ENV_ISA = "LEANRNN_ISA"
ENV_AMX = "LEANRNN_AMX"
# Linux x86-64's arch_prctl: the syscall, its permission requests, the AMX tile data feature.
_SYS_ARCH_PRCTL, _XFEATURE_XTILEDATA = 158, 18
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
# Widest a tile's columns may be, in groups of B: the LSTM's 4-gate block panel. Chunks divide
# it, so an LSTM panel is never cut into unequal chunks.
MAX_GROUPS = 4
_GROUP_CHOICES = (1, 2, 4)
# Independent accumulator sets a single row (GEMV) splits its k loop into, per element size:
# enough FMAs in flight to cover FMA latency x ports on current x86 and Arm cores.
_GEMV_SPLIT = {4: 4, 8: 2}
# How far ahead of its k loop a lone row with one accumulator set prefetches its panel, in
# bytes: about what a core streams during one trip to L3 or memory (~100 ns x ~40 GB/s), the
# latency-bandwidth product, which differs little across current cores (see tile_for).
GEMV_PREFETCH = 4096


@dataclass(frozen=True)
class Isa:
    name: str
    regs: int  # architectural vector registers
    width: int  # bytes per vector register


ISAS = {
    "avx512": Isa("avx512", 32, 64),
    "avx2": Isa("avx2", 16, 32),
    "sse": Isa("sse", 16, 16),
    "neon": Isa("neon", 32, 16),
}


@dataclass(frozen=True)
class Tile:
    """A register tile: ``rows`` rows of A x ``groups`` groups of B columns of C held in
    registers (``vecs`` registers per group); a single row (GEMV) instead takes
    ``gemv_groups`` groups at once with ``split`` accumulator sets."""

    rows: int
    groups: int
    split: int
    vecs: int
    gemv_groups: int
    prefetch: int = 0  # bytes ahead a lone row prefetches its panel rows (0: it does not)

    def registers(self) -> int:
        """Vector registers the k loop keeps live: the accumulators, one broadcast input, and
        (with several rows) the row of weights they share — a lone row uses each weight
        vector once, straight from memory."""
        nv = self.groups * self.vecs
        rows = self.rows * nv + (nv if self.rows > 1 else 0) + 1
        return max(rows, self.split * self.gemv_groups * self.vecs + 1)


def isa_of(flags: set[str], machine: str = "x86_64") -> str:
    """The ISA name for a set of /proc/cpuinfo flags (pure: the tests feed it sets)."""
    if machine.lower() in ("aarch64", "arm64"):
        return "neon"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "sse"


def tile_for(isa: Isa, itemsize: int) -> Tile:
    """The register tile for ``isa`` and an element size (4: float32, 8: float64).

    Per k step a tile of r rows x nv vectors loads nv weight vectors and r broadcast inputs for
    r*nv FMAs; the rule minimises loads per FMA, (r + nv) / (r*nv), over tiles whose live
    registers (Tile.registers) fit the register file, with
    columns in whole groups of B dividing the 4-group LSTM panel; ties go to the wider tile
    (fewer passes over A). AVX-512 float32 gives 6 rows x 64 columns (24 zmm accumulators),
    AVX2 float32 6 x 16 (12 ymm), the classic sgemm shapes.
    """
    vecs = max(1, B * itemsize // isa.width)
    best = None
    for g in _GROUP_CHOICES:
        nv = g * vecs
        r = (isa.regs - nv - 1) // nv
        if r < 2:  # one row holds no weights in registers
            r = 1 if nv + 1 <= isa.regs else 0
        if r < 1:
            continue
        cost = (r + nv) / (r * nv)
        if best is None or cost < best[0] - 1e-12 or (abs(cost - best[0]) <= 1e-12 and g > best[2]):
            best = (cost, r, g)
    if best is None:  # not even one row of one group fits: one row, and let LLVM spill
        r, g = 1, 1
    else:
        _, r, g = best
    # A single row is bound by streaming the weights, not by registers: it takes the widest
    # slice whose accumulators fit (whole 256-byte panel rows stream best — 16 columns at a
    # time at stride 256 B ran the H=512 GEMV at 40% of the speed on a Zen 3), split S ways if
    # registers are left, for enough independent FMA chains.
    gv = next((g for g in sorted(_GROUP_CHOICES, reverse=True) if g * vecs + 1 <= isa.regs), 1)
    split = max(1, min(_GEMV_SPLIT[itemsize], (isa.regs - 1) // (gv * vecs)))
    # With registers for one accumulator set only (AVX2, SSE, NEON float32), the k loop has
    # few loads in flight, and the hardware prefetcher alone left a weight stream from L3
    # latency-bound: prefetching GEMV_PREFETCH bytes ahead ran the H=512 GEMV 5-9% and the
    # H=1024 one (16 MiB, out of L3) 15-20% faster on a Zen 3 (no change at H=128, in L2).
    # A split GEMV (AVX-512: 4 sets) keeps enough loads in flight itself.
    return Tile(r, g, split, vecs, gv, GEMV_PREFETCH if split == 1 else 0)


def _cpuinfo_field(*names: str) -> str:
    """The value of the first /proc/cpuinfo line starting with one of ``names``, "" if none
    (or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def _flags() -> tuple[set[str], str]:
    """(this CPU's feature flags, its machine), read from /proc/cpuinfo once per process (~45
    us a read; bf16_dot, asked by every plan of a reduced-precision model, reads them twice)."""
    return set(_cpuinfo_field("flags", "Features").split()), platform.machine()


@functools.lru_cache(maxsize=1)
def vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), "" where
    it names none; read once per process."""
    return _cpuinfo_field("vendor_id")


@functools.lru_cache(maxsize=1)
def host_isa() -> str:
    """This CPU's ISA, from its feature flags."""
    return isa_of(*_flags())


def isa() -> Isa:
    """The ISA the kernels are compiled for: ``LEANRNN_ISA`` if set, else this CPU's."""
    forced = os.environ.get(ENV_ISA, "").strip().lower()
    if forced:
        if forced not in ISAS:
            from ..errors import LeanRNNError

            raise LeanRNNError(f"[{ENV_ISA}] {forced!r} is not an ISA leanrnn knows; expected "
                               f"one of {', '.join(ISAS)}; unset it to use this CPU's")  # fmt: skip
        return ISAS[forced]
    return ISAS[host_isa()]


def int8_dot(isa_: Isa) -> str:
    """The integer dot product of int8-dynamic's tile (kernels._qdot) on ``isa_``: ``amx``
    (AMX tiles' tdpbusd for 16 rows and more at once: 16 x 16 x 64 u8 x s8 products into a
    16 x 16 int32 tile per instruction; VNNI for the rest) where ``vnni`` would be chosen and
    the CPU has AMX-INT8, the OS granted this process the AMX tile state (amx_permitted) and
    ``LEANRNN_AMX=0`` does not turn it off; ``vnni`` (AVX-512 VNNI's vpdpbusd on 512-bit
    vectors: 64 u8 x s8 products summed into 16 int32 in one instruction) where the AVX-512
    tile is compiled and this CPU has VNNI; ``avx2`` (vpsignb, vpmaddubsw, vpmaddwd and an add
    on 256-bit vectors: four instructions for 32) on other x86 with AVX2 (``LEANRNN_ISA=avx2``
    selects it on a VNNI machine too); ``plain`` LLVM integer IR elsewhere. Every path gives the same
    exact int32 sums.

    The choice is part of signature(), so of every compiled kernel's fingerprint (the native
    build's and numba's cache directory, kernels.native and _jit): a process loads kernels
    with AMX code only after this function has asked for, and got, the tile state."""
    flags = _flags()[0]
    if isa_.name == "avx512" and "avx512_vnni" in flags:
        return "amx" if amx_enabled() and amx_usable() else "vnni"
    # (the CPU's flag too: its AVX2 intrinsics have no lowering without it, where the float
    # tiles' generic vectors do; LEANRNN_ISA=avx2 on a CPU without AVX2 aborted in LLVM)
    return "avx2" if isa_.name in ("avx2", "avx512") and "avx2" in flags else "plain"


def bf16_dot(isa_: Isa) -> str:
    """The product of bf16 and weight-only int8 panels at 4 rows and more (kernels._bf16amx,
    int8's codes widened to bfloat16): ``amx``
    (AMX-BF16's tdpbf16ps on 16 x 16 x 32 tiles, activations split in two bf16 terms) where
    the AVX-512 tile is compiled, the CPU has AMX-BF16 and AVX512-BF16 (the split's
    conversion), the OS granted the tile state and ``LEANRNN_AMX=0`` does not turn it off;
    ``dpbf16`` where the AVX-512 tile is compiled and an AMD CPU has AVX512-BF16 without AMX
    (Zen 4/5): bf16 panels' rows (not int8's) on the float32 tile's registers with
    AVX512-BF16's vdpbf16ps, activations split alike (kernels._simd's dp_loop); else ``fma``:
    every row on the float32 tile, each weight widened after its load. Not dpbf16 on Intel
    CPUs without AMX (Cooper Lake; a Sapphire Rapids with AMX turned off or not granted), whose
    vdpbf16ps issues at half the FMA's rate: on a Sapphire Rapids-class Xeon with AMX off
    (2026-12-03, LSTM H=512, 1 thread) vdpbf16ps ran bf16 2.8x slower than float32 at batch 64
    (928 vs 336 ms; bf16-act 1.35x slower) and at batch 1 2.0x slower than the widening FMA
    tile (12.9 vs 6.5 ms), which ran at float32's speed at batch 64; on a Zen 5 vdpbf16ps ran
    bf16-act 1.73x faster than float32 at batch 64. Part of signature(), like int8_dot."""
    if isa_.name != "avx512" or not has_avx512_bf16():
        return "fma"
    if {"amx_tile", "amx_bf16"} <= _flags()[0] and amx_enabled() and amx_permitted():
        return "amx"
    return "dpbf16" if vendor() == "AuthenticAMD" else "fma"


def has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16 (vcvtneps2bf16, vdpbf16ps)."""
    return "avx512_bf16" in _flags()[0]


def amx_usable() -> bool:
    """Whether this process may run AMX's int8 tiles: the CPU has them (and VNNI, which the
    AMX tile runs its leftover rows on) and Linux granted the tile state (amx_permitted)."""
    need = {"amx_tile", "amx_int8", "avx512_vnni"}
    return need <= _flags()[0] and amx_permitted()


_AMX_OFF, _AMX_ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def amx_enabled() -> bool:
    """Whether ``LEANRNN_AMX`` leaves AMX on (unset, 1, true, yes, on) or turns it off (0,
    false, no, off; any case), read once per process: the fingerprint taken at import (numba's
    cache directory) and every kernel compiled later must agree, or a cache keyed "no AMX"
    could come to hold AMX code. Another value is an error (``off`` or ``False`` left AMX on
    before, silently)."""
    value = os.environ.get(ENV_AMX, "").strip().lower()
    if value not in _AMX_OFF + _AMX_ON:
        from ..errors import LeanRNNError

        raise LeanRNNError(f"[{ENV_AMX}] {os.environ[ENV_AMX]!r} is not a switch leanrnn knows; "
                           "expected 0, false, no or off (AMX off) or 1, true, yes or on (on, "
                           "where the CPU has it); unset it for the default (on)")  # fmt: skip
    return value not in _AMX_OFF


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """Ask Linux, once per process, for the AMX tile data state (arch_prctl
    ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it the first AMX instruction of any
    thread raises SIGILL. The grant is process-wide (every thread, later ones included). False
    off Linux x86-64 or if the kernel refuses (too old, or a sandbox's seccomp)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        req = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        mask = ctypes.c_uint64(0)
        got = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    except (OSError, AttributeError):
        return False
    return req == 0 and got == 0 and bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


@functools.lru_cache(maxsize=1)
def caches() -> dict[str, int]:
    """Per-core data cache sizes in bytes {L1d, L2, L3} (L3: the whole shared cache), from
    sysfs; a typical current core's sizes where the OS does not say."""
    return _read_caches(Path("/sys/devices/system/cpu/cpu0/cache"))


def _read_caches(root: Path) -> dict[str, int]:
    """caches() from the sysfs folder ``root`` (tests give a fake one)."""
    out = {"L1d": 32 << 10, "L2": 1 << 20, "L3": 32 << 20}
    try:
        for d in sorted(root.glob("index*")):
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            if kind == "Instruction":
                continue
            name = "L1d" if level == 1 else f"L{level}"
            size = _size((d / "size").read_text())
            # a size under 1 KiB is no data cache (a hypervisor's "0K"): the blocking derived
            # from it crashed every run (kc: a negative shift), where an unreadable one is
            # the typical core's
            if name in out and size >= 1 << 10:
                out[name] = size
    except (OSError, ValueError):
        pass
    return out


def kc(l2: int) -> int:
    """Inputs per K slice of the multi-row panel GEMM: the [KC, 4*B] float32 panel slice the
    row tiles share takes a quarter of L2 (the rest holds the rows of A and C passing through).
    1 MiB of L2 (Zen 5) gives 1024; 512 KiB (Zen 3) 512; 2 MiB (Sapphire Rapids) 2048."""
    k = l2 // (4 * MAX_GROUPS * B * 4)
    return max(128, 1 << max(k.bit_length() - 1, 0))  # a power of two: whole cache lines per row


def row_chunk(l2: int, kc_: int, align: int) -> int:
    """Input rows per input-projection task: the [rows, KC] float32 chunk of x takes the other
    three quarters of L2 — 192 rows whenever KC comes from the same L2 (as Zen 5's sweep found),
    rounded down to a multiple of the tile heights."""
    rows = 3 * l2 // (4 * kc_ * 4)
    return max(align, rows // align * align)


def blocking(isa_: Isa) -> tuple[int, int, int]:
    """(ALIGN, KC, ROWS) of the input projection on ``isa_`` (kernels.gemm): row chunks are a
    multiple of every dtype's tile height (ALIGN), K slices KC long, ROWS rows per task. Pure,
    so the engine sizes per-task scratch (the int8-dynamic rows) without importing numba."""
    align = math.lcm(*(tile_for(isa_, size).rows for size in (4, 8)))
    l2 = caches()["L2"]
    kc_ = kc(l2)
    return align, kc_, row_chunk(l2, kc_, align)


# Register tiles of rows per thread from which the threads of a recurrence take batch slices
# (kernels._sync.share) instead of splitting every step's unit blocks: a thread then streams all
# of R per step instead of 1/parts of it, and each weight it loads serves >= 4 tiles of rows (at
# most 1/6 byte per multiply-add on a 6-row tile: what the block split already needs at N=24);
# below, the block split's smaller weight stream matters more than the barrier it costs.
SHARE_TILES = 4


def batch_slices(N: int, parts: int, isa_: Isa | None = None) -> bool:
    """Whether ``parts`` threads run a recurrence of batch ``N`` on batch slices (each thread
    its own samples, kernels._sync.share): each would get SHARE_TILES tiles of ALIGN rows."""
    return parts > 1 and N >= SHARE_TILES * blocking(isa_ or isa())[0] * parts


def cpu_model(cpuinfo: str) -> str:
    """The CPU's name in /proc/cpuinfo text, with its x86 family and model numbers: a VM may
    name only the brand ("AMD EPYC" for Zen 3 and Zen 5 alike), and the numbers tell the core
    generation apart (pure: the tests feed it text)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or fields.get("Model") or ""
    family, model = fields.get("cpu family"), fields.get("model")
    if name and family and model:
        return f"{name} (family {family}, model {model})"
    return name


def cpu_name() -> str:
    """This machine's CPU as ``cpu_model`` names it, else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            model = cpu_model(f.read(1 << 16))
    except OSError:
        model = ""
    return model or platform.processor() or platform.machine()


def describe() -> str:
    """One line naming the CPU and what the kernels are compiled for (compiled_for), for the
    bench reports."""
    from .. import config

    usable = config.cores()
    n = os.cpu_count()
    cpus = f"{n} logical CPUs" if usable == n else f"{usable} of {n} logical CPUs usable"
    return f"{cpu_name()}, {cpus}; {compiled_for()}"


def compiled_for() -> str:
    """The vector ISA, float32 tile, int8 dot product (int8_dot) and caches the kernels are
    compiled for (``leanrnn info``'s kernels_for)."""
    c = caches()
    a = isa()
    forced = f" (forced by {ENV_ISA})" if os.environ.get(ENV_ISA) else ""
    t = tile_for(a, 4)
    return (f"{a.name}{forced}: {a.regs} x {a.width * 8}-bit vector registers, float32 tile "
            f"{t.rows}x{t.groups * B}, int8 dot {int8_dot(a)}, bf16 {bf16_dot(a)}; L1d {c['L1d'] >> 10} KiB, "
            f"L2 {c['L2'] >> 10} KiB, L3 {c['L3'] >> 20} MiB")  # fmt: skip


def signature() -> str:
    """Everything here that compiled code depends on (for the native build's fingerprint)."""
    a = isa()
    return f"isa={a.name} dot={int8_dot(a)} bf16={bf16_dot(a)} caches={sorted(caches().items())}"
