"""Shared helpers for the tests: tiny models, reference training, runners."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeropp_jax as zp
from zeropp_jax import data
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.cli._processes import with_device_count
from zeropp_jax.models import gpt

TINY = gpt.GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)


def tiny_batches(cfg=TINY, batch_size=24, seed=0):
    tokens, _ = data.load_tokens(None)
    tokens = tokens % cfg.vocab_size
    return data.TokenBatches(tokens, batch_size=batch_size, seq_len=cfg.seq_len, seed=seed)


def optimizer(config=None):
    """Clipped Adam (lr 3e-3): optax's, or 1-bit Adam's for ``qgz_target="momentum"``."""
    if config is not None and config.qgz_target == "momentum":
        return zp.onebit_adam(3e-3, clip_norm=1.0)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))


def gpt_loss(cfg=TINY, per_layer=True):
    if per_layer:
        return functools.partial(gpt.loss_fn, cfg=cfg, gather=zp.gather, layer=zp.layer)
    return functools.partial(gpt.loss_fn, cfg=cfg)


def reference_run(loss_fn, params, opt, batches, steps, grad_norms=None):
    """Plain single-device training with the same optax optimizer.

    ``grad_norms``, a list, gets each step's gradient norm (before the
    optimizer, as a trainer's ``metrics["grad_norm"]``) appended.
    """

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss, optax.tree.norm(g)

    state = opt.init(params)
    losses = []
    for i in range(steps):
        params, state, loss, norm = step(
            params, state, jax.tree.map(jnp.asarray, batches.batch_at(i)))
        losses.append(float(loss))
        if grad_norms is not None:
            grad_norms.append(float(norm))
    return np.array(losses), jax.device_get(params)


def zero_run(trainer, params, batches, steps, grad_norms=None):
    """Losses of ``steps`` steps from ``params``, and the final state.

    ``grad_norms``, a list, gets each step's ``metrics["grad_norm"]`` appended.
    """
    state = trainer.init(params)
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, batches.batch_at(i))
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    return np.array(losses), state


def stacked_mlp_params(layers, width=128):
    """A shared ``scale`` and ``blocks`` of ``layers`` stacked ``(width, width)`` layers."""
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "scale": 1.0 + 0.1 * jax.random.normal(k1, (width,)),
        "blocks": {"w": jax.random.normal(k2, (layers, width, width)) / np.sqrt(width),
                   "b": jnp.zeros((layers, width))},
    }


def stacked_mlp_loss(params, x):
    """``zp.scan_layers`` over the blocks, which close over a gathered ``scale``; with ``ys``."""
    scale = zp.gather(params["scale"])  # a closure constant of every layer, with a gradient

    def block(h, stored):
        p = zp.gather(stored)
        h = jnp.tanh(h @ p["w"] + p["b"][None, :]) * scale[None, :]
        return h, jnp.mean(h)

    h, ys = zp.scan_layers(block, x, params["blocks"])
    return jnp.mean(jnp.square(h)) + jnp.sum(ys)


def train_and_gather(trainer, params, batches):
    """Losses of ``trainer`` over ``batches`` (a list) from ``params``, and the gathered result."""
    state = trainer.init(params)
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, b)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(trainer.gather_params(state))


def tiny_gpt_run(config, steps=2):
    """Losses and gathered parameters of the tiny GPT (stacked blocks) after ``steps`` steps."""
    params = gpt.init_params(TINY, jax.random.key(0))
    trainer = zp.make_trainer(
        gpt_loss(), optimizer(config), params, mesh=mesh_of(2, 4), config=config,
        per_layer=True, stacked=("blocks",),
    )
    losses, state = zero_run(trainer, params, tiny_batches(), steps)
    return losses, jax.device_get(trainer.gather_params(state))


def continue_run(trainer, state, start, stop):
    """Steps ``start .. stop - 1`` of the tiny batches from ``state``; ``(losses, state)``."""
    batches = tiny_batches()
    losses = []
    for i in range(start, stop):
        state, metrics = trainer.step(state, batches.batch_at(i))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def mesh_of(nodes, local):
    return zp.make_mesh(nodes, local, devices=jax.devices()[: nodes * local])


def assert_trees_close(a, b, rtol, atol=0.0):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        ),
        a,
        b,
    )


# Console scripts as `python -m` arguments, and the tiny GPT's CLI flags.
TRAIN = ("-m", "zeropp_jax.cli.train")
COMM = ("-m", "zeropp_jax.cli.comm")
TINY_ARGS = (
    "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
    "--batch-size", "8", "--dtype", "fp32",
)


# Console scripts that run as one JAX process: their runs share compiled programs.
SINGLE_PROCESS_SCRIPTS = {
    "zeropp_jax.cli.train", "zeropp_jax.cli.comm", "zeropp_jax.cli.export",
    "zeropp_jax.cli.simulate",
}


@functools.cache
def compile_cache_dir() -> str:
    """A JAX persistent compilation cache private to this test process.

    Each pytest-xdist worker has its own, and the scripts it starts use it one
    at a time, so no two processes write one entry at once.
    """
    path = tempfile.mkdtemp(prefix="zeropp-test-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_CODEGEN_LEVEL_FLAG = re.compile(r"--xla_backend_optimization_level=\S*")


def child_env(devices=None, default_codegen=False):
    """This process's environment for a JAX script it starts, on the CPU.

    ``XLA_FLAGS`` keeps this process's other flags (conftest's code
    generation level, unless ``default_codegen``) but not its 8 devices:
    ``devices`` if given, else the script chooses (the CLIs from ``--mesh``).
    """
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if default_codegen:
        flags = _CODEGEN_LEVEL_FLAG.sub("", flags)
    env["XLA_FLAGS"] = with_device_count(flags, devices)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_cli(*args, env_devices=None, default_codegen=False, timeout=600):
    """Runs a console script module in a fresh process; returns CompletedProcess.

    A single-process script (``-m`` one of ``SINGLE_PROCESS_SCRIPTS``) reads
    and fills :func:`compile_cache_dir`: a program an earlier script compiled
    loads instead of compiling again, the same executable with the same
    results. Source locations and named scopes are part of the cache key, so
    a loaded program's HLO carries its own op names (the comm reports
    classify collectives by them). Not for multi-process jobs: with a cache,
    JAX hands one process's compiled binary to its peers instead of each
    compiling its own.
    """
    env = child_env(env_devices, default_codegen)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if len(args) > 1 and args[0] == "-m" and args[1] in SINGLE_PROCESS_SCRIPTS:
        env["JAX_COMPILATION_CACHE_DIR"] = compile_cache_dir()
        env["JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY"] = "1"
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


MESH = (2, 4)


def compile_step(loss, shapes, *, config=None, per_layer=True, stacked=(), batch=None,
                 compress=None):
    config = config or zp.ZeroConfig(compute_dtype="float32")
    opt = zp.onebit_adam(1e-3) if config.qgz_target == "momentum" else optax.adam(1e-3)
    trainer = zp.make_trainer(
        loss, opt, shapes, mesh=mesh_of(*MESH), config=config,
        per_layer=per_layer, stacked=stacked,
    )
    compiled = trainer.compile_from_shapes(shapes, batch, compress=compress)
    return trainer, compiled, comm_report(compiled, mesh_shape=MESH)


def executions(report, kind):
    return sum(c.count for c in report.collectives if c.kind == kind)


def gpt_step(n_layers, preset="zero3", per_layer=True, compress=None, **overrides):
    cfg = gpt.GPTConfig(n_layers=n_layers, d_model=128, n_heads=4, seq_len=16)
    shapes = jax.eval_shape(lambda k: gpt.init_params(cfg, k), jax.random.key(0))
    if per_layer:
        loss = functools.partial(gpt.loss_fn, cfg=cfg, gather=zp.gather, layer=zp.layer)
    else:
        loss = functools.partial(gpt.loss_fn, cfg=cfg)
    batch = jax.ShapeDtypeStruct((8 * overrides.get("grad_accum", 1), 17), jnp.int32)
    config = zp.ZeroConfig.from_preset(preset, **{"compute_dtype": "float32", **overrides})
    return compile_step(
        loss, shapes, config=config, per_layer=per_layer,
        stacked=("blocks",) if per_layer else (), batch=batch, compress=compress,
    )


def hlo_digest(compiled) -> str:
    """A digest of the optimized HLO's program: its header and computations.

    Leaves out the debug information, which depends on the caller's source
    lines and JAX's traceback settings: op metadata and the tables of files,
    functions and stack frames between the header and the first computation.
    """
    lines = compiled.as_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    text = "\n".join([lines[0], *lines[first:]])
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return hashlib.sha256(text.encode()).hexdigest()
