"""ZeRO-3 on the (node, local) mesh matches plain single-device training."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.models import gpt

from _util import (
    MESH,
    TINY,
    assert_trees_close,
    gpt_loss,
    mesh_of,
    optimizer,
    reference_run,
    tiny_batches,
    zero_run,
)

STEPS = 20
FP32 = dict(compute_dtype="float32")


@pytest.fixture(scope="module")
def reference():
    params = gpt.init_params(TINY, jax.random.key(0))
    norms = []
    losses, final = reference_run(gpt_loss(per_layer=False), params, optimizer(), tiny_batches(),
                                  STEPS, grad_norms=norms)
    return params, losses, final, np.array(norms)


@pytest.mark.parametrize(
    "shape,preset,per_layer",
    [
        ((2, 4), "zero3", True),
        pytest.param((1, 8), "zero3", True, marks=pytest.mark.slow),
        pytest.param((3, 2), "zero3", True, marks=pytest.mark.slow),
        pytest.param((1, 1), "zero3", True, marks=pytest.mark.slow),
        ((2, 4), "hpz", True),  # hpZ without quantization is exact too
        pytest.param((2, 4), "zero3", False, marks=pytest.mark.slow),  # whole-model gathering
    ],
)
def test_matches_single_device(reference, shape, preset, per_layer):
    params, ref_losses, ref_final, _ = reference
    trainer = zp.make_trainer(
        gpt_loss(per_layer=per_layer), optimizer(), params, mesh=mesh_of(*shape),
        config=zp.ZeroConfig.from_preset(preset, **FP32), per_layer=per_layer,
        stacked=("blocks",) if per_layer else (),
    )
    losses, state = zero_run(trainer, params, tiny_batches(), STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(trainer.gather_params(state), ref_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [pytest.param("lbfgs", marks=pytest.mark.slow), "prodigy"])
def test_optimizers_taking_inner_products_match_single_device(name):
    """Optimizers that reduce over a unit (``optax.tree.vdot``: L-BFGS,
    Prodigy) run on the sharded units as on one device; on the mesh's
    explicit axes they were refused at the first step."""
    opt = {"lbfgs": optax.chain(optax.scale_by_lbfgs(memory_size=3), optax.scale(-0.05)),
           "prodigy": optax.contrib.prodigy(1.0)}[name]
    params = gpt.init_params(TINY, jax.random.key(0))
    ref_losses, ref_final = reference_run(gpt_loss(per_layer=False), params, opt, tiny_batches(), 4)
    trainer = zp.make_trainer(gpt_loss(), opt, params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig.from_preset("zero3", **FP32), per_layer=True,
                              stacked=("blocks",))
    losses, state = zero_run(trainer, params, tiny_batches(), 4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(trainer.gather_params(state), ref_final, rtol=1e-4, atol=1e-5)
    placed = trainer.abstract_state(params)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state),
                                                        jax.tree.leaves(placed)))
    # every unit-sized leaf is sharded as the units are, L-BFGS's (K, [L,] U)
    # history too (optax builds it replicated: a copy of the model per device)
    padded = {u.padded for u in trainer.layout.units}
    sized = [x for x in jax.tree.leaves(state.opt_state.inner) if x.ndim and x.shape[-1] in padded]
    assert sized and all(x.sharding.spec[-1] == ("local", "node") for x in sized)


class _MaskedBatches:
    """Rows of floats with a bool mask and int positions, as a model reads them."""

    def batch_at(self, step):
        rng = np.random.default_rng(step)
        return {"x": rng.normal(size=(16, 8)).astype(np.float32),
                "mask": rng.random((16, 8)) > 0.3, "pos": rng.integers(0, 8, (16,)).astype(np.int32)}


def _masked_stack_loss(params, batch):
    """A stack of layers under ``lax.scan(zp.layer(...))`` whose block closes
    over a bool mask and int positions from the batch (not its arguments)."""
    def block(h, w):
        w = zp.gather(w)
        h = jnp.where(batch["mask"], jnp.tanh(h @ w["w"] + w["b"][None]), h)
        return h + 0.01 * batch["pos"][:, None], None

    h, _ = jax.lax.scan(zp.layer(block), batch["x"], params["blocks"])
    return jnp.mean(jnp.square(h @ zp.gather(params["head"])))


@pytest.mark.parametrize("overrides", [{}, dict(prefetch=False),
                                       dict(keep_activations=True)])
def test_a_layer_closing_over_int_and_bool_values_trains_like_one_device(overrides):
    """``jax.closure_convert`` hoists only floats: a block closing over an int
    or bool value failed to compile under ``lax.scan(zp.layer(...))``."""
    rng = np.random.default_rng(0)
    params = {"blocks": {"w": rng.normal(size=(3, 8, 8)).astype(np.float32) * 0.3,
                         "b": np.zeros((3, 8), np.float32)},
              "head": rng.normal(size=(8, 2)).astype(np.float32)}
    opt = optax.adam(1e-2)
    ref_losses, ref_final = reference_run(_masked_stack_loss, params, opt, _MaskedBatches(), 3)
    trainer = zp.make_trainer(_masked_stack_loss, opt, params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig.from_preset("zero3", **FP32, **overrides),
                              per_layer=True, stacked=("blocks",))
    losses, state = zero_run(trainer, params, _MaskedBatches(), 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(trainer.gather_params(state), ref_final, rtol=1e-4, atol=1e-6)


def test_init_takes_parameters_committed_to_a_device_or_sharded_on_a_mesh():
    """A model loaded or initialised already placed (on one device, sharded
    on the trainer's mesh or another one) starts the state a host copy does."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    params = gpt.init_params(TINY, jax.random.key(0))
    mesh = mesh_of(2, 4)
    trainer = zp.make_trainer(gpt_loss(), optimizer(), params, mesh=mesh, per_layer=True,
                              stacked=("blocks",))
    want = jax.device_get(trainer.init(jax.device_get(params)))
    line = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
    placed = {
        "one device": jax.device_put(params, jax.devices()[3]),
        "this mesh": jax.tree.map(lambda x: jax.device_put(
            x, NamedSharding(mesh, P(*[None] * (x.ndim - 1), "local"))), params),
        "another mesh": jax.tree.map(lambda x: jax.device_put(
            x, NamedSharding(line, P("d") if x.shape[0] % 8 == 0 else P())), params),
    }
    for name, p in placed.items():
        got = jax.device_get(trainer.init(p))
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_grad_accumulation_is_exact_mean(reference):
    """Three micro-batches per device: the losses of one-device training, and
    the gradient is the mean over devices and micro-batches, not their sum.

    The losses alone cannot tell a mean from a sum: clipped Adam's update is
    (nearly) the same for a gradient 3x too large. The steps' ``grad_norm``
    (taken before clipping) can: the norms of the one-device gradients.
    """
    params, ref_losses, _, ref_norms = reference
    trainer = zp.make_trainer(
        gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4),
        config=zp.ZeroConfig.from_preset("zero3", grad_accum=3, **FP32),
        per_layer=True, stacked=("blocks",),
    )
    norms = []
    losses, _ = zero_run(trainer, params, tiny_batches(), 5, grad_norms=norms)
    np.testing.assert_allclose(losses, ref_losses[:5], rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms[:5], rtol=1e-5)


@pytest.mark.slow
def test_odd_shapes_scalar_and_odd_vocab():
    """Scalars, odd sizes and a vocabulary not divisible by 8, on 3 nodes."""
    cfg = gpt.GPTConfig(vocab_size=251, seq_len=16, n_layers=3, d_model=24, n_heads=3)
    params = gpt.init_params(cfg, jax.random.key(1))
    params["extra"] = {
        "temperature": jnp.asarray(1.0, jnp.float32),
        "odd": jax.random.normal(jax.random.key(2), (7, 13)) * 0.01,
    }

    def loss(p, batch):
        base = gpt.loss_fn(p, batch, cfg, gather=zp.gather, layer=zp.layer)
        extra = zp.gather(p["extra"])
        return base * extra["temperature"] + jnp.sum(jnp.square(extra["odd"]))

    def plain_loss(p, batch):
        base = gpt.loss_fn(p, batch, cfg)
        return base * p["extra"]["temperature"] + jnp.sum(jnp.square(p["extra"]["odd"]))

    batches = tiny_batches(cfg, batch_size=12)
    ref_losses, ref_final = reference_run(plain_loss, params, optimizer(), batches, 10)
    for shape in [(3, 2), (2, 4)]:
        trainer = zp.make_trainer(
            loss, optimizer(), params, mesh=mesh_of(*shape),
            config=zp.ZeroConfig(**FP32), per_layer=True, stacked=("blocks",),
        )
        batches_z = tiny_batches(cfg, batch_size=12 if shape == (3, 2) else 16)
        if shape == (2, 4):
            ref_losses_z, ref_final_z = reference_run(plain_loss, params, optimizer(), batches_z, 10)
        else:
            ref_losses_z, ref_final_z = ref_losses, ref_final
        losses, state = zero_run(trainer, params, batches_z, 10)
        np.testing.assert_allclose(losses, ref_losses_z, rtol=1e-5)
        out = trainer.gather_params(state)
        assert out["extra"]["temperature"].shape == ()
        assert out["embed"]["tokens"].shape == (251, 24)
        assert_trees_close(out, ref_final_z, rtol=1e-5, atol=1e-5)


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(37)(x)
        x = nn.gelu(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(5)(x)


def _assert_whole_model_run_matches_one_device(loss, params, opt, batches, steps):
    """An unmodified model (no gather/layer marks) on 2x4: same losses and
    final parameters as plain single-device training, and it learns."""
    ref_losses, ref_final = reference_run(loss, params, opt, batches, steps)
    trainer = zp.make_trainer(loss, opt, params, mesh=mesh_of(2, 4), config=zp.ZeroConfig(**FP32))
    losses, state = zero_run(trainer, params, batches, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(trainer.gather_params(state), ref_final, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]


def test_unmodified_linen_model_trains_with_whole_model_gathering():
    model = _LinenMLP()
    x = jax.random.normal(jax.random.key(0), (64, 11))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 5)
    params = model.init(jax.random.key(2), x[:1])["params"]

    def loss(p, batch):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    class Batches:
        def batch_at(self, i):
            sl = slice((i % 2) * 32, (i % 2) * 32 + 32)
            return {"x": np.asarray(x[sl]), "y": np.asarray(y[sl])}

    _assert_whole_model_run_matches_one_device(
        loss, params, optax.sgd(0.1, momentum=0.9), Batches(), 8)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero3", "zeropp"])
def test_sharding_invariance(preset):
    params = gpt.init_params(TINY, jax.random.key(0))
    config = zp.ZeroConfig.from_preset(preset, **FP32)
    trainer = zp.make_trainer(
        gpt_loss(), optimizer(config), params, mesh=mesh_of(2, 4),
        config=config, per_layer=True, stacked=("blocks",),
    )
    state = trainer.init(params)

    def signature(s):
        return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), s)

    first = signature(state)
    batches = tiny_batches()
    for i in range(4):
        state, _ = trainer.step(state, batches.batch_at(i))
        assert signature(state) == first
    # master weights are float32 shards of 1/8 of each unit on every device
    for name, x in state.params.items():
        assert x.dtype == jnp.float32
        shard = x.addressable_shards[0].data
        assert shard.shape[-1] * 8 == x.shape[-1]


def test_bad_input_errors(monkeypatch):
    params = gpt.init_params(TINY, jax.random.key(0))
    with pytest.raises(ValueError, match="needs 6 devices but 8") as error:
        zp.make_mesh(2, 3)
    # On the CPU the message says how to simulate as many devices: here (as
    # conftest set it) by changing the count XLA_FLAGS gives, or by setting one.
    assert ("change --xla_force_host_platform_device_count=8 in XLA_FLAGS to 6 (the CLI "
            "tools set it from --mesh only where XLA_FLAGS does not)") in str(error.value)
    monkeypatch.delenv("XLA_FLAGS")
    with pytest.raises(ValueError, match="needs 6 devices but 8") as error:
        zp.make_mesh(2, 3)
    assert "set XLA_FLAGS=--xla_force_host_platform_device_count=6" in str(error.value)
    monkeypatch.undo()
    # On several processes: the count of processes (one a node), or of devices in each.
    from zeropp_jax.mesh import _processes_hint
    assert "pass -n 4 for mesh 4x2, or use mesh 2x2: --mesh, make_mesh(2, 2)" in _processes_hint(4, 2, 2, 4)
    assert _processes_hint(2, 4, 2, 4).endswith("pass --devices-per-process 4)")
    with pytest.raises(ValueError, match="unknown preset 'zero4'"):
        zp.ZeroConfig.from_preset("zero4")
    with pytest.raises(ValueError, match="qwz_bits"):
        zp.ZeroConfig(qwz_bits=3)
    with pytest.raises(ValueError, match="unknown config field"):
        zp.ZeroConfig.from_preset("zero3", qwz=8)
    trainer = zp.make_trainer(
        gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4), per_layer=True, stacked=("blocks",)
    )
    with pytest.raises(ValueError, match="batch size 12 must be divisible by .* 8"):
        trainer.shard_batch(np.zeros((12, 17), np.int32))
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):  # numbers numpy does not call numbers
        assert trainer.shard_batch({"x": np.ones((8, 3), dtype)})["x"].dtype == dtype
    auto = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"axes node \(Auto\), local \(Auto\) are not "
                       "Explicit.*zeropp_jax.make_mesh"):
        zp.make_trainer(gpt_loss(), optimizer(), params, mesh=auto, per_layer=True)
    as_str = zp.make_trainer(gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4), per_layer=True,
                             stacked="blocks")  # one name, not its letters
    assert as_str.layout == trainer.layout
    with pytest.raises(ValueError, match="stacked names"):
        zp.make_trainer(gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4), per_layer=True, stacked=("layers",))
    bad = dict(params, ln_f={"scale": jnp.ones(7), "bias": jnp.zeros(32)})
    with pytest.raises(ValueError, match="ln_f.*shape"):
        trainer.init(bad)


def test_unmodified_nnx_model_trains_with_whole_model_gathering():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(11, 37, rngs=rngs)
            self.l2 = nnx.Linear(37, 5, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.gelu(self.l1(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    x = jax.random.normal(jax.random.key(0), (32, 11))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 5)

    def loss(p, batch):
        logits = nnx.merge(graphdef, p)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    class Batches:
        def batch_at(self, i):
            return {"x": np.asarray(x), "y": np.asarray(y)}

    _assert_whole_model_run_matches_one_device(loss, params, optax.adam(1e-2), Batches(), 6)


ASYNC_STEPS = '''
import functools, sys
import jax
import zeropp_jax as zp
from zeropp_jax.models import gpt
sys.path.insert(0, sys.argv[1])
from tests._util import TINY, tiny_batches
params = gpt.init_params(TINY, jax.random.key(0))
loss = functools.partial(gpt.loss_fn, cfg=TINY, gather=zp.gather, layer=zp.layer)
import optax
trainer = zp.make_trainer(loss, optax.adam(1e-3), params, mesh=zp.make_mesh(2, 4),
                          config=zp.ZeroConfig.from_preset("zero3", compute_dtype="float32"),
                          per_layer=True, stacked=("blocks",))
state, batches, losses = trainer.init(params), tiny_batches(), []
for i in range(300):  # never reads a result back: every step is queued at once
    state, metrics = trainer.step(state, batches.batch_at(i % 4))
    losses.append(metrics["loss"])
print("finished", float(losses[-1]))
'''


@pytest.mark.slow
def test_many_queued_steps_do_not_deadlock_on_cpu():
    """Without reading results, XLA:CPU aborted in a collective's rendezvous
    ("Expected 8 threads to join") within a few hundred queued steps; the
    trainer keeps one step in flight on CPU."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", ASYNC_STEPS, str(root)], capture_output=True,
                          text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "finished" in proc.stdout


def test_any_batch_pytree_trains_the_same():
    """numpy, a jax.Array on one device, another sharding, or nested lists: one step."""
    params = gpt.init_params(TINY, jax.random.key(0))
    rows = np.asarray(tiny_batches().batch_at(0))  # (24, 17) int32
    mesh = mesh_of(2, 4)
    trainer = zp.make_trainer(gpt_loss(), optimizer(), params, mesh=mesh,
                              config=zp.ZeroConfig(**FP32), per_layer=True, stacked=("blocks",))
    replicated = jax.device_put(rows, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    losses = []
    for batch in (rows, jnp.asarray(rows), jax.device_put(rows, jax.devices()[3]), replicated,
                  rows.tolist()):
        state = trainer.init(params)
        _, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert len(set(losses)) == 1, losses
    placed = trainer.shard_batch(rows)
    assert trainer.shard_batch(placed) is placed  # no copy when already placed


def test_bad_batches_name_the_leaf():
    params = gpt.init_params(TINY, jax.random.key(0))
    loss = lambda p, b: gpt_loss()(p, b["tokens"])  # noqa: E731
    trainer = zp.make_trainer(loss, optimizer(), params, mesh=mesh_of(2, 4),
                              per_layer=True, stacked=("blocks",))
    rows = np.zeros((16, 17), np.int32)
    cases = [
        ({"tokens": rows, "weight": np.float32(1.0)}, r"batch\['weight'\] is a scalar"),
        ({"tokens": rows, "mask": np.ones((8, 17))}, r"share their leading .*batch\['mask'\]: 8"),
        ({"tokens": rows, "text": np.array(["a"] * 16)}, r"batch\['text'\] has dtype <U1"),
        ({"tokens": [[1, 2], [3]]}, r"batch\['tokens'\] is not a rectangular array"),
        ({"tokens": rows[:12]}, r"batch size 12 must be divisible by .* 8: 8 or 16 rows would do"),
        ({"tokens": rows[:0]}, r"the batch has 0 rows; a step takes a multiple of .* = 8 rows"),
        ({}, "the batch has no arrays"),
    ]
    for batch, match in cases:
        with pytest.raises(ValueError, match=match):
            trainer.shard_batch(batch)


def _mlp():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 16)).astype(np.float32) * 0.3,
              "w2": rng.normal(size=(16, 1)).astype(np.float32) * 0.3}
    x = rng.normal(size=(16, 16)).astype(np.float32)
    batch = {"x": x, "y": x.sum(axis=1, keepdims=True) * 0.1}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    return params, batch, loss


def test_make_trainer_warns_of_a_feature_the_mesh_leaves_idle():
    import warnings

    from zeropp_jax.step.geometry import IdleOnMeshWarning

    params, _, loss = _mlp()

    def warned(shape, config):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(*shape), config=config)
        return [str(w.message) for w in caught if w.category is IdleOnMeshWarning]

    (one_node,) = warned((1, 8), zp.ZeroConfig(qgz="1bit"))
    assert one_node.startswith("qgZ (1bit) compresses only what crosses nodes, and this mesh has one node")
    (one_device,) = warned((8, 1), zp.ZeroConfig(hpz=True))
    assert "one device per node: it is the whole model on every device" in one_device
    (hpz_one_node,) = warned((1, 8), zp.ZeroConfig(hpz=True))
    assert "only adds a copy of the master shards" in hpz_one_node
    assert warned((2, 4), zp.ZeroConfig(qgz="1bit", hpz=True)) == []
    assert warned((1, 8), zp.ZeroConfig()) == []


def test_compress_true_needs_active_qgz():
    """``step(compress=True)`` / ``lower(compress=True)`` where qgZ has nothing
    to compress (one node, or qgz off) is an error, not a silent variant."""
    params, batch, loss = _mlp()
    cases = [((1, 8), zp.ZeroConfig(qgz="1bit")), ((2, 4), zp.ZeroConfig(hpz=True)),
             ((2, 4), zp.ZeroConfig())]
    for shape, config in cases:
        trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(*shape),
                                  config=config)
        state = trainer.init(params)
        with pytest.raises(ValueError, match=r"compress=True .* qgZ is not active"):
            trainer.step(state, batch, compress=True)
        with pytest.raises(ValueError, match=r"compress=True .* qgZ is not active"):
            trainer.lower(trainer.abstract_state(params), trainer.shard_batch(batch),
                          compress=True)
        state, metrics = trainer.step(state, batch, compress=False)
        assert int(metrics["compressed"]) == 0
    # where qgZ is active, compress=True forces the compressed variant (also in the warm-up)
    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig(qgz="1bit", qgz_warmup_steps=5))
    _, metrics = trainer.step(trainer.init(params), batch, compress=True)
    assert int(metrics["compressed"]) == 1


def test_compiling_from_shapes_reuses_the_step_that_ran():
    """The communication report's compile (``compile_from_shapes``, as
    ``zeropp-train``'s closing summary calls it) of a variant the run already
    stepped traces nothing anew: the abstract state carries the shardings a
    real state has, scalars' included, so JAX's caches serve the step."""
    params, batch, loss = _mlp()
    traces = []

    def counted(p, b):
        traces.append(1)
        return loss(p, b)

    trainer = zp.make_trainer(counted, optax.adam(0.1), params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig(qgz="1bit", qgz_warmup_steps=1))
    state = trainer.init(params)
    for _ in range(2):  # one full-precision step, one compressed
        state, _ = trainer.step(state, batch)
    ran = len(traces)
    shapes = jax.eval_shape(lambda: params)
    batch_shapes = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype), batch)
    for compress in (True, False):
        trainer.compile_from_shapes(shapes, batch_shapes, compress=compress)
    assert ran > 0 and len(traces) == ran
    # A variant the run did not step is traced here, once.
    trainer = zp.make_trainer(counted, optax.adam(0.1), params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig(qgz="1bit", qgz_warmup_steps=1))
    trainer.compile_from_shapes(shapes, batch_shapes, compress=True)
    assert len(traces) > ran


def test_init_checks_the_structure_of_stacked_units():
    layers = 3
    params = {"blocks": {"a": np.ones((layers, 8, 8), np.float32),
                         "b": np.ones((layers, 8), np.float32)},
              "head": np.ones((8, 1), np.float32)}

    def loss(p, b):
        def f(h, lp):
            q = zp.gather(lp)
            return jnp.tanh(h @ q["a"] + q["b"]), None
        h, _ = zp.scan_layers(f, b["x"], p["blocks"])
        return jnp.mean((h @ zp.gather(p["head"]) - b["y"]) ** 2)

    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(2, 4),
                              per_layer=True, stacked=("blocks",))
    renamed = dict(params, blocks={"a": params["blocks"]["a"], "c": params["blocks"]["b"]})
    with pytest.raises(ValueError, match=r"unit 'blocks' differ from the ones make_trainer was "
                       r"given: extra \['c'\]; missing \['b'\]"):
        trainer.init(renamed)
    with pytest.raises(ValueError, match=r"parameter blocks\['a'\] has shape \(2, 8, 8\), "
                       r"expected \(3, 8, 8\)"):
        trainer.init(dict(params, blocks={"a": params["blocks"]["a"][:2],
                                          "b": params["blocks"]["b"]}))


def test_a_state_given_to_step_twice_is_refused():
    params = {"w": np.ones((4, 8), np.float32)}
    trainer = zp.make_trainer(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), params,
                              mesh=mesh_of(2, 4))
    batch = {"x": np.ones((16, 4), np.float32)}
    state = trainer.init(params)
    new_state, _ = trainer.step(state, batch)
    with pytest.raises(ValueError, match="given to an earlier trainer.step, which consumed it"):
        trainer.step(state, batch)
    trainer.step(new_state, batch)


def test_a_flax_model_given_unit_handles_is_told_to_gather_or_wrap():
    """per_layer=True hands the loss one Unit per layer; a Flax model applied
    to them as parameters fails naming the handle and the ways out."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))

    net = Net()
    x = np.ones((16, 4), np.float32)
    params = net.init(jax.random.key(0), x)["params"]

    def loss(p, b):
        return jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(2, 4), per_layer=True)
    state = trainer.init(params)
    with pytest.raises(TypeError, match=r"used the zeropp_jax.Unit handle of unit 'Dense_\d' as "
                       r"parameters.*zp.gather\(unit\).*wrap=\(BlockClass,\).*per_layer=False"):
        trainer.step(state, {"x": x, "y": np.zeros((16, 1), np.float32)})
    for misuse in (lambda u: "kernel" in u, lambda u: u["kernel"], lambda u: jnp.asarray(u),
                   lambda u: np.asarray(u), lambda u: np.array(u, copy=True), lambda u: list(u)):
        with pytest.raises(TypeError, match="used the zeropp_jax.Unit handle"):
            misuse(zp.Unit(None, None, _NamedLayout(), None))


class _NamedLayout:
    name, stack = "w", None


def test_mesh_sizes_that_do_not_divide_the_devices_name_the_divisors():
    with pytest.raises(ValueError, match=r"8 devices \(cpu\) do not split into nodes=3: nodes "
                                         r"must divide 8, one of \[1, 2, 4, 8\]"):
        zp.make_mesh(nodes=3)
    with pytest.raises(ValueError, match=r"do not split into local=3: local must divide 8"):
        zp.make_mesh(local=3)
    with pytest.raises(ValueError, match="nodes must be a positive integer or None, got 0"):
        zp.make_mesh(nodes=0)
    assert zp.make_mesh(nodes=4).devices.shape == (4, 2)
    assert zp.make_mesh(local=2).devices.shape == (4, 2)
    with pytest.raises(ValueError, match="make_mesh got no devices"):
        zp.make_mesh(devices=[])


def _freeze_embedding(params):
    return jax.tree_util.tree_map_with_path(
        lambda k, _: "freeze" if "embed" in jax.tree_util.keystr(k) else "train", params)


@pytest.mark.parametrize("optimizer, match", [
    # accumulates 10 micro-steps: moves first on the 10th stand-in step
    (optax.MultiSteps(optax.multi_transform(
        {"train": optax.sgd(0.1), "freeze": optax.set_to_zero()}, _freeze_embedding), 10),
     r"treats parameter leaves differently.*\['embed'\]"),
    (optax.contrib.muon(1e-3), r"treats parameter leaves differently.*muon"),
    (optax.sgd(optax.join_schedules([optax.constant_schedule(0.0),
                                     optax.constant_schedule(0.1)], [2000])),
     r"moved no leaf in 1024 stand-in steps.*check_optimizer=False"),
    (optax.MultiSteps(optax.adam(1e-3), 10), None),
], ids=["multisteps-10-freeze", "muon", "lr-0-for-2000-steps", "multisteps-10-adam"])
def test_the_optimizer_check_waits_for_a_move_and_says_when_none_comes(optimizer, match):
    """An optimizer that holds still for its first steps (accumulation, a
    learning rate at 0) is checked on the first stand-in step that moves;
    one that moves nothing in all of them passes with a warning that it was
    not checked; a rule by rank (muon's for matrices) is named in the
    refusal."""
    import warnings

    from zeropp_jax.step.rules import check_leaf_uniform

    params = {"embed": jnp.zeros((8, 4)), "dense": {"kernel": jnp.zeros((4, 4)),
                                                    "bias": jnp.zeros((4,))}}
    if match is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_leaf_uniform(optimizer, params)
    elif "moved no leaf" in match:
        with pytest.warns(UserWarning, match=match):
            check_leaf_uniform(optimizer, params)
    else:
        with pytest.raises(ValueError, match=match):
            check_leaf_uniform(optimizer, params)


@pytest.mark.parametrize("optimizer, match", [
    (optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
     r"moves the model's leaves alike.*flat units.*x.ndim >= 2"),
    (optax.multi_transform({"mat": optax.sgd(1.0), "vec": optax.adam(1e-2)},
                           lambda p: jax.tree.map(lambda x: "mat" if x.ndim >= 2 else "vec", p)),
     r"moves the model's leaves alike"),
    (optax.contrib.muon(1e-2), r"moves the model's leaves alike.*muon"),
    (optax.adamw(1e-2, mask={"a": {"w": True}, "b": {"w": True}}),
     r"(?s)fails on the trainer.s units.*pytree of the parameters"),
    # per-leaf norms: per unit the same where each unit is one leaf (per_layer here)
    (optax.novograd(1e-2), {False: r"moves the model's leaves alike.*per-leaf norms",
                            True: None}),
    # centralize moves no (1, 1) stand-in leaf, but the flat units (rank 1) it leaves alone
    (optax.chain(optax.centralize(), optax.sgd(0.1)), r"moves none of the model.s leaves.*centralize"),
    (optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: True, p)), None),
], ids=["adamw-mask-by-rank", "labels-by-rank", "muon", "pytree-mask", "novograd", "centralize",
        "uniform-callable-mask"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_a_choice_by_rank_alike_for_every_leaf_is_refused_where_the_units_differ(
        optimizer, match, per_layer):
    """On a model of matrices only, a rule by rank gives every leaf the same
    answer, but the trainer's flat units another (they are rank 1): such an
    optimizer trained silently as another (weight decay off, muon's Adam
    fallback); a mask given as a pytree of the parameters failed only at
    init, inside optax. Both are refused at make_trainer now."""
    params = {"a": {"w": jnp.ones((4, 4))}, "b": {"w": jnp.ones((4, 8))}}
    match = match[per_layer] if isinstance(match, dict) else match

    def loss(p, batch):
        p = {k: zp.gather(v) for k, v in p.items()} if per_layer else p
        return jnp.sum((batch @ p["a"]["w"] @ p["b"]["w"]) ** 2)

    build = functools.partial(zp.make_trainer, loss, optimizer, params,
                              mesh=mesh_of(2, 4), per_layer=per_layer)
    if match is None:
        build().init(params)
    else:
        with pytest.raises(ValueError, match=match):
            build()


def test_labels_constant_within_each_unit_train_as_on_one_device():
    """Freezing a whole unit (per_layer=True: a top-level key) is exact; a label
    that differs between leaves of one unit is refused, naming the unit."""
    params = gpt.init_params(TINY, jax.random.key(0))
    batches = tiny_batches(batch_size=16)

    def opt(labels):
        return optax.multi_transform(
            {"train": optax.adam(3e-3), "frozen": optax.set_to_zero()}, labels)

    frozen_embed = opt(lambda p: {k: "frozen" if k == "embed" else "train" for k in p})
    trainer = zp.make_trainer(gpt_loss(), frozen_embed, params, mesh=zp.make_mesh(*MESH),
                              per_layer=True, stacked=("blocks",))
    ref_losses, ref = reference_run(gpt_loss(per_layer=False), params, frozen_embed, batches, 3)
    losses, state = zero_run(trainer, params, batches, 3)
    trained = trainer.gather_params(state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_trees_close(trained, ref, rtol=1e-4, atol=1e-5)  # Adam's eps: elements near 0
    jax.tree.map(np.testing.assert_array_equal, trained["embed"], params["embed"])
    by_leaf = opt(lambda p: {k: jax.tree.map(lambda _: "frozen" if k == "ln_f" else "train", v)
                             if k != "embed" else {"tokens": "frozen", "positions": "train"}
                             for k, v in p.items()})
    with pytest.raises(ValueError, match="both in unit 'embed'"):
        zp.make_trainer(gpt_loss(), by_leaf, params, mesh=zp.make_mesh(*MESH),
                        per_layer=True, stacked=("blocks",))
