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

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.references.quantization import Quantized

SPLIT = pk.KernelConfig(tile_elems=256, num_warps=1, split_bytes=True)
PLAIN = pk.KernelConfig(tile_elems=256, num_warps=1)
BLOCK = 32
N = 4 * 256


def _kernel_jaxprs(jaxpr) -> list:
    """The kernel bodies of every ``pallas_call`` in ``jaxpr``, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn.params["jaxpr"])
            continue
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr
            if hasattr(inner, "eqns"):
                found += _kernel_jaxprs(inner)
    return found


def _primitives(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                names += _primitives(inner)
    return names


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


def _kernel_primitives(fn, *args) -> list[str]:
    kernels = _kernel_jaxprs(jax.make_jaxpr(fn)(*args).jaxpr)
    assert len(kernels) == 1, f"expected one pallas_call, found {len(kernels)}"
    return _primitives(kernels[0])


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_split_kernels_never_reshape_a_tile(bits):
    """Split tiles: no ``reshape`` in any kernel, for every bit width."""
    for name, (fn, *args) in _calls(bits, SPLIT).items():
        prims = _kernel_primitives(fn, *args)
        assert "reshape" not in prims, f"{name} at {bits} bits reshapes a tile: {prims}"
        assert any(p in ("swap", "store") for p in prims), f"{name}: no store found in {prims}"


@pytest.mark.parametrize("config", [SPLIT, PLAIN], ids=["split", "plain"])
def test_int8_kernels_never_reshape_a_tile(config):
    """int8 codes are one per element: in either layout no kernel reshapes."""
    for name, (fn, *args) in _calls(8, config).items():
        assert "reshape" not in _kernel_primitives(fn, *args), f"{name} reshapes a tile"


def test_the_check_sees_a_reshape():
    """2-D tiles of packed codes regroup bytes and elements: the walk finds those reshapes."""
    for name, (fn, *args) in _calls(1, PLAIN).items():
        assert "reshape" in _kernel_primitives(fn, *args), name
