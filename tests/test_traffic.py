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
