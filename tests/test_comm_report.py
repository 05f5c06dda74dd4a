"""Tests of the HLO communication report.

Real programs are compiled on the 8 simulated CPU devices with a (2, 4)
("node", "local") mesh; byte counts are worked out by hand in the comments.
The input is f32[64, 8] split over all 8 devices, so each device holds
f32[8, 8] = 256 bytes.

What the CPU backend of this JAX version emits (see the assertions):
  * psum_scatter -> a native ``reduce-scatter`` (not all-reduce + dynamic-slice);
  * tiled all_to_all -> one variadic ``all-to-all`` with one operand per peer;
  * all_gather / psum / ppermute -> ``all-gather`` / ``all-reduce`` /
    ``collective-permute`` with explicit replica groups;
  * bf16 collectives are upcast to f32 around the collective (int8 and f16 are not);
  * GSPMD (jit + shardings, no shard_map) prints Shardy mesh-form replica groups.
"""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.analysis.collectives import parse_collectives
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.analysis.replica_groups import parse_replica_groups

MESH_SHAPE = (2, 4)
ALL = P(("node", "local"))  # shard dim 0 over all 8 devices


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(MESH_SHAPE, ("node", "local"))


def _compile(mesh, f, x, in_spec=ALL, out_spec=ALL):
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
    return fn.lower(jax.device_put(x, NamedSharding(mesh, in_spec))).compile()


def _report(mesh, f, dtype=jnp.float32):
    x = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8).astype(dtype)
    return comm_report(_compile(mesh, f, x), mesh_shape=MESH_SHAPE)


def _only(report):
    assert len(report.collectives) == 1, report.format_table()
    return report.collectives[0]


# ----------------------------------------------------------------------------
# Real compiled programs
# ----------------------------------------------------------------------------


def test_all_gather_local(mesh):
    report = _report(mesh, lambda a: jax.lax.all_gather(a, "local", tiled=True))
    c = _only(report)
    assert (c.kind, c.dtype, c.axis, c.group_size, c.count) == ("all-gather", "f32", "local", 4, 1)
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (c.operand_bytes, c.result_bytes) == (256, 1024)
    # 3 peers on the same node send 256 B each.
    assert c.intra_node_bytes_per_device == 768
    assert c.inter_node_bytes_per_node == 0
    assert (report.inter_node_bytes, report.intra_node_bytes) == (0, 768)
    assert report.exact


def test_all_gather_node(mesh):
    c = _only(_report(mesh, lambda a: jax.lax.all_gather(a, "node", tiled=True)))
    assert (c.kind, c.axis, c.group_size) == ("all-gather", "node", 2)
    assert c.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert (c.operand_bytes, c.result_bytes) == (256, 512)
    # Each of the node's 4 devices receives 256 B from the other node.
    assert c.inter_node_bytes_per_node == 1024
    assert c.inter_node_bytes_by_node == (1024, 1024)
    assert c.intra_node_bytes_per_device == 0


@pytest.mark.parametrize("axes, groups", [
    (("local", "node"), ((0, 4, 1, 5, 2, 6, 3, 7),)),
    (("node", "local"), ((0, 1, 2, 3, 4, 5, 6, 7),)),
])
def test_all_gather_both_axes(mesh, axes, groups):
    report = _report(mesh, lambda a: jax.lax.all_gather(a, axes, tiled=True))
    c = _only(report)
    assert (c.axis, c.group_size, c.replica_groups) == ("node+local", 8, groups)
    assert (c.operand_bytes, c.result_bytes) == (256, 2048)
    # Flat: 256 B from each of 7 peers: 4 on the other node, 3 on this one.
    assert c.inter_node_bytes_per_node == 4 * 4 * 256
    assert c.intra_node_bytes_per_device == 3 * 256
    assert (report.flat_inter_node_bytes, report.flat_intra_node_bytes) == (4 * 4 * 256, 3 * 256)
    # Two-level: the other node's 4 shards enter the node once (one per
    # device), then each device takes the 3 remote shards its peers brought
    # and its 3 peers' own shards: twice the flat intra-node count.
    assert (report.inter_node_bytes, report.intra_node_bytes) == (4 * 256, 6 * 256)
    assert "flat intra/dev" in report.format_table()
    data = report.to_json()
    assert (data["intra_node_bytes"], data["flat_intra_node_bytes"]) == (6 * 256, 3 * 256)


def test_psum_scatter_is_native_reduce_scatter(mesh):
    report = _report(mesh, lambda a: jax.lax.psum_scatter(a, "local", tiled=True))
    c = _only(report)  # no all-reduce + dynamic-slice rewrite on CPU
    assert (c.kind, c.axis, c.group_size) == ("reduce-scatter", "local", 4)
    assert (c.operand_bytes, c.result_bytes) == (256, 64)
    assert c.intra_node_bytes_per_device == 3 * 256 // 4
    assert c.inter_node_bytes_per_node == 0


@pytest.mark.parametrize("axes, axis, inter, intra", [
    ("local", "local", 0, 3 * (2 * 256 // 4)),
    ("node", "node", 4 * (2 * 256 // 2), 0),
    (("node", "local"), "node+local", 4 * 4 * (2 * 256 // 8), 3 * (2 * 256 // 8)),
])
def test_psum(mesh, axes, axis, inter, intra):
    c = _only(_report(mesh, lambda a: jax.lax.psum(a, axes)))
    assert (c.kind, c.axis, c.operand_bytes, c.result_bytes) == ("all-reduce", axis, 256, 256)
    assert (c.inter_node_bytes_per_node, c.intra_node_bytes_per_device) == (inter, intra)


def test_all_to_all_is_variadic(mesh):
    report = _report(mesh, lambda a: jax.lax.all_to_all(a, "local", 0, 0, tiled=True))
    c = _only(report)
    # CPU emits (f32[2,8] x 4) all-to-all(slice0, ..., slice3): 4 x 64 B operands.
    assert (c.kind, c.dtype, c.axis, c.group_size) == ("all-to-all", "f32", "local", 4)
    assert (c.operand_bytes, c.result_bytes) == (256, 256)
    assert c.intra_node_bytes_per_device == 3 * 64
    assert c.inter_node_bytes_per_node == 0


def test_ppermute_across_nodes(mesh):
    c = _only(_report(mesh, lambda a: jax.lax.ppermute(a, "node", [(0, 1), (1, 0)])))
    assert (c.kind, c.axis, c.group_size, c.num_groups) == ("collective-permute", "node", 2, 8)
    assert c.inter_node_bytes_per_node == 4 * 256
    assert c.intra_node_bytes_per_device == 0


def test_scan_counts_trip_count(mesh):
    def f(a):
        body = lambda c, _: (c + jax.lax.psum(c, "local"), None)
        return jax.lax.scan(body, a, None, length=5)[0]

    report = _report(mesh, f)
    c = _only(report)
    assert (c.kind, c.count, c.trip_count_known) == ("all-reduce", 5, True)
    assert c.intra_node_bytes_per_device == 5 * 3 * 128
    assert report.intra_node_bytes == 5 * 3 * 128


def test_nested_scans_multiply(mesh):
    def f(a):
        inner = lambda c, _: (c + jax.lax.psum(c, "node"), None)
        outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)
        return jax.lax.scan(outer, a, None, length=5)[0]

    report = _report(mesh, f)
    c = _only(report)
    assert (c.count, c.axis, c.trip_count_known) == (15, "node", True)
    assert report.inter_node_bytes == 15 * 4 * 256
    assert report.summary()[0].executions == 15


def test_int8_payload(mesh):
    c = _only(_report(mesh, lambda a: jax.lax.all_gather(a, "local", tiled=True), jnp.int8))
    assert c.dtype == "s8"
    assert (c.operand_bytes, c.result_bytes, c.intra_node_bytes_per_device) == (64, 256, 192)


def test_bfloat16_payload(mesh):
    report = _report(mesh, lambda a: jax.lax.all_gather(a, "node", tiled=True), jnp.bfloat16)
    c = _only(report)
    # XLA:CPU upcasts bf16 collectives to f32 (convert -> f32 all-gather ->
    # convert); the report says what the HLO really moves.
    element = 4 if jax.default_backend() == "cpu" else 2
    assert c.dtype == ("f32" if element == 4 else "bf16")
    assert c.operand_bytes == 64 * element
    assert c.inter_node_bytes_per_node == 4 * 64 * element


def test_memory_summary_json_and_table(mesh):
    def f(a):
        a = jax.lax.all_gather(a, "local", tiled=True)
        return jax.lax.psum_scatter(a, "local", tiled=True) + jax.lax.psum(a[:8], "node")

    report = _report(mesh, f)
    assert report.memory is not None and report.memory.argument_bytes == 256
    kinds = {(r.kind, r.axis) for r in report.summary()}
    assert kinds == {("all-gather", "local"), ("reduce-scatter", "local"), ("all-reduce", "node")}
    data = json.loads(json.dumps(report.to_json()))
    assert data["inter_node_bytes"] == report.inter_node_bytes == 1024
    assert data["intra_node_bytes"] == report.intra_node_bytes == 768 + 768
    table = report.format_table()
    assert "reduce-scatter" in table and "TOTAL" in table and "KiB" in table
    # The same report from the text alone, minus the memory.
    text_report = comm_report(_compile(mesh, f, jnp.zeros((64, 8), jnp.float32)).as_text(),
                              mesh_shape=MESH_SHAPE)
    assert text_report.memory is None
    assert text_report.collectives == report.collectives


def test_gspmd_mesh_form_groups(mesh):
    x = jax.device_put(jnp.ones((16, 16), jnp.float32), NamedSharding(mesh, P("local")))
    fn = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
    c = _only(comm_report(fn.lower(x).compile(), mesh_shape=MESH_SHAPE))
    assert (c.kind, c.axis) == ("all-reduce", "local")
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


# ----------------------------------------------------------------------------
# Replica-group parser
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec, groups", [
    ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[1,8]<=[8], dimensions={0}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("[2,4]<=[2,2,2]T(0,2,1)", [[0, 2, 1, 3], [4, 6, 5, 7]]),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_parse_replica_groups(spec, groups):
    assert parse_replica_groups(spec, num_devices=8) == groups


def test_parse_replica_groups_rejects_garbage():
    with pytest.raises(ValueError, match="Unrecognized replica_groups"):
        parse_replica_groups("nonsense", num_devices=8)
    with pytest.raises(ValueError, match="iota"):
        parse_replica_groups("[2,4]<=[4]", num_devices=8)


# ----------------------------------------------------------------------------
# Hand-written HLO
# ----------------------------------------------------------------------------

# GPU-style async collectives (operand shapes printed inline) in a loop of 8.
_ASYNC_HLO = """\
HloModule async_test, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
    %a = f32[] parameter(0)
    %b = f32[] parameter(1)
    ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%wrapped_rs (wp: f32[32]) -> f32[8] {
    %wp = f32[32]{0} parameter(0)
    ROOT %rs = f32[8]{0} reduce-scatter(f32[32]{0} %wp), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
    %p = (s32[], f32[8,8]{1,0}) parameter(0)
    %i = s32[] get-tuple-element((s32[], f32[8,8]{1,0}) %p), index=0
    %x = f32[8,8]{1,0} get-tuple-element((s32[], f32[8,8]{1,0}) %p), index=1
    %c = bf16[] constant(1)
    %y = bf16[4]{0} broadcast(bf16[] %c), dimensions={}
    %ags = ((f32[8,8]{1,0}, bf16[4]{0}), (f32[32,8]{1,0}, bf16[16]{0})) all-gather-start(f32[8,8]{1,0} %x, bf16[4]{0} %y), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
    %agd = (f32[32,8]{1,0}, bf16[16]{0}) all-gather-done(((f32[8,8]{1,0}, bf16[4]{0}), (f32[32,8]{1,0}, bf16[16]{0})) %ags)
    %ars = f32[8,8]{1,0} all-reduce-start(f32[8,8]{1,0} %x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
    %ard = f32[8,8]{1,0} all-reduce-done(f32[8,8]{1,0} %ars)
    %cps = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(f32[8,8]{1,0} %ard), channel_id=3, source_target_pairs={{0,4},{4,0}}
    %cpd = f32[8,8]{1,0} collective-permute-done((f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) %cps)
    %z = f32[32]{0} reshape(f32[8,8]{1,0} %cpd)
    %rss = ((f32[32]{0}), f32[8]{0}, s32[]) async-start(f32[32]{0} %z), calls=%wrapped_rs
    %rsd = f32[8]{0} async-done(((f32[32]{0}), f32[8]{0}, s32[]) %rss), calls=%wrapped_rs
    %one = s32[] constant(1)
    %i1 = s32[] add(s32[] %i, s32[] %one)
    ROOT %t = (s32[], f32[8,8]{1,0}) tuple(s32[] %i1, f32[8,8]{1,0} %cpd)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
    %q = (s32[], f32[8,8]{1,0}) parameter(0)
    %j = s32[] get-tuple-element((s32[], f32[8,8]{1,0}) %q), index=0
    %n = s32[] constant(8)
    ROOT %lt = pred[] compare(s32[] %j, s32[] %n), direction=LT
}

ENTRY %main (arg: f32[8,8]) -> f32[8,8] {
    %arg = f32[8,8]{1,0} parameter(0)
    %zero = s32[] constant(0)
    %init = (s32[], f32[8,8]{1,0}) tuple(s32[] %zero, f32[8,8]{1,0} %arg)
    %w = (s32[], f32[8,8]{1,0}) while((s32[], f32[8,8]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
    ROOT %out = f32[8,8]{1,0} get-tuple-element((s32[], f32[8,8]{1,0}) %w), index=1
}
"""


def test_async_collectives_counted_once_at_start():
    cs = {c.kind: c for c in parse_collectives(_ASYNC_HLO, mesh_shape=MESH_SHAPE)}
    assert sorted(cs) == ["all-gather", "all-reduce", "collective-permute", "reduce-scatter"]
    assert all(c.count == 8 and c.trip_count_known for c in cs.values())

    ag = cs["all-gather"]  # variadic: f32[8,8] + bf16[4] -> f32[32,8] + bf16[16]
    assert (ag.dtype, ag.axis, ag.group_size) == ("f32+bf16", "local", 4)
    assert (ag.operand_bytes, ag.result_bytes) == (256 + 8, 1024 + 32)
    assert ag.intra_node_bytes_per_device == 8 * 3 * 264

    ar = cs["all-reduce"]  # [4,2]<=[2,4]T(1,0): {0,4},{1,5},...
    assert (ar.axis, ar.replica_groups[0], ar.operand_bytes) == ("node", (0, 4), 256)
    assert ar.inter_node_bytes_per_node == 8 * 4 * 256

    cp = cs["collective-permute"]  # only devices 0 and 4 receive
    assert (cp.axis, cp.operand_bytes, cp.result_bytes) == ("node", 256, 256)
    assert cp.inter_node_bytes_by_node == (8 * 256, 8 * 256)

    rs = cs["reduce-scatter"]  # inside the async-start wrapper computation
    assert (rs.computation, rs.operand_bytes, rs.result_bytes) == ("wrapped_rs", 128, 32)
    assert rs.intra_node_bytes_per_device == 8 * 3 * 32

    # the report's totals: the two-type all-gather counts at its compiled widths,
    # also where a run's float payloads would be narrowed
    for dtypes in (None, ("bfloat16", "bfloat16")):
        report = comm_report(_ASYNC_HLO, mesh_shape=MESH_SHAPE, float_dtypes=dtypes)
        mixed = next(c for c in report.collectives if c.dtype == "f32+bf16")
        assert report.wire_dtype(mixed) == "f32+bf16" and report.width_ratio(mixed) == 1.0
        assert report.intra_node_bytes >= ag.intra_node_bytes_per_device
        assert report.inter_node_bytes >= ar.inter_node_bytes_per_node // 2


_COND_HLO = """\
HloModule cond_test

%add (a: f32[], b: f32[]) -> f32[] {
    %a = f32[] parameter(0)
    %b = f32[] parameter(1)
    ROOT %sum = f32[] add(%a, %b)
}

%branch0 (p0: f32[8]) -> f32[8] {
    %p0 = f32[8]{0} parameter(0)
    ROOT %ar0 = f32[8]{0} all-reduce(%p0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
}

%branch1 (p1: f32[8]) -> f32[8] {
    %p1 = f32[8]{0} parameter(0)
    %s = f32[4]{0} slice(%p1), slice={[0:4]}
    ROOT %ag1 = f32[8]{0} all-gather(%s), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
}

%loop_body (lp: f32[8]) -> f32[8] {
    %lp = f32[8]{0} parameter(0)
    ROOT %ar2 = f32[8]{0} all-reduce(%lp), channel_id=3, replica_groups={}, to_apply=%add
}

%loop_cond (lq: f32[8]) -> pred[] {
    %lq = f32[8]{0} parameter(0)
    ROOT %t = pred[] constant(true)
}

ENTRY %main (idx: s32[], x: f32[8]) -> f32[8] {
    %idx = s32[] parameter(0)
    %x = f32[8]{0} parameter(1)
    %cond = f32[8]{0} conditional(%idx, %x, %x), branch_computations={%branch0, %branch1}
    ROOT %w = f32[8]{0} while(%cond), condition=%loop_cond, body=%loop_body
}
"""


def test_conditional_and_unknown_trip_count_are_flagged():
    report = comm_report(_COND_HLO, mesh_shape=MESH_SHAPE)
    cs = {c.name: c for c in report.collectives}
    assert (cs["ar0"].count, cs["ar0"].in_conditional, cs["ar0"].axis) == (1, True, "local")
    assert (cs["ag1"].count, cs["ag1"].in_conditional, cs["ag1"].axis) == (1, True, "node")
    assert cs["ag1"].inter_node_bytes_per_node == 4 * 16  # O/g = 32 B / 2
    ar2 = cs["ar2"]  # no known_trip_count: counted once and flagged
    assert (ar2.count, ar2.trip_count_known, ar2.in_conditional) == (1, False, False)
    assert (ar2.axis, ar2.group_size) == ("node+local", 8)  # {} = all devices
    assert not report.exact
    assert "~" in report.format_table()


def test_a_mesh_shape_of_other_devices_than_the_programs_is_refused(mesh):
    x = jnp.ones((64, 8), jnp.float32)
    compiled = _compile(mesh, lambda a: jax.lax.all_gather(a, "node", tiled=True), x)
    assert comm_report(compiled, mesh_shape=(4, 2)).collectives  # 8 devices: another split
    with pytest.raises(ValueError, match=r"runs on 8 devices .* mesh_shape \(2, 8\) has 16"):
        comm_report(compiled, mesh_shape=(2, 8))


def test_errors():
    with pytest.raises(ValueError, match="does not look like an HLO module"):
        comm_report("module @jit_f { func.func public @main() { return } }", mesh_shape=MESH_SHAPE)
    bad = _COND_HLO.replace("{{0,4},{1,5},{2,6},{3,7}}", "{{0,8}}")
    with pytest.raises(ValueError, match="outside the mesh"):
        comm_report(bad, mesh_shape=MESH_SHAPE)
    with pytest.raises(ValueError, match="mesh_shape"):
        comm_report(_COND_HLO, mesh_shape=(2, 0))
    garbled = _COND_HLO.replace("ROOT %ag1 = f32[8]{0} all-gather", "ROOT %ag1 = ?? all-gather")
    with pytest.raises(ValueError, match="Could not parse collective"):
        parse_collectives(garbled, mesh_shape=MESH_SHAPE)


# ----------------------------------------------------------------------------
# Headline: two-level vs flat, and full-precision payloads at the run's dtypes
# ----------------------------------------------------------------------------


def test_headline_is_two_level_and_flat_counts_every_device(mesh):
    # all-gather over all 8 devices, result 8 x 256 B per device. Two-level:
    # the node takes in the other node's 4 chunks once (1024 B); flat: each
    # of its 4 devices receives those 4 chunks (4096 B, `local` times more).
    report = _report(mesh, lambda a: jax.lax.all_gather(a, ("node", "local"), tiled=True))
    assert _only(report).axis == "node+local"
    assert (report.inter_node_bytes, report.flat_inter_node_bytes) == (1024, 4096)
    data = report.to_json()
    assert (data["inter_node_bytes"], data["flat_inter_node_bytes"]) == (1024, 4096)
    assert data["summary"][0]["flat_inter_node_bytes"] == 4096


def test_bfloat16_run_counted_at_bfloat16(mesh):
    f = lambda a: jax.lax.all_gather(a, "node", tiled=True)
    x = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8).astype(jnp.bfloat16)
    compiled = _compile(mesh, f, x)
    as_compiled = comm_report(compiled, mesh_shape=MESH_SHAPE)
    report = comm_report(compiled, mesh_shape=MESH_SHAPE, float_dtypes=(jnp.bfloat16, "bf16"))
    # 4 devices per node each take one 64-element chunk from the other node.
    assert report.inter_node_bytes == report.flat_inter_node_bytes == 4 * 64 * 2
    assert report.summary()[0].dtype == "bf16"
    assert report.narrowed == (as_compiled.collectives[0].dtype == "f32")
    assert as_compiled.inter_node_bytes == 4 * 64 * (4 if report.narrowed else 2)
    if report.narrowed:
        assert "bf16*" in report.format_table()
    # A float32 run is counted as compiled.
    f32 = comm_report(compiled, mesh_shape=MESH_SHAPE, float_dtypes=("float32", "float32"))
    assert f32.inter_node_bytes == as_compiled.inter_node_bytes and not f32.narrowed
    with pytest.raises(ValueError, match="full-precision wire dtype"):
        comm_report(compiled, mesh_shape=MESH_SHAPE, float_dtypes=("int8", "bf16"))


def test_a_quantized_payload_moves_as_one_packed_collective_of_exact_bytes(mesh):
    from zeropp_jax.analysis.collectives import payload_role
    from zeropp_jax.wire import collectives
    from zeropp_jax.wire.quantization import quantize

    def f(a):  # this device's f32[8, 8] -> int8 codes f32[8, 8] and bf16 scales [8, 1]
        q = quantize(a, bits=8, block=8, scale_dtype=jnp.bfloat16)
        return collectives.all_gather(q, ("node",)).values.astype(jnp.float32)

    x = jnp.zeros((64, 8), jnp.float32)
    report = comm_report(_compile(mesh, f, x), mesh_shape=MESH_SHAPE,
                         float_dtypes=("bf16", "bf16"))
    c = _only(report)
    assert c.kind == "all-gather" and c.dtype == "u8" and payload_role(c) == "packed"
    # per device 64 code bytes + 8 bf16 scales: XLA:CPU cannot widen bytes
    assert c.operand_bytes == 64 + 8 * 2 and not report.narrowed
    assert report.inter_node_bytes == 4 * (64 + 16)


@pytest.mark.parametrize("two_level", [False, True])
def test_packed_collectives_equal_one_collective_per_array(mesh, two_level):
    from zeropp_jax.wire import collectives

    key = jax.random.key(0)
    x = jax.random.normal(key, (8 * 3, 2, 40))  # per device (3, 2, 40)
    spec = P(("node", "local"))

    def parts(a):  # arrays of four dtypes and shapes, all (..., 2, m)
        return {"f": a[0], "h": a[1, :, :8].astype(jnp.bfloat16),
                "i": (a[2] * 50).astype(jnp.int8), "u": (a[2, :, :24] > 0).astype(jnp.uint8)}

    def gathered(a, packed):
        payload = parts(a)
        if packed:
            return collectives.all_gather(payload, ("local", "node"), two_level=two_level)
        return {k: collectives.all_gather(v, ("local", "node"), two_level=two_level)
                for k, v in payload.items()}

    def exchanged(a, packed):
        payload = parts(a)
        if packed:
            return collectives.all_to_all_chunks(payload, "node")
        return {k: collectives.all_to_all_chunks(v, "node") for k, v in payload.items()}

    placed = jax.device_put(x, NamedSharding(mesh, spec))
    for fn in (gathered, exchanged):
        runs = [jax.jit(jax.shard_map(lambda a, p=p: jax.tree.map(lambda v: v[None], fn(a, p)),
                                      mesh=mesh, in_specs=spec, out_specs=spec))(placed)
                for p in (True, False)]
        for k in runs[1]:
            assert runs[0][k].dtype == runs[1][k].dtype and runs[0][k].shape == runs[1][k].shape
            assert (runs[0][k].view(jnp.uint8) == runs[1][k].view(jnp.uint8)).all(), (fn, k)
        hlo = jax.jit(jax.shard_map(lambda a: fn(a, True), mesh=mesh, in_specs=spec,
                                    out_specs=spec)).lower(placed).compile().as_text()
        assert len([c for c in parse_collectives(hlo, mesh_shape=MESH_SHAPE)]) == (
            2 if fn is gathered and two_level else 1)


def test_full_precision_steps_of_a_schedule():
    from zeropp_jax.analysis.headline import full_precision_steps
    from zeropp_jax.step.schedule import QgzSchedule

    # warm-up 100, then every 10th step: steps 109, 119, ..., 299.
    schedule = QgzSchedule(active=True, warmup_steps=100, refresh_every=10)
    assert full_precision_steps(schedule, 300) == 100 + 20
    assert full_precision_steps(schedule, 50) == 50
    assert full_precision_steps(QgzSchedule(active=False, warmup_steps=100), 300) == 0


def test_zero3_figure_from_the_model_size():
    import types

    from zeropp_jax.analysis.headline import zero3_inter_node_bytes

    units = [types.SimpleNamespace(numel=790, stack=None), types.SimpleNamespace(numel=4, stack=2)]
    trainer = types.SimpleNamespace(
        nodes=4, local=1, compute_dtype=jnp.bfloat16, layout=types.SimpleNamespace(units=units),
        config=types.SimpleNamespace(reduce_dtype=None, grad_accum=2))
    # zero3 pads each unit to 4 devices x 8: 800 + 2 layers x 32 = 864 elements;
    # 3 passes x 2 micro-batches x 864 x 2 B, of which 3/4 held on other nodes.
    assert zero3_inter_node_bytes(trainer) == 3 * 2 * 864 * 2 * 3 // 4


def test_zero3_figure_is_the_same_beside_every_preset():
    """The "zero3 would move" figure is zero3's own padding, not the run's (a
    qwZ run pads shards and leaves to its blocks, which zero3 would not)."""
    import zeropp_jax as zp
    from _util import TINY, gpt_loss, mesh_of, optimizer
    from zeropp_jax.analysis.headline import zero3_inter_node_bytes
    from zeropp_jax.models import gpt

    shapes = jax.eval_shape(lambda k: gpt.init_params(TINY, k), jax.random.key(0))
    figures, padded = {}, {}
    for preset in ("zero3", "qwz", "zeropp"):
        config = zp.ZeroConfig.from_preset(preset, compute_dtype="bfloat16")
        trainer = zp.make_trainer(gpt_loss(), optimizer(config), shapes, mesh=mesh_of(2, 4),
                                  config=config, per_layer=True, stacked=("blocks",))
        figures[preset], padded[preset] = zero3_inter_node_bytes(trainer), trainer.layout.padded_numel
    assert padded["qwz"] > padded["zero3"]  # so the run's own padding would overstate zero3
    assert figures["qwz"] == figures["zeropp"] == figures["zero3"]
    assert figures["zero3"] == 3 * padded["zero3"] * 2 // 2  # 3 passes, bf16, half on the other node


@pytest.mark.slow  # four compiled steps
def test_closing_figures_of_a_float32_run_are_also_given_at_bfloat16():
    """``zeropp-train``'s closing figures (``headline.step_bytes``): a float32
    run (the CPU's default) is counted at float32 and, under ``at_bf16``, at
    the 2 bytes a GPU run sends. The compressed step's 1-bit codes and bf16
    scales do not change; zero3's figure halves; the schedule mean (100
    full-precision warm-up steps of 120) falls with the full-precision
    step's floats. A bfloat16 run has no second set."""
    import zeropp_jax as zp
    from _util import TINY, gpt_loss, mesh_of, optimizer
    from zeropp_jax.analysis import headline
    from zeropp_jax.models import gpt

    shapes = jax.eval_shape(lambda k: gpt.init_params(TINY, k), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, TINY.seq_len + 1), jnp.int32)

    def figures(dtype):
        config = zp.ZeroConfig.from_preset("zeropp-max", compute_dtype=dtype)
        trainer = zp.make_trainer(gpt_loss(), optimizer(config), shapes, mesh=mesh_of(2, 4),
                                  config=config, per_layer=True, stacked=("blocks",))
        return headline.step_bytes(trainer, shapes, batch, steps=120)

    f32 = figures("float32")
    bf16 = f32["at_bf16"]
    assert f32["dtype"] == "float32" and f32["full_precision_steps"] == 100
    assert bf16["inter_node_bytes"] == f32["inter_node_bytes"]  # codes and scales only
    assert bf16["zero3_inter_node_bytes"] * 2 == f32["zero3_inter_node_bytes"]
    assert f32["inter_node_bytes"] < bf16["schedule_inter_node_bytes"]
    assert bf16["schedule_inter_node_bytes"] < f32["schedule_inter_node_bytes"]
    lines = headline.summary_line(f32, steps=120).splitlines()
    assert len(lines) == 2 and "float32" in lines[0] and "bfloat16" in lines[1]
    # A bf16 run's own figures equal the float32 program's counted at bf16.
    native = figures("bfloat16")
    assert "at_bf16" not in native and native["dtype"] == "bfloat16"
    assert native["schedule_inter_node_bytes"] == bf16["schedule_inter_node_bytes"]
    assert len(headline.summary_line(native, steps=120).splitlines()) == 1
    # On one node nothing crosses nodes: no ratio to zero3 (it read "0.0x as much").
    alone = {**native, "inter_node_bytes": 0, "schedule_inter_node_bytes": 0,
             "zero3_inter_node_bytes": 0}
    assert headline.summary_line(alone, steps=120).endswith(
        "(one node: nothing crosses nodes, for zero3 either)")
