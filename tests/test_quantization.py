"""Tests for the pure-jnp block-wise quantization (zeropp_jax.wire.quantization)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pallas_kernels
from zeropp_jax.wire import quantization as qz
from zeropp_jax.wire.quantization import (
    Quantized,
    dequantize,
    pack_bits,
    pack_int4,
    quantization_error,
    quantize,
    unpack_bits,
    unpack_int4,
    wire_bytes,
)

QMAX = {8: 127, 4: 7}


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
    """The reference must work under strict promotion, whatever conftest sets."""
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield

WIRE_DTYPE = {8: jnp.int8, 4: jnp.uint8, 1: jnp.uint8}


def _rng_values(shape, seed=0, dtype=np.float32):
    """Random normal values with per-row magnitudes spread over decades."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if len(shape) >= 1 and shape[-1] > 0:
        mags = 10.0 ** rng.uniform(-3, 3, size=shape[:-1] + (1,)).astype(np.float32)
        x = x * mags
    return jnp.asarray(x).astype(dtype)


def _roundtrip(x, bits, block, scale_dtype=jnp.float32, out_dtype=jnp.float32):
    q = quantize(x, bits=bits, block=block, scale_dtype=scale_dtype)
    return q, dequantize(q, bits=bits, block=block, dtype=out_dtype)


def _check_shapes_and_dtypes(q, x, bits, block, scale_dtype):
    n = x.shape[-1]
    assert q.values.dtype == WIRE_DTYPE[bits]
    assert q.values.shape == x.shape[:-1] + (n * bits // 8,)
    assert q.scales.dtype == jnp.dtype(scale_dtype)
    assert q.scales.shape == x.shape[:-1] + (n // block,)


def _assert_within_half_step(x, x_hat, scales, block, rtol=1e-5, atol=1e-30):
    """|x - x_hat| <= scale/2 per element, with the block's stored scale."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    x_hat = np.asarray(jnp.asarray(x_hat).astype(jnp.float32), np.float64)
    s = np.repeat(np.asarray(scales.astype(jnp.float32), np.float64), block, axis=-1)
    err = np.abs(x - x_hat)
    bound = 0.5 * s * (1 + rtol) + atol
    bad = err > bound
    assert not bad.any(), (
        f"{bad.sum()} elements exceed half a step; worst err/scale="
        f"{np.max(err / np.maximum(s, 1e-300))}"
    )


# ---------------------------------------------------------------------------
# Round trips.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 24, 256])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_roundtrip_within_half_step(bits, block, in_dtype, scale_dtype):
    x = _rng_values((3, 2, block * 5), seed=block + bits, dtype=in_dtype)
    if in_dtype == jnp.float16:  # stay inside float16's range
        x = jnp.clip(x, -6e4, 6e4)
    q, x_hat = _roundtrip(x, bits, block, scale_dtype)
    _check_shapes_and_dtypes(q, x, bits, block, scale_dtype)
    _assert_within_half_step(x, x_hat, q.scales, block)
    # Scales are absmax / qmax (up to scale_dtype rounding).
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(3, 2, 5, block), axis=-1)
    np.testing.assert_allclose(
        q.scales.astype(jnp.float32),
        absmax / QMAX[bits],
        rtol=1e-6 if scale_dtype == jnp.float32 else 2**-8,
    )
    # The largest element of each block gets the extreme code (ties aside).
    assert int(jnp.max(jnp.abs(unpack_int4(q.values) if bits == 4 else q.values))) == QMAX[bits]


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dequantize_output_dtype(bits, out_dtype):
    x = _rng_values((4, 64), seed=1)
    q, x_hat = _roundtrip(x, bits, 32, out_dtype=out_dtype)
    assert x_hat.dtype == out_dtype
    assert x_hat.shape == x.shape
    ref = dequantize(q, bits=bits, block=32, dtype=jnp.float32)
    np.testing.assert_array_equal(x_hat, ref.astype(out_dtype))


def test_codes_match_numpy_reference_with_ties_to_even():
    # Block of 8: absmax 127 -> scale 1, so codes are rint(x) exactly, with ties.
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.4]], np.float32)
    q = quantize(jnp.asarray(x), bits=8, block=8)
    np.testing.assert_array_equal(q.values, np.rint(x).astype(np.int8))
    np.testing.assert_array_equal(q.values, [[127, 0, 2, 2, 0, -2, -126, 3]])
    # General case against numpy.
    xr = np.asarray(_rng_values((5, 96), seed=3))
    blocks = xr.reshape(5, 3, 32)
    scale = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127)
    codes = np.clip(np.rint(blocks / scale), -127, 127).astype(np.int8).reshape(5, 96)
    q = quantize(jnp.asarray(xr), bits=8, block=32)
    assert np.mean(np.asarray(q.values) != codes) < 1e-3  # float-division differences only
    assert np.max(np.abs(np.asarray(q.values, np.int32) - codes)) <= 1


# ---------------------------------------------------------------------------
# Input dtypes: bf16 must be read as bf16.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16])
def test_half_inputs_match_float32_path(bits, in_dtype):
    # Values far outside float16's range in bf16 would be inf if misread as fp16
    # bits; ordinary values would be garbage. Compare with the exact f32 up-cast.
    x = _rng_values((2, 3, 128), seed=7, dtype=in_dtype)
    if in_dtype == jnp.bfloat16:
        x = x.at[0, 0, :8].set(jnp.asarray([1e20, -3e-20, 7.0, -1e30, 0.1, 2.0, -5.0, 1.0], in_dtype))
    q_half = quantize(x, bits=bits, block=32)
    q_f32 = quantize(x.astype(jnp.float32), bits=bits, block=32)
    np.testing.assert_array_equal(q_half.values, q_f32.values)
    np.testing.assert_array_equal(q_half.scales, q_f32.scales)
    assert bool(jnp.all(jnp.isfinite(q_half.scales)))
    if bits != 1:
        x_hat = dequantize(q_half, bits=bits, block=32, dtype=jnp.float32)
        _assert_within_half_step(x, x_hat, q_half.scales, 32)


def test_bf16_value_exact_when_on_grid():
    # A bf16 value that is a code * scale comes back exactly.
    x = jnp.asarray([[127.0, -64.0, 32.0, 1.0, 0.0, -1.0, 100.0, -127.0]], jnp.bfloat16)
    _, x_hat = _roundtrip(x, 8, 8, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(x_hat, x)


# ---------------------------------------------------------------------------
# Special blocks: zeros, outliers, non-finite values.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_zero_blocks_give_exact_zeros(bits, scale_dtype):
    x = _rng_values((2, 4 * 16), seed=11)
    x = x.at[0, 16:32].set(0.0).at[1, 48:64].set(0.0)
    q, x_hat = _roundtrip(x, bits, 16, scale_dtype)
    assert not bool(jnp.any(jnp.isnan(x_hat)))
    assert float(q.scales[0, 1]) == 0.0 and float(q.scales[1, 3]) == 0.0
    np.testing.assert_array_equal(x_hat[0, 16:32], 0.0)
    np.testing.assert_array_equal(x_hat[1, 48:64], 0.0)
    # Other blocks are untouched by the zero ones.
    assert bool(jnp.all(q.scales[0, jnp.array([0, 2, 3])] > 0))


@pytest.mark.parametrize("bits", [8, 4])
def test_one_huge_value_in_a_block(bits):
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)) * 1e-3
    x = x.at[1, 37].set(-1e6)  # block 1 of row 1 (block=32)
    q, x_hat = _roundtrip(x, bits, 32)
    np.testing.assert_allclose(x_hat[1, 37], -1e6, rtol=1e-6)
    others = jnp.concatenate([x_hat[1, 32:37], x_hat[1, 38:64]])
    np.testing.assert_array_equal(others, 0.0)
    # Neighbouring blocks keep their own fine resolution.
    mask = np.ones(x.shape, bool)
    mask[1, 32:] = False
    _assert_within_half_step(x, x_hat, q.scales, 32)
    assert float(jnp.max(jnp.abs(x - x_hat)[mask])) < 1e-3  # vs. a step of 1e6/qmax next door


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
def test_non_finite_value_poisons_exactly_its_block(bits, scale_dtype, in_dtype):
    block = 16
    x = _rng_values((3, 4 * block), seed=13, dtype=in_dtype)
    # One bad value per poisoned block: NaN, +inf, -inf, and +inf with -inf together.
    x = x.at[1, 2 * block + 5].set(np.nan)  # row 1, block 2
    x = x.at[0, 0].set(np.inf)  # row 0, block 0
    x = x.at[2, 4 * block - 1].set(-np.inf)  # row 2, block 3
    x = x.at[2, block + 1].set(np.inf).at[2, block + 2].set(-np.inf)  # row 2, block 1
    q, x_hat = _roundtrip(x, bits, block, scale_dtype)
    nan_block = np.zeros((3, 4), bool)
    nan_block[1, 2] = nan_block[0, 0] = nan_block[2, 3] = nan_block[2, 1] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(q.scales, np.float32)), nan_block)
    per_elem = np.repeat(nan_block, block, axis=-1)
    x_hat = np.asarray(x_hat)
    assert np.isnan(x_hat[per_elem]).all()
    assert np.isfinite(x_hat[~per_elem]).all()
    if bits != 1:
        _assert_within_half_step(
            np.where(per_elem, 0.0, np.asarray(x.astype(jnp.float32))),
            np.where(per_elem, 0.0, x_hat),
            jnp.where(jnp.asarray(nan_block), 0.0, q.scales.astype(jnp.float32)),
            block,
        )


# ---------------------------------------------------------------------------
# 1-bit: scaled sign.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block", [8, 40, 128])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16])
def test_one_bit_sign_and_mean_abs_scale(block, in_dtype):
    x = _rng_values((2, 3, block * 3), seed=block, dtype=in_dtype)
    x = x.at[0, 0, 1].set(0.0).at[0, 0, 2].set(-0.0)
    q, x_hat = _roundtrip(x, 1, block)
    _check_shapes_and_dtypes(q, x, 1, block, jnp.float32)
    x32 = np.asarray(x.astype(jnp.float32))
    mean_abs = np.mean(np.abs(x32.astype(np.float64)).reshape(2, 3, 3, block), axis=-1)
    np.testing.assert_allclose(q.scales, mean_abs, rtol=1e-5)
    x_hat = np.asarray(x_hat)
    nonneg = x32 >= 0  # -0.0 counts as non-negative
    np.testing.assert_array_equal(x_hat > 0, nonneg)
    np.testing.assert_array_equal(np.abs(x_hat), np.repeat(np.asarray(q.scales), block, axis=-1))
    np.testing.assert_array_equal(unpack_bits(q.values), nonneg)


def test_one_bit_scale_is_l2_optimal():
    x = _rng_values((1, 64), seed=21)
    q, x_hat = _roundtrip(x, 1, 64)
    s = float(q.scales[0, 0])
    sign = jnp.where(x >= 0, 1.0, -1.0)

    def err(c):
        return float(jnp.sum((x - c * sign) ** 2))

    assert err(s) <= err(s * 1.01) and err(s) <= err(s * 0.99)
    np.testing.assert_allclose(err(s), float(jnp.sum((x - x_hat) ** 2)), rtol=1e-5)


# ---------------------------------------------------------------------------
# Packing: exact layouts and round trips.
# ---------------------------------------------------------------------------


def test_int4_layout_by_hand():
    # Element 2i in the low nibble, 2i+1 in the high nibble, two's complement.
    packed = pack_int4(jnp.array([1, -2, 7, -8, 0, -1], jnp.int8))
    np.testing.assert_array_equal(packed, np.array([0xE1, 0x87, 0xF0], np.uint8))
    # Through quantize: absmax 7 -> scale 1, codes == x.
    x = jnp.array([[7.0, -7.0, 1.0, 0.0, -1.0, 3.0, 0.0, 2.0]])
    q = quantize(x, bits=4, block=8)
    np.testing.assert_array_equal(q.values, [[0x97, 0x01, 0x3F, 0x20]])
    np.testing.assert_array_equal(q.scales, [[1.0]])
    np.testing.assert_array_equal(dequantize(q, bits=4, block=8, dtype=jnp.float32), x)


def test_bits_layout_by_hand():
    # Element 8i+j in bit j of byte i.
    b = jnp.array([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], bool)
    np.testing.assert_array_equal(pack_bits(b), np.array([0x81, 0x02], np.uint8))
    x = jnp.array([1.0, -1.0, 2.0, -2.0, 0.0, -0.5, 3.0, -3.0])
    q = quantize(x, bits=1, block=8)
    np.testing.assert_array_equal(q.values, [0x55])
    np.testing.assert_array_equal(q.scales, [12.5 / 8])


@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (0, 4)])
def test_int4_pack_roundtrip_odd_bytes(lead):
    n = 8 * 13  # 52 bytes; 13 bytes per 26 codes also tested through the odd lead dims
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=lead + (n,)).astype(np.int8)
    packed = pack_int4(jnp.asarray(codes))
    assert packed.dtype == jnp.uint8 and packed.shape == lead + (n // 2,)
    np.testing.assert_array_equal(unpack_int4(packed), codes)
    # Agrees with a numpy model of the layout.
    u = codes.view(np.uint8) & 0x0F
    np.testing.assert_array_equal(packed, u[..., 0::2] | (u[..., 1::2] << 4))
    # Every byte value round-trips the other way.
    all_bytes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8).reshape(2, 128)
    np.testing.assert_array_equal(pack_int4(unpack_int4(all_bytes)), all_bytes)
    # Odd number of bytes: 13 bytes = 26 codes.
    odd = jnp.asarray(codes[..., :26])
    np.testing.assert_array_equal(unpack_int4(pack_int4(odd)), odd)


@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (0, 4)])
def test_bit_pack_roundtrip_odd_bytes(lead):
    n = 8 * 13
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2, size=lead + (n,)).astype(bool)
    packed = pack_bits(jnp.asarray(b))
    assert packed.dtype == jnp.uint8 and packed.shape == lead + (13,)
    np.testing.assert_array_equal(packed, np.packbits(b, axis=-1, bitorder="little"))
    np.testing.assert_array_equal(unpack_bits(packed), b)
    all_bytes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(pack_bits(unpack_bits(all_bytes)), all_bytes)


@pytest.mark.parametrize("bits", [8, 4, 1])
def test_quantize_on_odd_byte_count_with_batch_dims(bits):
    x = _rng_values((2, 3, 8 * 13), seed=2)  # block=8: 13 blocks, odd packed lengths
    q, x_hat = _roundtrip(x, bits, 8)
    _check_shapes_and_dtypes(q, x, bits, 8, jnp.float32)
    if bits != 1:
        _assert_within_half_step(x, x_hat, q.scales, 8)
    else:
        np.testing.assert_array_equal(np.asarray(x_hat) >= 0, np.asarray(x) >= 0)


# ---------------------------------------------------------------------------
# Property-based: shapes and values.
# ---------------------------------------------------------------------------


@st.composite
def _inputs(draw):
    block = draw(st.sampled_from([8, 16, 24, 72]))
    k = draw(st.sampled_from([1, 3, 5, 7, 13]))
    lead = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    elements = st.floats(
        min_value=-1e4, max_value=1e4, width=32, allow_nan=False, allow_subnormal=False
    )
    x = draw(hnp.arrays(np.float32, lead + (block * k,), elements=elements))
    in_dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    scale_dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    return jnp.asarray(x).astype(in_dtype), block, scale_dtype


@pytest.mark.slow
@settings(deadline=None, max_examples=30)
@given(inp=_inputs(), bits=st.sampled_from([8, 4, 1]))
def test_property_roundtrip(inp, bits):
    x, block, scale_dtype = inp
    q, x_hat = _roundtrip(x, bits, block, scale_dtype)
    _check_shapes_and_dtypes(q, x, bits, block, scale_dtype)
    assert x_hat.shape == x.shape
    x_hat = np.asarray(x_hat)
    assert np.isfinite(x_hat).all()
    if bits != 1:
        _assert_within_half_step(x, x_hat, q.scales, block)
    else:
        s = np.repeat(np.asarray(q.scales.astype(jnp.float32)), block, axis=-1)
        np.testing.assert_array_equal(np.abs(x_hat), s)
        nonzero = s > 0
        x32 = np.asarray(x.astype(jnp.float32))
        np.testing.assert_array_equal((x_hat >= 0)[nonzero], (x32 >= 0)[nonzero])


# ---------------------------------------------------------------------------
# Transformations.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 1])
def test_jit_and_vmap(bits):
    x = _rng_values((4, 2, 96), seed=9, dtype=jnp.bfloat16)

    def roundtrip(v):
        q = quantize(v, bits=bits, block=32, scale_dtype=jnp.bfloat16)
        return q, dequantize(q, bits=bits, block=32, dtype=jnp.bfloat16)

    q_eager, y_eager = roundtrip(x)
    q_jit, y_jit = jax.jit(roundtrip)(x)
    q_vmap, y_vmap = jax.vmap(roundtrip)(x)
    for q, y in [(q_jit, y_jit), (q_vmap, y_vmap)]:
        assert isinstance(q, Quantized)
        np.testing.assert_array_equal(q.values, q_eager.values)
        np.testing.assert_array_equal(q.scales, q_eager.scales)
        np.testing.assert_array_equal(y, y_eager)
    # Quantized is a pytree that crosses jit boundaries.
    y2 = jax.jit(lambda q: dequantize(q, bits=bits, block=32, dtype=jnp.float32))(q_eager)
    np.testing.assert_array_equal(y2.astype(jnp.bfloat16), y_eager)


def test_pallas_reference_aliases():
    assert pallas_kernels.quantize_reference is quantize
    assert pallas_kernels.dequantize_reference is dequantize
    # The references live in pallas_kernels; zeropp_jax.wire re-exports them.
    from pallas_kernels.references import dither as dither_reference
    from pallas_kernels.references import quantization as reference
    from zeropp_jax.wire import dither

    assert Quantized is reference.Quantized and quantize is reference.quantize
    assert dither.quantize_dithered is dither_reference.quantize_dithered
    assert pallas_kernels.quantize_dithered_reference is dither.quantize_dithered


@pytest.mark.slow
def test_pallas_kernels_imports_nothing_from_zeropp_jax():
    code = "import sys, pallas_kernels; print([m for m in sys.modules if m.startswith('zeropp_jax')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------
# Reporting helpers.
# ---------------------------------------------------------------------------


def test_wire_bytes():
    assert wire_bytes(4096, bits=8, block=256, scale_dtype=jnp.float32) == 4096 + 16 * 4
    assert wire_bytes(4096, bits=4, block=256, scale_dtype=jnp.bfloat16) == 2048 + 16 * 2
    assert wire_bytes(4096, bits=1, block=2048, scale_dtype=jnp.float32) == 512 + 2 * 4
    assert wire_bytes(0, bits=8, block=8, scale_dtype=jnp.float32) == 0
    # Matches what quantize actually produces.
    for bits in (8, 4, 1):
        for sd in (jnp.float32, jnp.bfloat16):
            q = quantize(_rng_values((3, 192)), bits=bits, block=64, scale_dtype=sd)
            assert 3 * wire_bytes(192, bits=bits, block=64, scale_dtype=sd) == (
                q.values.nbytes + q.scales.nbytes
            )


def test_quantization_error():
    x = _rng_values((4, 256), seed=4)
    errs = {b: quantization_error(x, bits=b, block=64) for b in (8, 4, 1)}
    for e in errs.values():
        assert set(e) == {"relative_l2_error", "max_abs_error"}
    rel = {b: float(e["relative_l2_error"]) for b, e in errs.items()}
    assert 0 < rel[8] < rel[4] < rel[1] < 1
    assert rel[8] < 0.02
    q, x_hat = _roundtrip(x, 8, 64)
    np.testing.assert_allclose(
        errs[8]["max_abs_error"], float(jnp.max(jnp.abs(x - x_hat))), rtol=1e-5
    )
    assert float(quantization_error(jnp.zeros((2, 8)), bits=4, block=8)["relative_l2_error"]) == 0.0


# ---------------------------------------------------------------------------
# Argument validation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, x, match",
    [
        (dict(bits=2, block=8), jnp.ones((16,)), r"bits must be one of \(1, 4, 8\), got 2"),
        (dict(bits=True, block=8), jnp.ones((16,)), r"bits must be one of"),
        (dict(bits=8, block=12), jnp.ones((24,)), r"multiple of 8.*got 12; try 8 or 16"),
        (dict(bits=8, block=0), jnp.ones((24,)), r"multiple of 8.*got 0"),
        (dict(bits=8, block=4), jnp.ones((24,)), r"multiple of 8.*got 4"),
        (dict(bits=8, block=8.0), jnp.ones((24,)), r"block must be a Python int"),
        (dict(bits=8, block=16), jnp.ones((2, 24)), r"n=24.*not a multiple of block=16.*pad it to 32"),
        (dict(bits=8, block=8), jnp.ones((16,), jnp.int32), r"floating.*int32"),
        (dict(bits=8, block=8), jnp.float32(1.0), r"at least one axis"),
        (dict(bits=8, block=8, scale_dtype=jnp.float16), jnp.ones((16,)), r"float32 or bfloat16.*float16"),
        (dict(bits=8, block=8, scale_dtype=jnp.int8), jnp.ones((16,)), r"float32 or bfloat16.*int8"),
    ],
)
def test_quantize_invalid_arguments(kwargs, x, match):
    with pytest.raises(ValueError, match=match):
        quantize(x, **kwargs)


def test_dequantize_invalid_arguments():
    q = quantize(_rng_values((2, 64)), bits=4, block=16)
    with pytest.raises(ValueError, match=r"bits=8, q.values must be int8, got uint8"):
        dequantize(q, bits=8, block=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"q.scales has shape \(2, 4\).*need \(2, 2\)"):
        dequantize(q, bits=4, block=32, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"floating output dtype"):
        dequantize(q, bits=4, block=16, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"bits must be one of"):
        dequantize(q, bits=3, block=16, dtype=jnp.float32)
    bad = Quantized(values=q.values[:, :7], scales=q.scales)  # 14 elements, not a multiple of 16
    with pytest.raises(ValueError, match=r"n=14.*not a multiple of block=16"):
        dequantize(bad, bits=4, block=16, dtype=jnp.float32)


def test_helper_invalid_arguments():
    with pytest.raises(ValueError, match=r"even-length last axis.*\(3,\)"):
        pack_int4(jnp.array([1, 2, 3], jnp.int8))
    with pytest.raises(ValueError, match=r"integer codes.*float32"):
        pack_int4(jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"uint8.*int8"):
        unpack_int4(jnp.ones((4,), jnp.int8))
    with pytest.raises(ValueError, match=r"multiple of 8.*\(2, 12\)"):
        pack_bits(jnp.ones((2, 12), bool))
    with pytest.raises(ValueError, match=r"uint8.*int32"):
        unpack_bits(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"n=100.*block=64.*pad it to 128"):
        wire_bytes(100, bits=8, block=64)
    with pytest.raises(ValueError, match=r"non-negative int"):
        wire_bytes(-8, bits=8, block=8)
    assert qz.__all__  # public names exported
