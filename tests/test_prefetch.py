"""Depth-1 prefetch of stacked layers' gathers (``zp.scan_layers``, ``ZeroConfig.prefetch``).

Read from the compiled HLO: inside each scan (``while``) body the all-gather
and that iteration's dot products do not depend on each other, so they may
overlap (without prefetch the gathered layer feeds the dots); the step keeps
its ``2L`` gathers and ``L`` reduce-scatters per stacked unit, and its
temporaries grow by at most one gathered layer. Values equal those without
prefetch (same collectives, only ordered differently).
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.hlo import parse_module
from zeropp_jax.models import gpt

from _util import (
    TINY, assert_trees_close, compile_step, executions, gpt_loss, gpt_step, mesh_of,
    stacked_mlp_loss, stacked_mlp_params, tiny_batches, tiny_gpt_run, train_and_gather,
)

WIDTH, LAYERS = 128, 4
_CALLS_RE = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_BODY_RE = re.compile(r"\bbody=%?([\w.\-]+)")


# ------------------------------------------------------------ HLO dataflow check
def _has_dot(comps, name, seen=None):
    """Whether computation ``name`` (or one it calls) contains a dot product."""
    seen = set() if seen is None else seen
    if name in seen:
        return False
    seen.add(name)
    for inst in comps[name].instructions:
        if inst.opcode in ("dot", "convolution"):
            return True
        if any(_has_dot(comps, c, seen) for c in _CALLS_RE.findall(inst.attrs_clean)):
            return True
    return False


def _closure(graph, start):
    out, todo = set(), list(start)
    while todo:
        n = todo.pop()
        for m in graph.get(n, ()):
            if m not in out:
                out.add(m)
                todo.append(m)
    return out


def gather_dot_paths(hlo_text):
    """Per scan body with all-gathers and dots: ``(dots -> gather operand, gather -> dots)``.

    Data edges only (operands, not ``control-predecessors``), inside the
    body computation: whether some all-gather's operand is computed from a
    dot of the same iteration, and whether some dot reads a value computed
    from an all-gather of the same iteration.
    """
    comps, _ = parse_module(hlo_text)
    bodies = {
        b for c in comps.values() for i in c.instructions if i.opcode == "while"
        for b in _BODY_RE.findall(i.attrs_clean)
    }
    paths = {}
    for body in sorted(bodies):
        insts = comps[body].instructions
        operands = {i.name: [n for n, _ in i.operands if n] for i in insts}
        users = {}
        for name, ops in operands.items():
            for op in ops:
                users.setdefault(op, []).append(name)
        dots = {
            i.name for i in insts
            if i.opcode in ("dot", "convolution")
            or any(_has_dot(comps, c) for c in _CALLS_RE.findall(i.attrs_clean))
        }
        gathers = [i.name for i in insts if i.opcode in ("all-gather", "all-gather-start")]
        if gathers and dots:
            paths[body] = (
                bool(_closure(operands, gathers) & dots),
                bool(_closure(users, gathers) & dots),
            )
    return paths


# ------------------------------------------------------------ a tiny stacked model
def _mlp_params(layers=LAYERS):
    return stacked_mlp_params(layers, WIDTH)


def _mlp_shapes(layers=LAYERS):
    return jax.eval_shape(lambda: _mlp_params(layers))


def _mlp_step(prefetch, preset="zero3", layers=LAYERS):
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="float32", prefetch=prefetch)
    batch = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32)
    return compile_step(
        stacked_mlp_loss, _mlp_shapes(layers), config=config, stacked=("blocks",), batch=batch
    )


@pytest.fixture(scope="module")
def mlp_steps():
    return {pf: _mlp_step(pf) for pf in (True, False)}


def test_gather_and_dots_of_one_iteration_are_independent(mlp_steps):
    on = gather_dot_paths(mlp_steps[True][1].as_text())
    off = gather_dot_paths(mlp_steps[False][1].as_text())
    assert len(on) == 2, on  # the forward and the backward scan
    assert not any(a or b for a, b in on.values()), on
    # without prefetch the gathered layer feeds the same iteration's dots
    assert all(gather_to_dot for _, gather_to_dot in off.values()), off


def test_collectives_are_those_without_prefetch(mlp_steps):
    (_, _, on), (_, _, off) = mlp_steps[True], mlp_steps[False]
    for kind in ("all-gather", "reduce-scatter"):
        assert executions(on, kind) == executions(off, kind), kind
    # 2L gathers and L reduce-scatters of the blocks, one of each for "scale"
    assert executions(on, "all-gather") == 2 * LAYERS + 1
    assert executions(on, "reduce-scatter") == LAYERS + 1


def test_prefetch_holds_one_more_gathered_layer_and_one_pending_gradient(mlp_steps):
    # The next layer's gathered parameters are alive beside the current
    # one's, and in the backward the previous layer's gradient waits (not
    # yet reduced) beside the current one's: a layer of each more than
    # without prefetch. The loops copy the carried layer once and gather the
    # next one straight into their carry; bytes past that are scalars and tuples.
    trainer, on, _ = mlp_steps[True]
    off = mlp_steps[False][1]
    layer_bytes = 4 * trainer.layout.unit("blocks").padded  # one layer, float32
    extra = on.memory_analysis().temp_size_in_bytes - off.memory_analysis().temp_size_in_bytes
    # (within 1%: zeropp's float32 layer came with 2.9 KB more, about 0.4%)
    assert extra <= 2 * layer_bytes * 1.01 + 1024, (extra, layer_bytes)


def test_two_layers_hold_one_more_gathered_layer_and_one_pending_gradient():
    # L = 2: the backward has no loop (its layers are the two computed around
    # it) and the forward's one iteration is inlined; the layers then read
    # their gathered parameters only once their input exists, else the
    # second layer's weights are sliced out as soon as it is gathered.
    (trainer, on, _), (_, off, _) = _mlp_step(True, layers=2), _mlp_step(False, layers=2)
    layer_bytes = 4 * trainer.layout.unit("blocks").padded
    extra = on.memory_analysis().temp_size_in_bytes - off.memory_analysis().temp_size_in_bytes
    # (within 1%: zeropp's float32 layer came with 2.9 KB more, about 0.4%)
    assert extra <= 2 * layer_bytes * 1.01 + 1024, (extra, layer_bytes)


def test_the_backward_reduces_each_gradient_during_the_next_layer(mlp_steps):
    # In the backward loop the reduce-scatter takes the gradient the previous
    # iteration computed (carried in), not one of this iteration's dots: so
    # it may run during this layer's VJP instead of after it.
    trainer, on, _ = mlp_steps[True]
    comps, entry = parse_module(on.as_text())
    loops = [c for c in comps.values()
             if c.name != entry  # the layers computed around the loops are there
             and any(i.opcode == "reduce-scatter" for i in c.instructions)
             and any(i.opcode == "dot" for i in c.instructions)
             and any(i.opcode == "all-gather" for i in c.instructions)]
    assert len(loops) == 1, [c.name for c in loops]  # the backward loop's body
    body = loops[0]
    (scatter,) = [i for i in body.instructions if i.opcode == "reduce-scatter"]
    by_name = {i.name: i for i in body.instructions}
    seen, todo = set(), [n for n, _ in scatter.operands if n]
    while todo:  # everything the reduce-scatter's operand is computed from, in this body
        inst = by_name.get(todo.pop())
        if inst is None or inst.name in seen:
            continue
        seen.add(inst.name)
        todo += [n for n, _ in inst.operands if n]
    assert not any(by_name[n].opcode == "dot" for n in seen), sorted(seen)


@pytest.mark.parametrize(
    "layers", [LAYERS, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_values_equal_without_prefetch_with_constants_and_ys(layers):
    params = _mlp_params(layers)
    batches = [jax.random.normal(jax.random.key(i), (8, WIDTH)) for i in range(2)]
    runs = {}
    for pf in (True, False):
        config = zp.ZeroConfig(compute_dtype="float32", prefetch=pf)
        trainer = zp.make_trainer(
            stacked_mlp_loss, optax.adam(1e-2), params, mesh=mesh_of(2, 4), config=config,
            per_layer=True, stacked=("blocks",),
        )
        runs[pf] = train_and_gather(trainer, params, batches)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert_trees_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-6)


def test_without_units_it_is_lax_scan():
    params = _mlp_params()
    x = jax.random.normal(jax.random.key(2), (4, WIDTH))

    def loss(scan, blocks, scale, x):
        def block(h, p):
            return jnp.tanh(h @ p["w"] + p["b"][None, :]) * scale[None, :], jnp.sum(h)

        h, ys = scan(block, x, blocks)
        return jnp.sum(h) + jnp.sum(ys)

    args = (params["blocks"], params["scale"], x)
    got = jax.value_and_grad(loss, argnums=(1, 2, 3))(zp.scan_layers, *args)
    want = jax.value_and_grad(loss, argnums=(1, 2, 3))(jax.lax.scan, *args)
    assert_trees_close(got, want, rtol=0)


def test_mismatched_layer_axes_are_rejected():
    plan = types.SimpleNamespace(prefetch=True)
    unit = zp.Unit(jnp.zeros((3, 8)), jnp.zeros((3, 8)), layout=None, plan=plan)
    with pytest.raises(ValueError, match="leading layer axis"):
        zp.scan_layers(lambda h, x: (h, None), jnp.zeros(()), {"u": unit, "x": jnp.zeros((2,))})


@pytest.mark.slow
# qwz: quantized gathers over all devices; zeropp: hpZ's in-node gathers of
# the int8 secondary (plain float gathers: the MLP tests above).
@pytest.mark.parametrize("preset", ["qwz", "zeropp"])
def test_gpt_values_equal_without_prefetch(preset):
    # zeropp in its full-precision warm-up: its 1-bit steps take signs of
    # momenta that are zero up to rounding (embedding rows a batch does not
    # touch), which turns last-bit differences into different updates. Adam
    # divides by the root of tiny second moments, hence atol on parameters.
    runs = {pf: tiny_gpt_run(zp.ZeroConfig.from_preset(preset, compute_dtype="float32",
                                                     prefetch=pf))
            for pf in (True, False)}
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert_trees_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-5)


def _carried_layer_bytes(trainer):
    """One layer of the stacked unit as a prefetching loop carries it: its gathered wire form.

    float32 parameters, or with qwZ the codes (``bits`` per element) and one
    scale per ``qwz_block`` elements in ``scale_dtype``.
    """
    plan, padded = trainer.geometry.plan, trainer.layout.unit("blocks").padded
    if not plan.bits:  # also zeropp's: hpZ's secondary is decoded once per step
        return 4 * padded
    scales = padded // plan.block * jnp.dtype(plan.scale_dtype).itemsize
    return padded * plan.bits // 8 + scales


# hpz (in-node gathers of the node's secondary partition) runs by default; the
# MLP tests above cover zero3's float gathers over all devices.
@pytest.mark.parametrize("preset", [
    "hpz",
    pytest.param("zero3", marks=pytest.mark.slow),
    pytest.param("qwz", marks=pytest.mark.slow),
    pytest.param("zeropp", marks=pytest.mark.slow),
])
def test_gpt_step_prefetches_with_the_same_collectives_and_one_more_layer(preset):
    t_on, c_on, r_on = gpt_step(4, preset=preset)
    _, c_off, r_off = gpt_step(4, preset=preset, prefetch=False)
    on, off = gather_dot_paths(c_on.as_text()), gather_dot_paths(c_off.as_text())
    assert len(on) == 2 and not any(a or b for a, b in on.values()), on
    assert all(gather_to_dot for _, gather_to_dot in off.values()), off
    assert executions(r_on, "reduce-scatter") == executions(r_off, "reduce-scatter")
    # Inside the node the same gathers. With hpZ the stacked unit's secondary
    # crosses nodes a layer at a time in the forward, one layer ahead, instead
    # of whole at the start of the step: L gathers over node for each one
    # made there, the same bytes.
    def in_node(r):
        return sum(c.count for c in r.collectives if c.kind == "all-gather" and c.axis == "local")

    def over_node(r):
        return [c for c in r.collectives if c.kind == "all-gather" and c.axis == "node"]

    assert in_node(r_on) == in_node(r_off)
    layers = t_on.layout.unit("blocks").stack
    if t_on.geometry.forms_secondary_per_layer(t_on.layout.unit("blocks")):
        assert {c.count for c in over_node(r_on)} == {1, layers - 1}, over_node(r_on)
        assert sum(c.count for c in over_node(r_on)) > sum(c.count for c in over_node(r_off))
    else:
        assert executions(r_on, "all-gather") == executions(r_off, "all-gather")
    assert r_on.inter_node_bytes == r_off.inter_node_bytes
    # One more layer than without prefetch, carried in its wire form (qwZ:
    # int8 codes and scales, a quarter of the float32 layer), and one pending
    # gradient (a float32 layer). Without the sinks' zeros waiting for the
    # cotangent, hpz held them across the forward.
    layer_bytes = _carried_layer_bytes(t_on) + 4 * t_on.layout.unit("blocks").padded
    extra = c_on.memory_analysis().temp_size_in_bytes - c_off.memory_analysis().temp_size_in_bytes
    # (within 1%: zeropp's float32 layer came with 2.9 KB more, about 0.4%)
    assert extra <= layer_bytes * 1.01 + 1024, (extra, layer_bytes)


def test_one_device_mesh_runs_a_plain_scan_without_layer_copies():
    # On one device prefetch would gather nothing, and XLA copies the layer its
    # loop carries (twice per iteration); there the trainer runs a plain scan.
    cfg = gpt.GPTConfig(n_layers=LAYERS, d_model=WIDTH, n_heads=4, seq_len=16)
    shapes = jax.eval_shape(lambda k: gpt.init_params(cfg, k), jax.random.key(0))
    loss = gpt_loss(cfg)
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32)

    def layer_copies(mesh):
        trainer = zp.make_trainer(
            loss, optax.adam(1e-3), shapes, mesh=mesh,
            config=zp.ZeroConfig.from_preset("zero3", compute_dtype="float32"),
            per_layer=True, stacked=("blocks",),
        )
        comps, _ = parse_module(trainer.compile_from_shapes(shapes, batch).as_text())
        layer = next(u.padded for u in trainer.layout.units if u.stack)
        copies = [i.shape.dims for c in comps.values() for i in c.instructions
                  if i.opcode == "copy" and getattr(i.shape, "dims", None) == (layer,)]
        return trainer.geometry.plan.prefetch, copies

    assert layer_copies(mesh_of(1, 1)) == (False, [])
    prefetch, copies = layer_copies(mesh_of(2, 4))  # where it gathers: the copies it costs
    assert prefetch and copies


def test_an_unstacked_unit_given_to_scan_layers_is_refused_naming_stacked():
    """The example GPT scans its blocks: built with per_layer=True alone, the
    blocks are one flat unit, which the scan would cut into scalars."""
    params = gpt.init_params(TINY, jax.random.key(0))
    trainer = zp.make_trainer(gpt_loss(), optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                              per_layer=True, config=zp.ZeroConfig(compute_dtype="float32"))
    with pytest.raises(ValueError, match=r"the unit\(s\) \['blocks'\] have no layer axis: "
                                         r"build the trainer with stacked=\('blocks',\)"):
        trainer.step(trainer.init(params), tiny_batches(batch_size=16).batch_at(0))
