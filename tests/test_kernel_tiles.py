"""The kernels keep every tile in one shape from load to store (split layout).

On Triton, a reshape that adds or drops an axis of a loaded tile can move it
through shared memory (a layout conversion with barriers). In the split layout
(``KernelConfig.split_bytes``) the kernels avoid all of them: packed units and
per-block scales travel in the element tile's rank (``_common.per_block``,
``_common.unit_view``), reductions keep their axes, decoding only broadcasts.
Compiled for an H200 (``benchmarks/gpu_aot.py kernels``), that took
``dequantize_sum``'s shared-memory accesses per element from 4.5 to 0.25 at
1 bit (see benchmarks/RESULTS.md). These tests read the kernels' jaxprs
(tracing only, nothing compiles): a ``reshape`` inside a split kernel fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.references.quantization import Quantized

SPLIT = pk.KernelConfig(tile_elems=256, num_warps=1, split_bytes=True)
PLAIN = pk.KernelConfig(tile_elems=256, num_warps=1)
BLOCK = 32
N = 4 * 256


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def _calls(bits: int, config):
    """``{kernel name: (fn, args)}`` for every kernel that ``bits`` applies to."""
    x = jnp.zeros((2, N), jnp.float32)
    calls = {}
    if bits in (4, 8):
        q = pk.quantize_reference(x, bits=bits, block=BLOCK)
        calls["quantize"] = (lambda a: pk.quantize(a, bits=bits, block=BLOCK, config=config), x)
        calls["dequantize"] = (
            lambda v, s: pk.dequantize(Quantized(v, s), bits=bits, block=BLOCK, config=config),
            *q,
        )
    if bits == 1:
        calls["compress_1bit_ef"] = (
            lambda a, c: pk.compress_1bit_ef(a, c, block=BLOCK, config=config), x, x)
        calls["quantize_dithered"] = (
            lambda a, xi: pk.quantize_dithered(a, xi, block=BLOCK, config=config), x, x)
    chunks = pk.quantize_reference(jnp.zeros((8, N), jnp.float32), bits=bits, block=BLOCK)
    calls["dequantize_sum"] = (
        lambda v, s: pk.dequantize_sum(Quantized(v, s), bits=bits, block=BLOCK, config=config),
        *chunks,
    )
    return calls


def _kernel_eqns(fn, *args) -> list:
    """The equations in the body of the one ``pallas_call`` that ``fn`` makes."""
    top = jax.make_jaxpr(fn)(*args).jaxpr
    kernels = [e.params["jaxpr"] for e in _eqns(top) if e.primitive.name == "pallas_call"]
    assert len(kernels) == 1, f"expected one pallas_call, found {len(kernels)}"
    return list(_eqns(kernels[0]))


def _kernel_primitives(fn, *args) -> list[str]:
    """The primitives in the body of the one ``pallas_call`` that ``fn`` makes."""
    return [e.primitive.name for e in _kernel_eqns(fn, *args)]


def _int_to_float_conversions(fn, *args) -> int:
    """``convert_element_type`` equations from an integer to a float dtype in the kernel."""
    return sum(
        1 for e in _kernel_eqns(fn, *args)
        if e.primitive.name == "convert_element_type"
        and jnp.issubdtype(e.invars[0].aval.dtype, jnp.integer)
        and jnp.issubdtype(e.params["new_dtype"], jnp.floating)
    )


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_split_kernels_never_reshape_a_tile(bits):
    """Split tiles: no ``reshape`` in any kernel, for every bit width."""
    for name, (fn, *args) in _calls(bits, SPLIT).items():
        prims = _kernel_primitives(fn, *args)
        assert "reshape" not in prims, f"{name} at {bits} bits reshapes a tile: {prims}"
        assert any(p in ("swap", "store") for p in prims), f"{name}: no store found in {prims}"


def test_int8_kernels_never_reshape_a_tile_in_the_plain_layout_either():
    """int8 codes are one per element: 2-D tiles need no reshape either."""
    for name, (fn, *args) in _calls(8, PLAIN).items():
        assert "reshape" not in _kernel_primitives(fn, *args), f"{name} reshapes a tile"


def test_the_check_sees_a_reshape():
    """2-D tiles of packed codes regroup bytes and elements: the walk finds those reshapes."""
    for name, (fn, *args) in _calls(1, PLAIN).items():
        assert "reshape" in _kernel_primitives(fn, *args), name


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", [SPLIT, PLAIN], ids=["split", "plain"])
def test_decode_by_bits_converts_no_integer_to_float(bits, layout):
    """``KernelConfig(decode="bits")``: the decoding kernels build floats from the codes'
    bits (on Hopper a conversion issues at 16 per clock per SM, a float add at 128);
    with the default ``"convert"`` the same kernels do convert, so the check can fail."""
    decoding = pk.config.DECODING_KERNELS
    by_bits = dataclasses.replace(layout, decode="bits")
    for name, (fn, *args) in _calls(bits, by_bits).items():
        if name in decoding:
            assert _int_to_float_conversions(fn, *args) == 0, f"{name} at {bits} bits converts"
    for name, (fn, *args) in _calls(bits, layout).items():
        if name in decoding:
            assert _int_to_float_conversions(fn, *args) > 0, f"{name}: no conversion found"
