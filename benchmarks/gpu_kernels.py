"""Bandwidth of the Pallas quantization kernels vs XLA and a device copy (GPU).

What is measured
----------------
For each kernel of :mod:`pallas_kernels` (int8 / int4 quantize of float32,
int8 / int4 dequantize to bfloat16, 1-bit compression with error feedback of
a float32 gradient, the dithered 1-bit code at block 16, and
``dequantize_sum`` of ``k = 8`` chunks at 1, 4 and 8 bits), on about ``--elems`` (default 2**28 = 256M) elements:

* ``pallas``: the kernel compiled for the GPU, for each ``KernelConfig`` of
  the sweep (``--quick``: the default config only); for the kernels that
  decode int8 / int4 codes, the fastest few again with the other
  ``KernelConfig.decode`` (by conversion or by bits); the best is reported;
* ``xla``: the jitted pure-jnp reference (what XLA fuses it into);
* ``copy``: a device-to-device copy of a float32 array of the same element
  count (``jnp.copy`` under jit), measured in the same run.

Blocks are the library's defaults (:mod:`zeropp_jax.config`): 256 for int8 /
int4 (qwZ and qgZ), 32 for 1 bit (qgZ).

Bandwidth = the fewest bytes the operation must move (each input read once,
each output written once; the copy counts its read and its write) over the
median time of ``--repeats`` timed batches of ``--batch`` back-to-back calls
(after warm-up; ``jax.block_until_ready`` ends each batch, so launches
queue behind each other and the host's dispatch time is hidden).

Goal per kernel: pallas >= 80% of copy bandwidth, and pallas no slower than
XLA (pallas time <= 1.02 x XLA time: 2% for run-to-run noise). The script
prints PASS/FAIL per kernel, one ``JSON`` line with every number, and a
short table last.

Before timing, each kernel is checked against its reference on the GPU on a
smaller input with an awkward shape (and zero blocks): codes, bits and
absmax scales bit-identical; 1-bit scales within the rounding of a
``block``-term sum (and the carry exactly ``x - (+-scale)``);
``dequantize_sum`` bit-identical at 1 bit, within the rounding of ``k``
products (fused multiply-adds) at 4 and 8 bits. The sweep's best config, the
candidate for a new default, is checked the same way; its PASS needs it.

Exits 0 with a message when no GPU is present.

Usage::

  python benchmarks/gpu_kernels.py                 # a few minutes
  python benchmarks/gpu_kernels.py --quick --elems 67108864 --json-out out.json
  python benchmarks/gpu_kernels.py --table-from out.json   # the table of a run cut short
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from zeropp_jax.cli.flags import json_file, positive_int  # noqa: E402

# The library's default blocks (zeropp_jax.config): qwZ 256, qgZ int4/int8
# 256, qgZ 1-bit 32. Kept literal so --help works without importing jax.
BLOCK = 256
BLOCK_1BIT = 32
K = 8
F32_EPS = 2.0**-23
INTERPRET = False  # --cpu-smoke: run the whole script in interpret mode on CPU


def log(message: str) -> None:
    print(f"[gpu_kernels] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------


def time_fn(fn, args, *, repeats: int, batch: int, warmup: int = 3) -> float:
    """Median seconds per call over ``repeats`` batches of ``batch`` queued calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)


# ---------------------------------------------------------------------------
# Verification on a smaller input.
# ---------------------------------------------------------------------------


def _make(shape, block, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    xb = x.reshape(-1, block)
    xb *= (10.0 ** rng.uniform(-3, 3, size=(xb.shape[0], 1))).astype(np.float32)
    xb[rng.permutation(xb.shape[0])[: max(1, xb.shape[0] // 5)]] = 0.0
    return x


def _dither_of(shape):
    """The dithered code's noise for an array of ``shape`` (stream key 1)."""
    from zeropp_jax.wire import dither

    return dither.uniform_noise(dither.stream_key(1), dither.element_counters(shape))


def verify(kind: str, bits: int, block: int, config=None) -> tuple[bool, str]:
    """Kernel vs reference on the GPU, on two shapes, with ``config`` (a
    :class:`pallas_kernels.KernelConfig`; ``None``: the kernel's default).

    ``(3, 35 * block)``: 105 blocks, an odd count, so one block per program;
    ``(16, 64 * block)``: 1024 blocks, full tiles of several blocks.
    """
    results = [_verify_shape(kind, bits, block, r, nb, config) for r, nb in ((3, 35), (16, 64))]
    return all(ok for ok, _ in results), "; ".join(d for _, d in results)


def _verify_shape(kind: str, bits: int, BLOCK: int, rows: int, nblocks: int,
                  config=None) -> tuple[bool, str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from zeropp_jax.wire import quantization as qz

    def same(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if jnp.issubdtype(a.dtype, jnp.floating):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return a.shape == b.shape and bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))

    shape = (rows, nblocks * BLOCK)
    x = jnp.asarray(_make(shape, BLOCK, seed=bits + 7))
    try:
        if kind == "quantize":
            q = pk.quantize(x, bits=bits, block=BLOCK, config=config, interpret=INTERPRET)
            r = pk.quantize_reference(x, bits=bits, block=BLOCK)
            ok = same(q.values, r.values) and same(q.scales, r.scales)
            return ok, "bit-identical" if ok else "codes/scales differ"
        if kind == "dequantize":
            q = qz.quantize(x, bits=bits, block=BLOCK)
            ok = same(pk.dequantize(q, bits=bits, block=BLOCK, dtype=jnp.bfloat16, config=config,
                                    interpret=INTERPRET),
                      pk.dequantize_reference(q, bits=bits, block=BLOCK, dtype=jnp.bfloat16))
            return ok, "bit-identical" if ok else "values differ"
        if kind == "onebit":
            carry = 0.1 * jnp.asarray(_make(shape, BLOCK, seed=99))
            q, c = pk.compress_1bit_ef(x, carry, block=BLOCK, config=config, interpret=INTERPRET)
            rq, _ = pk.compress_1bit_ef_reference(x, carry, block=BLOCK)
            s, rs = np.asarray(q.scales), np.asarray(rq.scales)
            rel = float(np.max(np.abs(s - rs) / np.maximum(rs, 1e-30)))
            signs = qz.unpack_bits(q.values)
            srep = jnp.repeat(q.scales, BLOCK, axis=-1)
            expect = jax.jit(lambda x, s, b: x - jnp.where(b, s, -s))(x + carry, srep, signs)
            carry_ok = bool(np.array_equal(np.asarray(c), np.asarray(expect)))
            ok = same(q.values, rq.values) and rel <= 2 * (BLOCK - 1) * F32_EPS and carry_ok
            bits_eq = "=" if same(q.values, rq.values) else "!="
            carry_txt = "exact" if carry_ok else "WRONG"
            return ok, f"bits {bits_eq}, scale rel diff {rel:.1e}, carry {carry_txt}"
        if kind == "dither":
            xi = _dither_of(shape)
            q = pk.quantize_dithered(x, xi, block=BLOCK, config=config, interpret=INTERPRET)
            r = pk.quantize_dithered_reference(x, xi, block=BLOCK)
            ok = same(q.values, r.values) and same(q.scales, r.scales)
            return ok, "bit-identical" if ok else "bits/scales differ"
        if kind == "dequantize_sum":
            chunks = jnp.asarray(_make((K, nblocks * BLOCK), BLOCK, seed=bits + 11))
            q = qz.quantize(chunks, bits=bits, block=BLOCK)
            out = pk.dequantize_sum(q, bits=bits, block=BLOCK, config=config, interpret=INTERPRET)
            out = np.asarray(out, np.float64)
            ref = np.asarray(pk.dequantize_sum_reference(q, bits=bits, block=BLOCK), np.float64)
            parts = np.asarray(qz.dequantize(q, bits=bits, block=BLOCK, dtype=jnp.float32), np.float64)
            bound = K * F32_EPS * np.abs(parts).sum(axis=0)
            err = np.abs(out - ref)
            exact = bool(np.array_equal(out, ref))
            ok = exact if bits == 1 else bool(np.all(err <= bound))  # 1 bit: no products
            ratio = float(np.max(err / np.maximum(bound, 1e-30)))
            return ok, "bit-identical" if exact else f"max |err|/bound {ratio:.2f}"
    except Exception as e:  # report and carry on with the other kernels
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# Benchmark cases.
# ---------------------------------------------------------------------------


def pallas(op, **kwargs):
    """``config -> (lambda *inputs: op(*inputs, **kwargs, config=config))``."""
    return lambda cfg: (lambda *a: op(*a, **kwargs, config=cfg, interpret=INTERPRET))


def cases(n: int):
    """(name, kind, bits, block, make_inputs, pallas(config) -> fn, xla fn, bytes moved)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from zeropp_jax.wire import quantization as qz

    rows = 64
    cols = n // rows
    m = n // K
    key = jax.random.key(0)

    def x_f32():
        return (jax.random.normal(key, (rows, cols), jnp.float32),)

    def q_of(bits, shape, block):
        def make():
            x = jax.random.normal(key, shape, jnp.float32)
            q = qz.quantize(x, bits=bits, block=block)
            return (jax.block_until_ready(q),)
        return make

    def ef_inputs():
        g = jax.random.normal(key, (rows, cols), jnp.float32)
        carry = 0.1 * jax.random.normal(jax.random.key(1), (rows, cols), jnp.float32)
        return g, carry

    out = []
    b = BLOCK
    for bits in (8, 4):
        out.append((
            f"quantize int{bits} f32", "quantize", bits, b, x_f32,
            pallas(pk.quantize, bits=bits, block=b),
            functools.partial(pk.quantize_reference, bits=bits, block=b),
            4 * n + n * bits // 8 + 4 * n // b,
        ))
    for bits in (8, 4):
        out.append((
            f"dequantize int{bits}->bf16", "dequantize", bits, b, q_of(bits, (rows, cols), b),
            pallas(pk.dequantize, bits=bits, block=b, dtype=jnp.bfloat16),
            functools.partial(pk.dequantize_reference, bits=bits, block=b, dtype=jnp.bfloat16),
            n * bits // 8 + 4 * n // b + 2 * n,
        ))
    b1 = BLOCK_1BIT
    out.append((
        "1-bit EF f32", "onebit", 1, b1, ef_inputs,
        pallas(pk.compress_1bit_ef, block=b1),
        functools.partial(pk.compress_1bit_ef_reference, block=b1),
        8 * n + n // 8 + 4 * n // b1 + 4 * n,
    ))
    def dither_inputs():
        x = x_f32()[0]
        return x, _dither_of(x.shape)

    out.append((
        "1-bit dither f32", "dither", 1, 16, dither_inputs,
        pallas(pk.quantize_dithered, block=16),
        functools.partial(pk.quantize_dithered_reference, block=16),
        8 * n + n // 8 + 4 * n // 16,
    ))
    for bits in (1, 4, 8):
        bb = b1 if bits == 1 else b
        out.append((
            f"dequant_sum {bits}b k={K}", "dequantize_sum", bits, bb, q_of(bits, (K, m), bb),
            pallas(pk.dequantize_sum, bits=bits, block=bb),
            functools.partial(pk.dequantize_sum_reference, bits=bits, block=bb),
            n * bits // 8 + 4 * n // bb + 4 * m,
        ))
    return out


# The sweep: tile sizes x warps (x the split layout for packed bits). Smaller
# tiles for dequantize_sum, which decodes k chunks per output element.
TILES = {"dequantize_sum": (256, 512, 1024, 2048)}
DEFAULT_TILES = (1024, 2048, 4096, 8192)
WARPS = {"dequantize_sum": (1, 2, 4, 8)}
DEFAULT_WARPS = (2, 4, 8)
KERNEL_NAMES = {"quantize": "quantize", "dequantize": "dequantize", "onebit": "compress_1bit_ef",
                "dither": "quantize_dithered", "dequantize_sum": "dequantize_sum"}


# How many of a decoding kernel's fastest configs (pallas_kernels.config.
# DECODING_KERNELS at 4 and 8 bits) are timed again with the other decode.
BITS_DECODE_CANDIDATES = 3


def config_dict(cfg) -> dict:
    return dict(tile_elems=cfg.tile_elems, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                split_bytes=cfg.split_bytes, decode=cfg.decode)


def config_text(cfg: dict | None) -> str:
    """``tile/warps``, ``s`` for the split layout, ``+bits`` for the bits decode:
    e.g. ``4096/8s``, ``1024/1s+bits``."""
    if not cfg:
        return "-"
    decode = "+bits" if cfg.get("decode") == "bits" else ""
    return f"{cfg['tile_elems']}/{cfg['num_warps']}{'s' if cfg['split_bytes'] else ''}{decode}"


def _ratio(xla_ms: float, ms: float | None) -> str:
    """How many times faster than XLA (``xla time / pallas time``)."""
    if ms is None or ms != ms or xla_ms != xla_ms:
        return "-"
    return f"{xla_ms / ms:.2f}x"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elems", type=positive_int, default=2**28, help="elements per input (2**28)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed batches (median reported)")
    parser.add_argument("--batch", type=positive_int, default=10, help="calls per timed batch")
    parser.add_argument("--quick", action="store_true", help="time the default KernelConfig only")
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names to run")
    parser.add_argument("--json-out", default=None, help="also write the results here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="exercise this script on CPU in interpret mode (numbers meaningless)")
    parser.add_argument("--table-from", type=json_file, default=None, metavar="JSON",
                        help="print the table of an earlier run's --json-out file and exit "
                             "(what gpu_check.sh shows when a time limit cut a run short)")
    args = parser.parse_args(argv)
    if args.table_from is not None:
        print(table(args.table_from))
        return 0

    import jax

    global INTERPRET
    INTERPRET = args.cpu_smoke
    if jax.default_backend() != "gpu" and not args.cpu_smoke:
        print(f"No GPU: jax.default_backend() is {jax.default_backend()!r} (devices {jax.devices()}); "
              "nothing to benchmark. Run this on a machine with a GPU.")
        return 0

    import jax.numpy as jnp

    import pallas_kernels as pk

    n = args.elems
    if n % (64 * BLOCK * K) or n <= 0:
        parser.error(f"--elems must be a positive multiple of {64 * BLOCK * K}")
    dev = jax.devices()[0]
    log(f"jax {jax.__version__}, device {dev.device_kind}, {n} elements")

    def configs_for(kind: str, bits: int) -> list:
        """The kernel's default config first, then the sweep (split layouts for packed bits)."""
        default = pk.default_config(KERNEL_NAMES[kind], bits)
        if args.quick:
            return [default]
        splits = (False, True) if bits < 8 else (False,)
        sweep = [pk.KernelConfig(tile_elems=t, num_warps=w, split_bytes=sp)
                 for t in TILES.get(kind, DEFAULT_TILES) for w in WARPS.get(kind, DEFAULT_WARPS)
                 for sp in splits]
        return [default] + [c for c in sweep if c != default]

    # The ceiling: a device-to-device copy of n float32, measured in this run.
    src = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    copy = jax.jit(lambda a: jnp.copy(a))
    t_copy = time_fn(copy, (src,), repeats=args.repeats, batch=args.batch)
    copy_gbs = 8 * n / t_copy / 1e9
    log(f"copy: {t_copy * 1e3:.3f} ms, {copy_gbs:.0f} GB/s")
    del src

    results = []
    from zeropp_jax import provenance

    summary = dict(provenance=provenance.record(), device=dev.device_kind, elems=n, k=K,
                   copy_ms=t_copy * 1e3, copy_gbs=copy_gbs, kernels=results)
    only = [s for s in args.only.split(",") if s]
    for name, kind, bits, block, make, pallas_for, ref_fn, nbytes in cases(n):
        if only and not any(s in name for s in only):
            continue
        ok, detail = verify(kind, bits, block)
        log(f"{name}: verify {'ok' if ok else 'FAILED'} ({detail})")
        inputs = make()
        row = dict(kernel=name, block=block, bytes=nbytes, verified=ok, verify_detail=detail,
                   configs=[])
        try:
            t_xla = time_fn(jax.jit(ref_fn), inputs, repeats=args.repeats, batch=args.batch)
        except Exception as e:
            t_xla = float("nan")
            log(f"{name}: xla failed: {type(e).__name__}: {e}")
        row["xla_ms"] = t_xla * 1e3
        row["xla_gbs"] = nbytes / t_xla / 1e9
        configs = configs_for(kind, bits)
        timed = {}  # config -> seconds

        def time_config(cfg):
            try:
                t = time_fn(pallas_for(cfg), inputs, repeats=args.repeats, batch=args.batch)
            except Exception as e:
                log(f"{name} {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                row["configs"].append(dict(config=repr(cfg), error=f"{type(e).__name__}: {e}"[:500]))
                return
            timed[cfg] = t
            row["configs"].append(dict(config=repr(cfg), ms=t * 1e3, gbs=nbytes / t / 1e9))
            if cfg == configs[0]:
                row.update(default_config=config_dict(cfg), default_ms=t * 1e3,
                           default_gbs=nbytes / t / 1e9,
                           default_pass=bool(ok and nbytes / t >= 0.8 * 8 * n / t_copy
                                             and t <= 1.02 * t_xla))

        for cfg in configs:
            time_config(cfg)
        if KERNEL_NAMES[kind] in pk.config.DECODING_KERNELS and bits in (4, 8):
            # the fastest again, with the other decode
            for cfg in sorted(timed, key=timed.get)[:BITS_DECODE_CANDIDATES]:
                other = dataclasses.replace(
                    cfg, decode="bits" if cfg.decode == "convert" else "convert")
                if other not in timed:
                    time_config(other)
        best = min(((t, cfg) for cfg, t in timed.items()), key=lambda p: p[0], default=None)
        del inputs
        if best is None:
            row.update(pallas_ms=float("nan"), pallas_gbs=0.0, best_config=None,
                       pass_bw=False, pass_xla=False)
        else:
            t, cfg = best
            # the best config is the candidate default: checked like the default
            best_ok, best_detail = (ok, detail) if cfg == configs[0] else verify(kind, bits, block, cfg)
            if cfg != configs[0]:
                log(f"{name}: best {config_text(config_dict(cfg))} verify "
                    f"{'ok' if best_ok else 'FAILED'} ({best_detail})")
            row.update(
                pallas_ms=t * 1e3,
                pallas_gbs=nbytes / t / 1e9,
                best_config=config_dict(cfg),
                best_verified=best_ok,
                best_verify_detail=best_detail,
                pass_bw=nbytes / t >= 0.8 * 8 * n / t_copy,
                pass_xla=t <= 1.02 * t_xla,
            )
        row["pass"] = bool(row.get("best_verified") and row["pass_bw"] and row["pass_xla"])
        for c in row["configs"]:
            log(f"  {c['config']}: " + (f"{c['gbs']:.0f} GB/s" if "gbs" in c else c["error"][:80]))
        log(f"{name}: default {row.get('default_gbs', 0.0):.0f} GB/s, best {row['pallas_gbs']:.0f} "
            f"GB/s, xla {row['xla_gbs']:.0f} GB/s")
        results.append(row)
        if args.json_out:  # after every kernel, so a stage time limit keeps what was measured
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)

    print("JSON " + json.dumps(summary))
    print(table(summary), flush=True)
    return 0


def table(summary: dict) -> str:
    """The short table of a run's ``summary`` (its JSON): per kernel, the
    default config and the sweep's best, each in GB/s, % of the copy, against
    XLA, and PASS when verified, at least 80% of the copy and not slower than
    XLA."""
    copy_gbs, results = summary["copy_gbs"], summary["kernels"]
    lines = [
        f"{summary['device']}, jax {summary.get('provenance', summary).get('jax')}, {summary['elems'] / 2**20:.0f}M elements; "
        f"copy {copy_gbs:.0f} GB/s (goal: >= {0.8 * copy_gbs:.0f} GB/s and <= 1.02x XLA time)",
        f"{'kernel':<22}{'verify':>7}{'xla GB/s':>9} | {'default GB/s':>12}{'%copy':>6}"
        f"{'vs xla':>7}{'config':>14}{'ok':>5} | {'best GB/s':>9}{'%copy':>6}{'vs xla':>7}"
        f"{'config':>14}{'ok':>5}",
    ]
    for r in results:
        d_gbs = r.get("default_gbs", 0.0)
        lines.append(
            f"{r['kernel']:<22}{'ok' if r['verified'] else 'FAIL':>7}{r['xla_gbs']:>9.0f} | "
            f"{d_gbs:>12.0f}{100 * d_gbs / copy_gbs:>5.0f}%"
            f"{_ratio(r['xla_ms'], r.get('default_ms')):>7}{config_text(r.get('default_config')):>14}"
            f"{'PASS' if r.get('default_pass') else 'FAIL':>5} | "
            f"{r['pallas_gbs']:>9.0f}{100 * r['pallas_gbs'] / copy_gbs:>5.0f}%"
            f"{_ratio(r['xla_ms'], r['pallas_ms']):>7}{config_text(r['best_config']):>14}"
            f"{'PASS' if r['pass'] else 'FAIL':>5}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
