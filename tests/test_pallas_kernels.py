"""Pallas kernels (pallas_kernels) against their jnp references.

Every test that takes ``mode`` runs in

* ``interpret`` (always): the kernel in Pallas interpret mode on the CPU
  device, the reference by XLA on the CPU;
* ``compiled`` (only with ``PALLAS_KERNELS_COMPILED=1`` and a GPU as the
  default backend, see benchmarks/gpu_check.sh): the kernel compiled for the
  GPU, the reference by XLA on the same GPU.

The same assertions hold in both modes:

* bit-identical (``assert_array_equal``, NaN positions included): int8 /
  int4 codes and their scales (a max and one IEEE division per block), every
  dequantized value, 1-bit signs, and ``dequantize_sum`` at 1 bit (a chain
  of adds in a fixed order, no products);
* bit-identical on inputs whose block sums and products are exact (small
  dyadic values), where the two results below must not depend on order or
  fused multiply-adds;
* otherwise within the rounding that the association order of a sum can
  change (the compilers choose it, see pallas_kernels/onebit.py and
  dequant_sum.py): 1-bit scales within ``2 * (block - 1)`` float32 ulp
  (relative; a sum of ``block`` terms >= 0), plus one bfloat16 rounding step
  when stored as bfloat16, with the new carry EXACTLY ``x - (+-scale)`` for
  the kernel's own scales; ``dequantize_sum`` at 4 and 8 bits within
  ``k * eps * sum_c |d_c|`` (a product rounded or fused into the add).

Inputs are random normals with magnitudes spread over decades, on awkward
shapes (odd numbers of blocks, lengths that are not multiples of 128 or of
``8 * block``, 0 to 2 leading dims), with zero blocks mixed in and one huge
value in every other block; never all zeros.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _common
from pallas_kernels.references import packing
from pallas_kernels.references import quantization as qz
from pallas_kernels.references.quantization import Quantized

from test_kernel_tiles import _eqns

pytestmark = pytest.mark.slow  # the kernels run in the Pallas interpreter on CPU

try:  # The GPU image may lack hypothesis; the property test is then skipped.
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

F32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = 2.0**-7

COMPILED = os.environ.get("PALLAS_KERNELS_COMPILED") == "1" and jax.default_backend() == "gpu"
MODES = ["interpret"] + (["compiled"] if COMPILED else [])


@pytest.fixture(params=MODES)
def mode(request):
    """Runs the test body on the CPU (interpret) or the GPU (compiled)."""
    device = jax.devices("cpu")[0] if request.param == "interpret" else jax.devices("gpu")[0]
    with jax.default_device(device):
        yield request.param


def _interp(mode) -> bool:
    return mode == "interpret"


# ---------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------

# (shape, block): odd block counts, lengths not multiples of 128 / 8*block,
# 0, 1 and 2 leading dims.
SHAPES = [
    ((3 * 32,), 32),  # 96 elements, 3 blocks, no leading dim
    ((5, 7 * 8), 8),  # rows of 56, 35 blocks
    ((2, 3, 5 * 64), 64),  # rows of 320, 30 blocks
    ((3, 256), 256),  # one block per row, 3 blocks
]
SHAPE_IDS = ["96-b32", "5x56-b8", "2x3x320-b64", "3x256-b256"]

# Small tiles so several programs (and tb > 1) are exercised on small inputs,
# in the split layout (KernelConfig.split_bytes); the default 2-D layout too.
CONFIGS = [pk.KernelConfig(tile_elems=64, num_warps=1, split_bytes=True), pk.KernelConfig()]


def make_x(shape, block, dtype=jnp.float32, seed=0, dyadic=False):
    """Random (..., n): spread magnitudes, zero blocks, one spike per other block.

    ``dyadic``: small integers times a power of two per block (exact in
    bfloat16), so that sums of up to 256 of them are exact in float32.
    """
    rng = np.random.default_rng(seed)
    lead, n = shape[:-1], shape[-1]
    if dyadic:
        x = rng.integers(-64, 65, size=shape).astype(np.float32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    xb = x.reshape(-1, n // block, block)
    rows, nb = xb.shape[:2]
    if dyadic:
        xb *= (2.0 ** rng.integers(-12, 13, size=(rows, nb, 1))).astype(np.float32)
    else:
        xb *= (10.0 ** rng.uniform(-3, 3, size=(rows, nb, 1))).astype(np.float32)
    flat = xb.reshape(rows * nb, block)
    ids = rng.permutation(rows * nb)
    zero = ids[: max(1, (rows * nb) // 5)] if rows * nb > 1 else ids[:0]
    flat[zero] = 0.0
    for b in ids[len(zero) :: 2]:  # one huge value in every other non-zero block
        big = 8.0 if dyadic else 1e3  # dyadic: 512 * 2**e
        flat[b, rng.integers(block)] = np.float32(rng.choice([-1, 1]) * big * np.abs(flat[b]).max())
    assert np.any(flat != 0)
    return jnp.asarray(flat.reshape(*lead, n)).astype(dtype)


def quantized_input(shape, block, bits, scale_dtype, seed):
    return qz.quantize(make_x(shape, block, seed=seed), bits=bits, block=block, scale_dtype=scale_dtype)


def dyadic_quantized(shape, block, bits, scale_dtype, seed):
    """Random wire values (every code, -8 included) and scales ``j * 2**-6``, j in 1..16.

    Every ``code * scale`` and every partial sum over up to 16 chunks is
    exact in float32, so order and fused multiply-adds cannot matter.
    """
    rng = np.random.default_rng(seed)
    *lead, n = shape
    nbytes = n * bits // 8
    if bits == 8:
        values = jnp.asarray(rng.integers(-127, 128, size=(*lead, nbytes)).astype(np.int8))
    else:
        values = jnp.asarray(rng.integers(0, 256, size=(*lead, nbytes)).astype(np.uint8))
    scales = rng.integers(1, 17, size=(*lead, n // block)).astype(np.float32) * np.float32(2.0**-6)
    scales[..., 0] = 0.0  # a zero block
    return Quantized(values=values, scales=jnp.asarray(scales).astype(scale_dtype))


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def assert_same(actual, desired):
    actual, desired = jnp.asarray(actual), jnp.asarray(desired)
    assert actual.shape == desired.shape and actual.dtype == desired.dtype, (
        f"{actual.dtype}{actual.shape} != {desired.dtype}{desired.shape}"
    )
    if jnp.issubdtype(actual.dtype, jnp.floating):  # exact up-cast; numpy sees bf16 NaNs there
        actual, desired = actual.astype(jnp.float32), desired.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(desired))


def assert_quantized_same(q, r):
    assert_same(q.values, r.values)
    assert_same(q.scales, r.scales)


def assert_onebit_close(x, q, carry, r, block, scale_dtype):
    """1-bit result (q, carry) vs reference r = (q_ref, carry_ref): see module docstring."""
    assert_same(q.values, r[0].values)
    assert q.scales.dtype == r[0].scales.dtype and carry.dtype == jnp.float32
    assert q.scales.shape == r[0].scales.shape and carry.shape == r[1].shape
    rtol = 2 * (block - 1) * F32_EPS + (BF16_EPS if scale_dtype == jnp.bfloat16 else 0.0)
    np.testing.assert_allclose(f32(q.scales), f32(r[0].scales), rtol=rtol, atol=0)
    # The carry must be exactly x - (+-scale) with the kernel's own scales,
    # computed by XLA on the same device (which may flush subnormals, as the
    # kernel's arithmetic does there).
    s = jnp.repeat(jnp.asarray(q.scales).astype(jnp.float32), block, axis=-1)
    signs = packing.unpack_bits(q.values)
    assert_same(carry, jax.jit(lambda x, s, b: x - jnp.where(b, s, -s))(x, s, signs))


# ---------------------------------------------------------------------------
# quantize / dequantize (bits 8 and 4).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,block", SHAPES, ids=SHAPE_IDS)
def test_quantize_matches_reference(mode, bits, dtype, shape, block):
    scale_dtype = jnp.bfloat16 if block == 64 else jnp.float32
    x = make_x(shape, block, dtype, seed=bits)
    config = CONFIGS[len(shape) % 2]
    q = pk.quantize(x, bits=bits, block=block, scale_dtype=scale_dtype, config=config,
                    interpret=_interp(mode))
    assert_quantized_same(q, pk.quantize_reference(x, bits=bits, block=block, scale_dtype=scale_dtype))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,block", SHAPES[1:], ids=SHAPE_IDS[1:])
def test_dequantize_matches_reference(mode, bits, dtype, shape, block):
    scale_dtype = jnp.bfloat16 if block == 8 else jnp.float32
    q = quantized_input(shape, block, bits, scale_dtype, seed=10 + bits)
    config = CONFIGS[len(shape) % 2]
    out = pk.dequantize(q, bits=bits, block=block, dtype=dtype, config=config, interpret=_interp(mode))
    assert_same(out, pk.dequantize_reference(q, bits=bits, block=block, dtype=dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_rounds_half_to_even(mode, bits):
    """Ties x/scale = k + 1/2 round to even, as jnp.round does."""
    qmax = {8: 127, 4: 7}[bits]
    halves = np.arange(-qmax, qmax, dtype=np.float32) + 0.5  # -qmax+0.5 ... qmax-0.5
    block = 16 if bits == 4 else 256
    row = np.resize(halves, block)
    row[0] = qmax  # absmax = qmax -> scale exactly 1
    x = jnp.asarray(np.stack([row, -row, 3 * row]))  # scale 3: still exact ties
    q = pk.quantize(x, bits=bits, block=block, interpret=_interp(mode))
    r = pk.quantize_reference(x, bits=bits, block=block)
    assert_quantized_same(q, r)
    codes = q.values if bits == 8 else packing.unpack_int4(q.values)
    np.testing.assert_array_equal(np.asarray(codes[0, 1:8]), np.round(row[1:8]).astype(np.int8))


SPECIAL_BLOCKS = {
    "nan": [np.nan, 1.0],
    "inf": [np.inf, -2.0],
    "-inf": [-np.inf, 3.0],
    "zeros": [0.0, 0.0],
    "-zeros": [-0.0, -0.0],
    "tiny": [1e-38, -3e-39],  # scale underflows into / below float32 subnormals
    "huge": [3e38, -1e38],  # |x| / block for 1 bit must not overflow
}


def _special_x(block):
    rng = np.random.default_rng(5)
    rows = []
    for a, b in SPECIAL_BLOCKS.values():
        row = rng.standard_normal(block).astype(np.float32) * np.float32(abs(b) / 10)
        row[3], row[block - 1] = a, b
        rows.append(row)
    rows.append(rng.standard_normal(block).astype(np.float32))  # an ordinary block
    return jnp.asarray(np.stack(rows))


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_special_blocks(mode, bits, scale_dtype):
    """Non-finite blocks -> NaN scale; zero / underflowing blocks -> zeros; others untouched."""
    block = 32
    x = _special_x(block)
    interp = _interp(mode)
    if bits == 1:
        carry = jnp.zeros(x.shape, jnp.float32)
        q, c = pk.compress_1bit_ef(x, carry, block=block, scale_dtype=scale_dtype, interpret=interp)
        r = pk.compress_1bit_ef_reference(x, carry, block=block, scale_dtype=scale_dtype)
        assert_onebit_close(x, q, c, r, block, scale_dtype)
    else:
        q = pk.quantize(x, bits=bits, block=block, scale_dtype=scale_dtype, interpret=interp)
        r = pk.quantize_reference(x, bits=bits, block=block, scale_dtype=scale_dtype)
        assert_quantized_same(q, r)
        out = pk.dequantize(q, bits=bits, block=block, dtype=jnp.float32, interpret=interp)
        assert_same(out, pk.dequantize_reference(q, bits=bits, block=block, dtype=jnp.float32))
    s = f32(q.scales)[:, 0]
    assert np.isnan(s[:3]).all() and np.isfinite(s[3:]).all()
    assert (s[3:5] == 0).all()


def test_a_finite_block_past_bfloat16s_range_keeps_a_finite_scale(mode):
    """A 1-bit block whose mean |x| rounds past bfloat16's largest value gets
    that value as its scale (not inf, which decoded to inf and left a NaN carry)."""
    x = jnp.asarray(np.stack([np.full(16, 3.3963e38, np.float32),
                              np.linspace(-3.4e38, 3.4e38, 16, dtype=np.float32)]))
    carry = jnp.zeros(x.shape, jnp.float32)
    q, c = pk.compress_1bit_ef(x, carry, block=16, scale_dtype=jnp.bfloat16,
                               interpret=_interp(mode))
    r = pk.compress_1bit_ef_reference(x, carry, block=16, scale_dtype=jnp.bfloat16)
    assert_onebit_close(x, q, c, r, 16, jnp.bfloat16)
    assert f32(q.scales)[0, 0] == float(jnp.finfo(jnp.bfloat16).max)
    assert np.isfinite(f32(q.scales)).all() and np.isfinite(f32(c)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_empty_input(bits):
    x = jnp.zeros((0, 64), jnp.float32)
    q = pk.quantize(x, bits=bits, block=32, interpret=True)
    assert_quantized_same(q, pk.quantize_reference(x, bits=bits, block=32))
    assert pk.dequantize(q, bits=bits, block=32, interpret=True).shape == (0, 64)


# ---------------------------------------------------------------------------
# 1-bit with error feedback.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,block", SHAPES, ids=SHAPE_IDS)
def test_compress_1bit_ef_matches_reference(mode, dtype, shape, block):
    scale_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 and block != 8 else jnp.float32
    g = make_x(shape, block, dtype, seed=3)
    carry = 0.1 * make_x(shape, block, jnp.float32, seed=4)
    q, new_carry = pk.compress_1bit_ef(g, carry, block=block, scale_dtype=scale_dtype,
                                       config=CONFIGS[len(shape) % 2], interpret=_interp(mode))
    r = pk.compress_1bit_ef_reference(g, carry, block=block, scale_dtype=scale_dtype)
    x = jnp.asarray(g).astype(jnp.float32) + carry
    assert_onebit_close(x, q, new_carry, r, block, scale_dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16], ids=["sf32", "sbf16"])
def test_compress_1bit_ef_exact_on_dyadic_inputs(mode, dtype, scale_dtype):
    """Exact block sums: scales and carries bit-identical too, whatever the order."""
    shape, block = (2, 5 * 64), 64
    g = make_x(shape, block, dtype, seed=7, dyadic=True)
    # Same per-block power of two as g, so x = g + carry (-g/4 or 5g/4, sign
    # flipped where the mask is set) stays a small integer times 2**e.
    g32 = g.astype(jnp.float32)
    mask = jnp.asarray(np.random.default_rng(8).random(shape) < 0.3)
    carry = jnp.where(mask, -1.25 * g32, 0.25 * g32)
    q, new_carry = pk.compress_1bit_ef(g, carry, block=block, scale_dtype=scale_dtype,
                                       config=CONFIGS[0], interpret=_interp(mode))
    r = pk.compress_1bit_ef_reference(g, carry, block=block, scale_dtype=scale_dtype)
    assert_quantized_same(q, r[0])
    assert_same(new_carry, r[1])


@pytest.mark.parametrize(
    "dtype,scale_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)], ids=["f32", "bf16"]
)
def test_compress_1bit_ef_iterations(mode, dtype, scale_dtype):
    """Five steps with the carry threaded through the kernel.

    Each step is compared with the reference started from the kernel's
    carry: scales may differ in the last bits (module docstring), which
    would otherwise let two independent trajectories drift apart.
    """
    shape, block = (2, 3 * 64), 64
    carry = jnp.zeros(shape, jnp.float32)
    for step in range(5):
        g = make_x(shape, block, dtype, seed=100 + step)
        q, carry_next = pk.compress_1bit_ef(g, carry, block=block, scale_dtype=scale_dtype,
                                            interpret=_interp(mode))
        r = pk.compress_1bit_ef_reference(g, carry, block=block, scale_dtype=scale_dtype)
        x = jnp.asarray(g).astype(jnp.float32) + carry
        assert_onebit_close(x, q, carry_next, r, block, scale_dtype)
        carry = carry_next
    assert np.abs(np.asarray(carry)).max() > 0


def test_error_feedback_is_lossless_over_steps():
    """Sum of decoded updates + final carry == sum of gradients (up to float32 rounding)."""
    shape, block = (4 * 32,), 32
    carry = jnp.zeros(shape, jnp.float32)
    sent = np.zeros(shape, np.float64)
    total = np.zeros(shape, np.float64)
    for step in range(4):
        g = make_x(shape, block, seed=200 + step)
        q, carry = pk.compress_1bit_ef(g, carry, block=block, interpret=True)
        sent += f32(qz.dequantize(q, bits=1, block=block, dtype=jnp.float32))
        total += f32(g)
    np.testing.assert_allclose(sent + f32(carry), total, rtol=1e-5, atol=1e-6 * np.abs(total).max())


# ---------------------------------------------------------------------------
# dequantize_sum.
# ---------------------------------------------------------------------------

# (lead, k, m, block, scale_dtype)
SUM_CASES = [
    ((), 1, 3 * 32, 32, jnp.float32),
    ((), 3, 5 * 64, 64, jnp.bfloat16),
    ((2,), 8, 7 * 8, 8, jnp.float32),
    ((2, 1), 5, 256, 256, jnp.float32),
]
SUM_IDS = ["k1-96-b32", "k3-320-b64-bf16", "2xk8-56-b8", "2x1xk5-256-b256"]


def assert_sum_close(out, ref, q, bits, block):
    if bits == 1:  # no products: the fixed order makes it bit-identical
        assert_same(out, ref)
        return
    assert out.dtype == jnp.float32 and out.shape == ref.shape
    parts = f32(qz.dequantize(q, bits=bits, block=block, dtype=jnp.float32)).astype(np.float64)
    k = parts.shape[-2]
    bound = k * F32_EPS * np.abs(parts).sum(axis=-2)
    err = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64))
    assert np.all(err <= bound), f"max err {err.max()} > bound"


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("lead,k,m,block,scale_dtype", SUM_CASES, ids=SUM_IDS)
def test_dequantize_sum_matches_reference(mode, bits, lead, k, m, block, scale_dtype):
    q = quantized_input((*lead, k, m), block, bits, scale_dtype, seed=20 + bits + k)
    out = pk.dequantize_sum(q, bits=bits, block=block, config=CONFIGS[k % 2], interpret=_interp(mode))
    assert_sum_close(out, pk.dequantize_sum_reference(q, bits=bits, block=block), q, bits, block)


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("lead,k,m,block,scale_dtype", SUM_CASES[1:3], ids=SUM_IDS[1:3])
def test_dequantize_sum_exact_on_dyadic_inputs(mode, bits, lead, k, m, block, scale_dtype):
    q = dyadic_quantized((*lead, k, m), block, bits, scale_dtype, seed=40 + bits)
    out = pk.dequantize_sum(q, bits=bits, block=block, config=CONFIGS[0], interpret=_interp(mode))
    assert_same(out, pk.dequantize_sum_reference(q, bits=bits, block=block))


def every_byte_at_every_position(bits: int, chunks: int = 1) -> jax.Array:
    """``(chunks, 1024)`` wire values: each of the 256 byte values at each byte of a
    32-bit word (so every code at every position of the packed units the kernels
    load); chunk ``c`` rotated by ``c`` bytes. int8 for bits=8 (-128 included),
    uint8 otherwise."""
    words = np.arange(256)[:, None] + 64 * np.arange(4)[None, :]  # byte i of word w
    row = (words % 256).astype(np.uint8).reshape(-1)
    values = np.stack([np.roll(row, c) for c in range(chunks)])
    return jnp.asarray(values.view(np.int8) if bits == 8 else values)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("split", [True, False], ids=["split", "plain"])
def test_decode_by_bits_matches_reference_on_every_code(mode, bits, split):
    """``KernelConfig(decode="bits")`` decodes every int8 / int4 code at every
    position exactly as the reference: ``dequantize`` to the bit, and
    ``dequantize_sum`` too on scales whose products and sums are exact."""
    block = 64
    config = pk.KernelConfig(tile_elems=256, num_warps=1, split_bytes=split, decode="bits")
    values = every_byte_at_every_position(bits)
    nb = values.shape[-1] * 8 // bits // block
    rng = np.random.default_rng(bits)
    scales = np.abs(rng.normal(size=(1, nb))).astype(np.float32)
    scales[0, 1] = 0.0
    q = Quantized(values=values, scales=jnp.asarray(scales))
    for dtype in (jnp.float32, jnp.bfloat16):
        out = pk.dequantize(q, bits=bits, block=block, dtype=dtype, config=config,
                            interpret=_interp(mode))
        assert_same(out, pk.dequantize_reference(q, bits=bits, block=block, dtype=dtype))
    k = 5
    values = every_byte_at_every_position(bits, chunks=k)
    scales = dyadic_quantized((k, values.shape[-1] * 8 // bits), block, bits, jnp.float32, 7).scales
    q = Quantized(values=values, scales=scales)
    out = pk.dequantize_sum(q, bits=bits, block=block, config=config, interpret=_interp(mode))
    assert_same(out, pk.dequantize_sum_reference(q, bits=bits, block=block))


def test_dequantize_sum_order_is_sequential(mode):
    """Chunks are added in order from 0.0: (1e8 + -1e8) + 1 == 1; other orders give 0."""
    block, k = 8, 3
    codes = np.zeros((k, block), np.int8)
    codes[0], codes[1], codes[2] = 1, -1, 1
    scales = np.array([[1e8], [1e8], [1.0]], np.float32)
    q = Quantized(values=jnp.asarray(codes), scales=jnp.asarray(scales))
    out = np.asarray(pk.dequantize_sum(q, bits=8, block=block, interpret=_interp(mode)))
    np.testing.assert_array_equal(out, np.ones(block, np.float32))
    np.testing.assert_array_equal(np.asarray(pk.dequantize_sum_reference(q, bits=8, block=block)), out)


# ---------------------------------------------------------------------------
# Configuration, argument checks, lowering.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tile_elems=1000),
        dict(tile_elems=4),
        dict(tile_elems=True),
        dict(num_warps=3),
        dict(num_warps=64),
        dict(num_stages=0),
        dict(split_bytes=1),
        dict(decode="bit"),
    ],
)
def test_kernel_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        pk.KernelConfig(**kwargs)


def _launch(fn, *args) -> tuple[int, int]:
    """``(programs, num_warps)`` of the one ``pallas_call`` that ``fn`` makes (tracing only)."""
    calls = [e for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1, calls
    params = calls[0].params
    return int(np.prod(params["grid_mapping"].grid)), params["compiler_params"].num_warps


def test_default_config_per_kernel():
    """``config=None`` is the kernel's measured default: the config the
    kernels look up, and each kernel's launch (programs over a 256-block
    array, warps); unknown names are refused."""
    for kernel in pk.config.KERNELS:
        for bits in (1, 4, 8):
            assert isinstance(pk.default_config(kernel, bits), pk.KernelConfig)
            assert _common.get_config(None, kernel, bits) == pk.default_config(kernel, bits)
    block, n = 64, 4096
    nb = 4 * n // block  # blocks of x (4, n), and of each of dequantize_sum's chunks (4 n)
    x = jnp.zeros((4, n), jnp.float32)
    launches = {("compress_1bit_ef", 1): (lambda a: pk.compress_1bit_ef(a, a, block=block,
                                                                        interpret=True), x),
                ("quantize_dithered", 1): (lambda a: pk.quantize_dithered(a, a, block=block,
                                                                          interpret=True), x)}
    for bits in (8, 4):
        q = pk.quantize_reference(x, bits=bits, block=block)
        launches["quantize", bits] = (
            lambda a, bits=bits: pk.quantize(a, bits=bits, block=block, interpret=True), x)
        launches["dequantize", bits] = (lambda v, s, bits=bits: pk.dequantize(
            Quantized(v, s), bits=bits, block=block, interpret=True), *q)
    for bits in (1, 4, 8):
        chunks = pk.quantize_reference(jnp.zeros((4, 4 * n), jnp.float32), bits=bits, block=block)
        launches["dequantize_sum", bits] = (lambda v, s, bits=bits: pk.dequantize_sum(
            Quantized(v, s), bits=bits, block=block, interpret=True), *chunks)
    for (kernel, bits), (fn, *args) in launches.items():
        cfg = pk.default_config(kernel, bits)
        want = (nb // _common.tile_blocks(nb, block, cfg.tile_elems), cfg.num_warps)
        assert _launch(fn, *args) == want, (kernel, bits)
    with pytest.raises(ValueError, match="unknown kernel"):
        pk.default_config("quantise", 8)
    x = make_x((4, 512), 64, seed=1)
    for bits in (8, 4):
        cfg = pk.default_config("quantize", bits)
        assert_quantized_same(pk.quantize(x, bits=bits, block=64, interpret=True),
                              pk.quantize(x, bits=bits, block=64, config=cfg, interpret=True))


def test_stored_scale_rounds_to_nearest_even_on_the_bfloat16_grid():
    """Integer rounding == the float32 -> bfloat16 conversion (RNE) on every finite value >= 0,
    except that values the conversion rounds to inf saturate at bfloat16's largest value."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, size=20000, dtype=np.uint32)
    # ties and their neighbours, the largest finite values, subnormals, zero
    low = np.array([0x8000, 0x7FFF, 0x8001, 0x18000, 0x17FFF], np.uint32)
    bits = np.concatenate([bits, (bits[:2000] & 0xFFFF0000) | low[:, None].repeat(400, 1).ravel(),
                           np.array([0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 1, 0], np.uint32)])
    v = jnp.asarray(bits.view(np.float32))
    got = qz.stored_scale(v, jnp.bfloat16)
    want = np.asarray(v.astype(jnp.bfloat16).astype(jnp.float32))
    overflowed = np.isinf(want)
    assert overflowed.sum() >= 2  # 0x7F7FFFFF and 0x7F7F8000 round past the largest value
    want = np.where(overflowed, float(jnp.finfo(jnp.bfloat16).max), want)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert qz.stored_scale(v, jnp.float32) is v


def test_scale_is_a_multiply_by_the_float32_reciprocal():
    """``absmax * float32(1 / qmax)``: 49 -> 7.000000476837158 at 4 bits on every backend.

    A division by the constant 7 gives 7.0 where it is IEEE (numpy, a GPU
    kernel) and 7.000000476837158 where XLA rewrites it as a multiply (under
    jit on GPU, and on CPU in recent versions);
    the library defines the multiply, which every backend rounds the same.
    """
    x = jnp.zeros((1, 8), jnp.float32).at[0, 3].set(49.0)
    for bits, qmax in ((4, 7), (8, 127)):
        want = np.float32(49.0) * np.float32(1.0 / qmax)
        assert float(qz.quantize(x, bits=bits, block=8).scales[0, 0]) == float(want)
        assert float(pk.quantize(x, bits=bits, block=8, interpret=True).scales[0, 0]) == float(want)
    assert float(np.float32(49.0) * np.float32(1.0 / 7)) == 7.000000476837158


def test_kernel_config_is_static_and_frozen():
    cfg = pk.KernelConfig(tile_elems=1024, num_warps=8)
    assert hash(cfg) == hash(pk.KernelConfig(tile_elems=1024, num_warps=8))
    with pytest.raises(AttributeError):
        cfg.num_warps = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "num_blocks,block,tile_elems,expected",
    [(30, 64, 8192, 2), (3, 32, 8192, 1), (1 << 20, 256, 8192, 32), (64, 4096, 1024, 1), (48, 8, 64, 8)],
)
def test_tile_blocks_divides_and_fits(num_blocks, block, tile_elems, expected):
    tb = _common.tile_blocks(num_blocks, block, tile_elems)
    assert tb == expected and num_blocks % tb == 0 and tb & (tb - 1) == 0


def test_argument_errors():
    x = jnp.ones((2, 48), jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        pk.quantize(x, bits=8, block=24, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        pk.quantize(x, bits=1, block=16, interpret=True)
    with pytest.raises(ValueError, match="multiple of block"):
        pk.quantize(x, bits=8, block=32, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        pk.quantize(x.astype(jnp.int32), bits=8, block=16, interpret=True)
    with pytest.raises(ValueError, match="scale_dtype"):
        pk.quantize(x, bits=8, block=16, scale_dtype=jnp.float16, interpret=True)
    for compress in (functools.partial(pk.compress_1bit_ef, interpret=True),
                     pk.compress_1bit_ef_reference):
        for carry in (jnp.zeros((2, 48), jnp.bfloat16), jnp.zeros((48,), jnp.float32)):
            with pytest.raises(ValueError, match="carry must be float32 with the gradient's"):
                compress(x, carry, block=16, scale_dtype=jnp.float32)
    q = qz.quantize(x, bits=4, block=16)
    with pytest.raises(ValueError, match="q.values"):
        pk.dequantize(q, bits=8, block=16, interpret=True)
    for dequantize_sum in (functools.partial(pk.dequantize_sum, interpret=True),
                           pk.dequantize_sum_reference):
        with pytest.raises(ValueError, match="chunk axis"):
            dequantize_sum(qz.quantize(x[0], bits=4, block=16), bits=4, block=16)
    with pytest.raises(ValueError, match="q.scales"):
        pk.dequantize_sum(q._replace(scales=q.scales[:, :1]), bits=4, block=16, interpret=True)


def _error(f, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as refused:
        f(*args, **kwargs)
    return str(refused.value)


def test_kernels_refuse_what_their_references_refuse_in_the_same_words():
    """The argument checks are the references' (one copy each), so a kernel
    and its reference cannot drift apart on what they accept; the kernels
    add only their own limits (power-of-two blocks, their bit widths)."""
    from pallas_kernels.references import dither as dither_ref

    x = jnp.ones((2, 48), jnp.float32)
    q8 = qz.quantize(x, bits=8, block=16)
    for bad in (dict(x=x.astype(jnp.int32)), dict(x=x[0, 0]), dict(block=32), dict(block=4),
                dict(block=16.0), dict(scale_dtype=jnp.float16)):
        kwargs = {**dict(bits=8, block=16), **bad}
        y = kwargs.pop("x", x)
        assert _error(pk.quantize, y, interpret=True, **kwargs) == _error(
            pk.quantize_reference, y, **kwargs), list(bad)
    assert _error(pk.quantize_dithered, x.astype(jnp.int32), x, block=16, interpret=True) == \
        _error(dither_ref.quantize_dithered, x.astype(jnp.int32), x, block=16)
    assert _error(pk.dequantize, q8, bits=4, block=16, interpret=True) == _error(
        qz.dequantize, q8, bits=4, block=16, dtype=jnp.float32)
    for bad in (q8._replace(scales=q8.scales[:, :1]), qz.quantize(x[0], bits=8, block=16)):
        assert _error(pk.dequantize_sum, bad, bits=8, block=16, interpret=True) == _error(
            pk.dequantize_sum_reference, bad, bits=8, block=16)
    # the kernels' own limits, worded as the reference's
    assert _error(pk.quantize, x, bits=1, block=16, interpret=True) == \
        "bits must be one of (8, 4), got 1."
    assert "power of two" in _error(pk.dequantize_sum, q8, bits=8, block=24, interpret=True)
    assert "power of two >= 8 (Triton tiles are powers of two), got 36; try 32 or 64," in \
        _error(pk.quantize, x, bits=8, block=36, interpret=True)  # not the reference's 32 or 40
    assert qz.QMAX == {8: 127, 4: 7} and not hasattr(sys.modules["pallas_kernels.quantize"], "_QMAX")


@pytest.mark.parametrize("shape, block_axes", [((5, 16), 1), ((5, 2, 8), 2)])
def test_finite_blocks_finds_nan_and_inf_without_a_nan_propagating_max(shape, block_axes):
    """One test of a block's finiteness for the kernels and the dither
    reference: a count of non-finite elements, which a max that drops NaN
    (Triton's) cannot miss; the same blocks as XLA's NaN-propagating max."""
    xb = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    xb = xb.at[1, 0].set(jnp.nan).at[3, -1].set(jnp.inf).at[4, 0].set(-jnp.inf)
    finite = qz.finite_blocks(xb, block_axes)
    assert finite.shape == (shape[0],) + (1,) * block_axes and finite.dtype == jnp.bool_
    np.testing.assert_array_equal(finite.reshape(-1), [True, False, True, False, False])
    flat = jnp.abs(xb.reshape(shape[0], -1))
    np.testing.assert_array_equal(finite.reshape(-1), jnp.isfinite(jnp.max(flat, axis=-1)))


def _lower_for_gpu(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "config",
    [None, pk.KernelConfig(tile_elems=64, split_bytes=True),
     pk.KernelConfig(tile_elems=64, decode="bits")],
    ids=["default", "small-split", "small-bits"],
)
def test_kernels_lower_for_gpu(config):
    """Every kernel lowers to the Triton GPU backend; runs on CPU (cross-lowering).

    Catches unsupported ops and non-power-of-two shapes without a GPU;
    compiling the Triton IR and running it still needs one.
    """
    S = jax.ShapeDtypeStruct
    P = functools.partial
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for bits in (8, 4):
            for block in (8, 256):
                f = P(pk.quantize, bits=bits, block=block, scale_dtype=jnp.bfloat16, config=config)
                cases.append((f, (S((3, 2 * block), dtype),)))
        f = P(pk.compress_1bit_ef, block=8, config=config)
        cases.append((f, (S((3, 24), dtype), S((3, 24), jnp.float32))))
        for scale_dtype in (jnp.float32, jnp.bfloat16):
            f = P(pk.quantize_dithered, block=16, scale_dtype=scale_dtype, config=config)
            cases.append((f, (S((3, 48), dtype), S((3, 48), jnp.float32))))
    for bits in (8, 4):
        vdt = jnp.int8 if bits == 8 else jnp.uint8
        f = P(pk.dequantize, bits=bits, block=256, dtype=jnp.bfloat16, config=config)
        args = (S((3, 64 * bits), vdt), S((3, 2), jnp.float32))
        cases.append((lambda v, s, f=f: f(Quantized(v, s)), args))
    for bits in (1, 4, 8):
        vdt = jnp.int8 if bits == 8 else jnp.uint8
        f = P(pk.dequantize_sum, bits=bits, block=8, config=config)
        args = (S((2, 3, 5 * bits), vdt), S((2, 3, 5), jnp.bfloat16))
        cases.append((lambda v, s, f=f: f(Quantized(v, s)), args))
    for f, args in cases:
        text = _lower_for_gpu(f, *args)
        assert "triton" in text


# ---------------------------------------------------------------------------
# Property test (few examples: interpret mode compiles each new shape).
# ---------------------------------------------------------------------------

if given is not None:

    @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        bits=st.sampled_from([8, 4]),
        log_block=st.integers(3, 7),
        nblocks=st.integers(1, 9),
        lead=st.sampled_from([(), (1,), (3,), (2, 2)]),
        bf16=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_quantize_roundtrip_property(bits, log_block, nblocks, lead, bf16, seed):
        block = 2**log_block
        x = make_x((*lead, nblocks * block), block, jnp.bfloat16 if bf16 else jnp.float32, seed=seed)
        with jax.default_device(jax.devices("cpu")[0]):
            q = pk.quantize(x, bits=bits, block=block, interpret=True)
            assert_quantized_same(q, pk.quantize_reference(x, bits=bits, block=block))
            assert_same(pk.dequantize(q, bits=bits, block=block, interpret=True),
                        pk.dequantize_reference(q, bits=bits, block=block, dtype=jnp.float32))

else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_quantize_roundtrip_property():
        pass


# ---------------------------------------------------------------------------
# Dithered 1-bit code (qgZ --qgz-code dither).
# ---------------------------------------------------------------------------


def _dither_of(shape):
    from zeropp_jax.wire import dither

    return dither.uniform_noise(dither.stream_key(3), dither.element_counters(shape))


@pytest.mark.parametrize("shape,block", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(
    "dtype,scale_dtype",
    [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32)],
    ids=["f32-f32", "bf16-bf16", "f16-f32"],
)
@pytest.mark.parametrize("config", CONFIGS, ids=["small-split", "default"])
def test_quantize_dithered_matches_reference(mode, shape, block, dtype, scale_dtype, config):
    """Block max and one compare per element: bits and scales bit-identical."""
    x = make_x(shape, block, dtype=dtype, seed=5)
    xi = _dither_of(shape)
    q = pk.quantize_dithered(x, xi, block=block, scale_dtype=scale_dtype, config=config,
                             interpret=_interp(mode))
    r = pk.quantize_dithered_reference(x, xi, block=block, scale_dtype=scale_dtype)
    assert_quantized_same(q, r)
    absmax = np.abs(np.asarray(x.astype(jnp.float32))).reshape(*shape[:-1], -1, block).max(-1)
    finite = np.isfinite(absmax)  # float16 spikes overflow: those blocks get scale NaN
    assert (np.asarray(q.scales, np.float32)[finite] >= absmax[finite]).all()
    assert np.isnan(np.asarray(q.scales, np.float32)[~finite]).all()


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quantize_dithered_special_blocks(mode, scale_dtype):
    """NaN / inf blocks -> scale NaN (also where a GPU max would drop the NaN); zeros -> 0."""
    block = 32
    x = _special_x(block)
    xi = _dither_of(x.shape)
    q = pk.quantize_dithered(x, xi, block=block, scale_dtype=scale_dtype, interpret=_interp(mode))
    assert_quantized_same(q, pk.quantize_dithered_reference(x, xi, block=block, scale_dtype=scale_dtype))
    s = f32(q.scales)[:, 0]
    assert np.isnan(s[:3]).all() and np.isfinite(s[3:]).all()
    assert (s[3:5] == 0).all()
    absmax = np.abs(np.asarray(x)).max(-1)
    # rounded up, also for bfloat16 and the huge block (row 5, float32
    # subnormals, may be flushed to zero by XLA: then it decodes to zeros)
    assert (s[6:] >= absmax[6:]).all() and (s[5] == 0 or s[5] >= absmax[5])
