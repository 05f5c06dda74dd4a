"""Memory traffic from the optimized HLO (``zeropp_jax.analysis.traffic``).

Small programs whose bytes are known by hand: an element-wise fusion reads
its operands and writes its result; a scanned loop counts its body once per
iteration and reads one row of a stacked operand per iteration, not the
stack; an in-place update writes its update only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.analysis.traffic import memory_traffic, traffic_summary

N, L = 4096, 6


def _hlo(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def test_element_wise_reads_operands_and_writes_result():
    x = jnp.arange(N, dtype=jnp.float32)
    ops = memory_traffic(_hlo(lambda a, b: a * b + 1.0, x, x))
    assert sum(o.total for o in ops) == 3 * 4 * N  # two f32 reads, one f32 write


def test_loop_counts_each_iteration_and_reads_one_row():
    xs = jnp.ones((L, N), jnp.float32)

    def f(xs):
        def body(c, x):
            return c + jnp.sin(x), None
        return jax.lax.scan(body, jnp.zeros((N,), jnp.float32), xs)[0]

    ops = memory_traffic(_hlo(f, xs))
    total = sum(o.total for o in ops)
    assert max(o.count for o in ops) == L
    # each iteration reads a row and the carry and writes the carry (12 N bytes);
    # counting the whole stack per iteration would be (4 L + 8) N
    assert 3 * 4 * N * L <= total <= 5 * 4 * N * L, total
    assert total < (4 * L + 8) * N * L


def test_in_place_update_writes_the_update_only():
    big = jnp.zeros((L, N), jnp.float32)
    row = jnp.ones((N,), jnp.float32)
    ops = memory_traffic(_hlo(
        lambda b, r, i: jax.lax.dynamic_update_index_in_dim(b, r * 2.0, i, 0),
        big, row, 3, donate=0))  # donated: no copy of the stack first
    total = sum(o.total for o in ops)
    assert 2 * 4 * N <= total < 4 * N * L, total  # the row read and written, not the stack
    # not donated, XLA copies the stack first, and that copy is counted
    undonated = memory_traffic(_hlo(
        lambda b, r, i: jax.lax.dynamic_update_index_in_dim(b, r * 2.0, i, 0), big, row, 3))
    assert sum(o.total for o in undonated) >= total + 2 * 4 * N * L


def test_summary_totals_and_orders():
    x = jnp.arange(N, dtype=jnp.float32)
    ops = memory_traffic(_hlo(lambda a: (jnp.sin(a) * 3).astype(jnp.bfloat16), x))
    summary = traffic_summary(ops, top=1)
    assert summary["bytes"] == sum(o.total for o in ops) == 6 * N
    assert sum(summary["by_opcode"].values()) == summary["bytes"]
    assert len(summary["top"]) == 1 and summary["top"][0]["bytes"] == max(o.total for o in ops)
    assert np.all([o.read >= 0 and o.written >= 0 for o in ops])


# GPU fusions (XLA:GPU's optimized HLO, trimmed): one layer of a stacked
# bf16[L, R] unit is dynamic-sliced and its weights sliced out of that row;
# qwZ's int8 codes are decoded element-wise and then sliced. Only the
# sliced elements are read, whatever lies between the parameter and the slice.
_R = 4096
_GPU_SLICES = f"""HloModule slices

%fused_slice (p0: bf16[{L},{_R}], p1: s32[]) -> (bf16[1024], bf16[2048]) {{
  %p0 = bf16[{L},{_R}]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = bf16[1,{_R}]{{1,0}} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={{1,{_R}}}
  %flat = bf16[{_R}]{{0}} bitcast(%row)
  %w = bf16[1024]{{0}} slice(%flat), slice={{[0:1024]}}
  %v = bf16[2048]{{0}} slice(%flat), slice={{[2048:4096]}}
  ROOT %t = (bf16[1024]{{0}}, bf16[2048]{{0}}) tuple(%w, %v)
}}

%fused_decode (c0: f32[1,16], c1: s8[{L},{_R}], c2: s32[]) -> bf16[1024] {{
  %c1 = s8[{L},{_R}]{{1,0}} parameter(1)
  %c2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %row = s8[1,{_R}]{{1,0}} dynamic-slice(%c1, %c2, %zero), dynamic_slice_sizes={{1,{_R}}}
  %flat = s8[{_R}]{{0}} bitcast(%row)
  %wide = f32[{_R}]{{0}} convert(%flat)
  %c0 = f32[1,16]{{1,0}} parameter(0)
  %s = f32[16]{{0}} bitcast(%c0)
  %b = f32[16,256]{{1,0}} broadcast(%s), dimensions={{0}}
  %bs = f32[{_R}]{{0}} bitcast(%b)
  %m = f32[{_R}]{{0}} multiply(%wide, %bs)
  %h = bf16[{_R}]{{0}} convert(%m)
  ROOT %w = bf16[1024]{{0}} slice(%h), slice={{[1024:2048]}}
}}

ENTRY %main (a: bf16[{L},{_R}], q: s8[{L},{_R}], s: f32[1,16], i: s32[]) -> (bf16[1024], bf16[2048], bf16[1024]) {{
  %a = bf16[{L},{_R}]{{1,0}} parameter(0)
  %q = s8[{L},{_R}]{{1,0}} parameter(1)
  %s = f32[1,16]{{1,0}} parameter(2)
  %i = s32[] parameter(3)
  %f = (bf16[1024]{{0}}, bf16[2048]{{0}}) fusion(%a, %i), kind=kLoop, calls=%fused_slice
  %g = bf16[1024]{{0}} fusion(%s, %q, %i), kind=kLoop, calls=%fused_decode
  %w = bf16[1024]{{0}} get-tuple-element(%f), index=0
  %v = bf16[2048]{{0}} get-tuple-element(%f), index=1
  ROOT %out = (bf16[1024]{{0}}, bf16[2048]{{0}}, bf16[1024]{{0}}) tuple(%w, %v, %g)
}}
"""


def test_slices_of_a_dynamic_slice_read_only_the_slices():
    (ops,) = [o for o in memory_traffic(_GPU_SLICES) if o.name == "f"]
    assert ops.written == 2 * (1024 + 2048)
    assert ops.read == 2 * (1024 + 2048) + 4  # the two weights and the index, not the row


def test_a_slice_after_element_wise_decoding_reads_the_sliced_codes():
    (op,) = [o for o in memory_traffic(_GPU_SLICES) if o.name == "g"]
    assert op.written == 2 * 1024
    # 1024 int8 codes, the 16 scales (through a broadcast: read whole) and the index
    assert op.read == 1024 + 4 * 16 + 4


def _chain(depth: int) -> str:
    """A fusion of ``depth`` ``add(x, x)`` over a 1024-element parameter, then a 16-element slice."""
    lines = ["  %x0 = f32[1024]{0} parameter(0)"]
    for k in range(1, depth + 1):
        lines.append(f"  %x{k} = f32[1024]{{0}} add(%x{k - 1}, %x{k - 1})")
    lines.append(f"  ROOT %s = f32[16]{{0}} slice(%x{depth}), slice={{[0:16]}}")
    body = "\n".join(lines)
    return f"""HloModule chain

%fused (x0: f32[1024]) -> f32[16] {{
{body}
}}

ENTRY %main (p: f32[1024]) -> f32[16] {{
  %p = f32[1024]{{0}} parameter(0)
  ROOT %f = f32[16]{{0}} fusion(%p), kind=kLoop, calls=%fused
}}
"""


def test_paths_that_meet_again_count_their_slice_once():
    # add(x, x) uses x twice; 40 of them in a row would be 2**40 paths walked one by one
    for depth in (1, 40):
        (op,) = memory_traffic(_chain(depth))
        assert (op.read, op.written) == (4 * 16, 4 * 16)
