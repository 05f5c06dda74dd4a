"""Compiled temp memory of an unmodified Flax model: plain jit vs the trainer.

For a Hugging Face Flax GPT-2 built from a config (never downloaded; needs
``transformers``, e.g. ``pip install transformers==4.46.3``) at several depths,
compiles and reports, per device (``memory_analysis()``, nothing is run):

* ``plain``: one device, ``jax.jit`` of the loss's value_and_grad plus an
  optax Adam update (the single-device baseline);
* ``zero3_whole``: the trainer on the simulated ``2x4`` mesh with
  ``per_layer=False`` (the whole model gathered once);

and checks the target of issue 16: at 8 layers ``zero3_whole`` is within 1.5x
of ``plain`` + one gathered model (float32), and it grows linearly in depth.
Prints a markdown table, then one JSON object on the last line.

  python benchmarks/model_memory.py [--layers 2,4,8] [--d-model 256]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeropp_jax as zp  # noqa: E402
from zeropp_jax.cli.flags import positive_int  # noqa: E402

MIB = 2**20
TARGET_RATIO = 1.5  # zero3_whole <= 1.5 x (plain + one gathered model)


def gpt2(n_layer: int, d_model: int, seq: int):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=4, vocab_size=256, n_positions=seq)
    model = FlaxGPT2LMHeadModel(cfg, seed=0, _do_init=False)
    ids = jax.ShapeDtypeStruct((16, seq), jnp.int32)

    def run(p, tokens):
        mask = jnp.ones_like(tokens)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return model.module.apply({"params": p}, tokens, mask, positions, deterministic=True)[0]

    def init():
        tokens = jnp.zeros((1, seq), jnp.int32)
        mask, positions = jnp.ones_like(tokens), jnp.arange(seq)[None]
        return model.module.init(jax.random.key(0), tokens, mask, positions)["params"]

    params = jax.eval_shape(init)

    def loss_fn(p, batch):
        logits = run(p, batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch[:, 1:]).mean()

    return loss_fn, params, ids


def measure(n_layer: int, d_model: int, seq: int) -> dict:
    loss_fn, params, batch = gpt2(n_layer, d_model, seq)
    opt = optax.adam(1e-3)

    def plain_step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    opt_shapes = jax.eval_shape(opt.init, params)
    plain = jax.jit(plain_step).lower(params, opt_shapes, batch).compile()
    trainer = zp.make_trainer(loss_fn, opt, params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"))
    whole = trainer.compile_from_shapes(params, batch)
    model_bytes = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {
        "layers": n_layer,
        "model_mib": model_bytes / MIB,
        "plain_temp_mib": plain.memory_analysis().temp_size_in_bytes / MIB,
        "zero3_whole_temp_mib": whole.memory_analysis().temp_size_in_bytes / MIB,
    }


def _layer_counts(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",") if x] or [positive_int("")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=[2, 4, 8], type=_layer_counts,
                        help="comma-separated layer counts (default 2,4,8)")
    parser.add_argument("--d-model", type=positive_int, default=256)
    parser.add_argument("--seq", type=positive_int, default=32)
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("model_memory.py needs transformers (pip install transformers==4.46.3)", file=sys.stderr)
        return 2
    rows = []
    for n in args.layers:
        print(f"compiling {n} layers ...", file=sys.stderr, flush=True)
        rows.append(measure(n, args.d_model, args.seq))
    print("| layers | model MiB | plain temp MiB | zero3 per_layer=False temp MiB | ratio to plain + model |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        r["ratio"] = r["zero3_whole_temp_mib"] / (r["plain_temp_mib"] + r["model_mib"])
        print(f"| {r['layers']} | {r['model_mib']:.1f} | {r['plain_temp_mib']:.1f} | "
              f"{r['zero3_whole_temp_mib']:.1f} | {r['ratio']:.2f} |")
    last = rows[-1]
    ok = last["ratio"] <= TARGET_RATIO
    print(f"{'PASS' if ok else 'FAIL'}: at {last['layers']} layers zero3 (per_layer=False) temp is "
          f"{last['ratio']:.2f}x plain + one model (target <= {TARGET_RATIO})")
    from zeropp_jax import provenance

    print(json.dumps({"rows": rows, "targets": {"whole_model_ratio": {
        "value": last["ratio"], "limit": TARGET_RATIO, "pass": ok}},
        "provenance": provenance.record()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
