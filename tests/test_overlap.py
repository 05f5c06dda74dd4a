"""What asynchronous collectives overlap in a schedule (``zeropp_jax.analysis.overlap``).

A trimmed scheduled GPU program: a gather whose start and done bracket two
kernels (one reading a row of its operand), and a reduce-scatter started
and finished back to back (exposed). XLA:CPU's programs have no
asynchronous collectives at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeropp_jax.analysis.overlap import async_overlaps

_SCHEDULED = """HloModule step, is_scheduled=true

%fused_sin (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %s = f32[1024]{0} sine(%p)
}

%fused_row (q: f32[8,1024]) -> f32[1024] {
  %q = f32[8,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} slice(%q), slice={[0:1], [0:1024]}
  ROOT %b = f32[1024]{0} bitcast(%r)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (x: f32[1,256], y: f32[1024], z: f32[8,1024], g: f32[2048]) -> (f32[8,256], f32[1024], f32[1024], f32[256]) {
  %x = f32[1,256]{1,0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  %z = f32[8,1024]{1,0} parameter(2)
  %g = f32[2048]{0} parameter(3)
  %ags = (f32[1,256]{1,0}, f32[8,256]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %f1 = f32[1024]{0} fusion(%y), kind=kLoop, calls=%fused_sin
  %f2 = f32[1024]{0} fusion(%z), kind=kLoop, calls=%fused_row
  %agd = f32[8,256]{1,0} all-gather-done(%ags)
  %rss = ((f32[2048]{0}), f32[256]{0}) reduce-scatter-start(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rsd = f32[256]{0} reduce-scatter-done(%rss)
  ROOT %out = (f32[8,256]{1,0}, f32[1024]{0}, f32[1024]{0}, f32[256]{0}) tuple(%agd, %f1, %f2, %rsd)
}
"""


def test_the_kernels_between_start_and_done_are_what_a_collective_overlaps():
    gather, scatter = async_overlaps(_SCHEDULED, (2, 4))
    assert (gather.kind, gather.axis, gather.count) == ("all-gather", "node+local", 1)
    assert gather.operand_bytes == 4 * 256
    assert gather.kernels == 2
    # sin reads and writes 1024 floats; the row fusion reads one row of 8 and writes it
    assert gather.kernel_bytes == 2 * 4 * 1024 + 2 * 4 * 1024
    assert (scatter.kind, scatter.kernels, scatter.kernel_bytes) == ("reduce-scatter", 0, 0)
    assert scatter.operand_bytes == 4 * 2048


def test_a_cpu_program_has_no_asynchronous_collectives():
    mesh = jax.make_mesh((2, 4), ("node", "local"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    f = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, ("node", "local"), tiled=True),
                              mesh=mesh, in_specs=jax.P(("node", "local")),
                              out_specs=jax.P(("node", "local"))))
    x = jax.device_put(jnp.arange(64.0), jax.NamedSharding(mesh, jax.P(("node", "local"))))
    text = f.lower(x).compile().as_text()
    assert "all-gather" in text and async_overlaps(text, (2, 4)) == []


def test_a_collective_wrapped_in_async_start_keeps_its_kind_axis_and_bytes():
    """XLA wraps a collective without a ``-start`` form of its own (a GPU
    reduce-scatter, an all-to-all) as ``async-start(...), calls=%wrapped``."""
    from test_comm_report import _ASYNC_HLO, MESH_SHAPE

    by_name = {o.name: o for o in async_overlaps(_ASYNC_HLO, MESH_SHAPE)}
    wrapped = by_name["rss"]
    assert (wrapped.kind, wrapped.axis, wrapped.operand_bytes, wrapped.count) == (
        "reduce-scatter", "local", 128, 8)
    assert by_name["ags"].kind == "all-gather"
