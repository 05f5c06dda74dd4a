"""Where 1-bit error feedback works with Adam: on the momentum, not the gradient.

A single-device simulation of the two-node cross-node exchange (each node's
gradient from its half of the global batch), with the example GPT, the
default data and `zeropp-train`'s schedule (warm-up + cosine, peak lr 3e-3,
clipping at 1, Adam b1=0.9, b2=0.999), 400 steps. Variants:

* ``adam``: full precision throughout (the zero3 reference).
* ``frozen``: full precision, Adam's second moment frozen after the warm-up
  (what every variant below does; isolates the cost of freezing).
* ``grad-ef``: the library's qgZ as specified: each node's gradient + carry
  -> 1-bit (block ``--block``, scale mean|x|), averaged, fed to Adam whose
  second moment keeps updating. (benchmarks/RESULTS.md: +8% on the trainer.)
* ``momentum-ef``: 1-bit Adam (Tang et al., 2021): after ``--warmup`` full-
  precision steps the second moment is frozen; each node forms its local
  momentum ``b1 * m + (1 - b1) * g_node`` around the shared ``m``, compresses
  it + its carry to 1 bit, the average is compressed once more with a
  receiver-side carry (the second hop, so every node holds the new ``m``),
  and ``m`` steps the parameters through the frozen ``v``.
* ``momentum-noef``: the same without either carry.

The 1-bit code is the library's own
(:func:`pallas_kernels.compress_1bit_ef_reference`). Global-norm clipping
(``--clip``): ``global`` uses the true norm of the averaged gradient (known
after a full-precision exchange, not before a compressed one); ``node``
clips each node's gradient by its own norm (known before the exchange,
noisier: half the batch); ``none`` does not clip compressed steps. Warm-up
steps always clip by the global norm.

Prints a markdown table and one JSON object on the last line; progress goes
to stderr. About 2.5 minutes per variant on 2 CPU cores.

    python benchmarks/onebit_adam_probe.py
    python benchmarks/onebit_adam_probe.py --variants frozen momentum-ef --warmup 100 150
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from tqdm import tqdm

from pallas_kernels import compress_1bit_ef_reference
from zeropp_jax import data
from zeropp_jax.models import gpt
from zeropp_jax.cli.flags import non_negative_int, positive_int  # noqa: E402

VARIANTS = ("adam", "frozen", "grad-ef", "momentum-ef", "momentum-noef")
NODES = 2  # the simulated 2x4 mesh's node count
PEAK_LR = 3e-3  # zeropp-train's default
B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adam's defaults
CLIP = 1.0  # zeropp-train's global-norm clipping
BATCH, SEQ = 16, 128  # zeropp-train's defaults


def onebit(x, carry, *, block, feedback):
    """1-bit code of ``x + carry`` per block; returns (decoded, new carry)."""
    x = jnp.asarray(x)
    carry = carry if feedback else jnp.zeros_like(carry)
    _, new = compress_1bit_ef_reference(x, carry, block=block)
    sent = x + carry - new
    return sent, (new if feedback else jnp.zeros_like(new))


CLIPS = ("global", "node", "none")


def run(
    variant: str, *, steps: int, warmup: int, block: int, seed: int, clip_mode: str = "global"
) -> list[float]:
    """Trains ``steps`` steps; returns the per-step losses."""
    tokens, vocab = data.load_tokens(None)
    batches = data.TokenBatches(tokens, batch_size=BATCH, seq_len=SEQ, seed=seed)
    cfg = gpt.GPTConfig(vocab_size=vocab, seq_len=SEQ)
    flat0, unravel = ravel_pytree(gpt.init_params(cfg, jax.random.key(seed)))
    n = flat0.size
    npad = -(-n // block) * block
    lr = optax.warmup_cosine_decay_schedule(
        0.0, PEAK_LR, warmup_steps=steps // 10, decay_steps=steps, end_value=PEAK_LR / 10
    )
    feedback = variant != "momentum-noef"
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, npad - n)])

    @functools.partial(jax.jit, static_argnames=("compress",))
    def step(f, m, v, t, carry, server_carry, batch, compress):
        nb = batch.reshape(NODES, -1, batch.shape[-1])
        loss_of = lambda f, b: gpt.loss_fn(unravel(f), b, cfg)
        losses, g = jax.vmap(jax.value_and_grad(loss_of), in_axes=(None, 0))(f, nb)
        g_mean = g.mean(0)
        clip = jnp.minimum(1.0, CLIP / jnp.linalg.norm(g_mean))
        before_exchange = compress and variant != "adam"  # the norm of g_mean is not known yet
        if before_exchange and clip_mode == "node":
            clip = jnp.minimum(1.0, CLIP / jnp.linalg.norm(g, axis=-1, keepdims=True))  # (nodes, 1)
        elif before_exchange and clip_mode == "none":
            clip = jnp.ones((NODES, 1))
        clip_mean = clip * g_mean if jnp.ndim(clip) == 0 else jnp.mean(clip * g, axis=0)
        t = t + 1
        freeze = compress and variant in ("frozen", "momentum-ef", "momentum-noef")  # v stops
        if not compress or variant in ("adam", "frozen"):
            m = B1 * m + (1 - B1) * clip_mean
            if not freeze:
                v = B2 * v + (1 - B2) * jnp.square(clip_mean)
        elif variant == "grad-ef":
            sent, carry = onebit(pad(clip * g), carry, block=block, feedback=True)
            d = sent.mean(0)[:n]
            m = B1 * m + (1 - B1) * d
            v = B2 * v + (1 - B2) * jnp.square(d)
        else:  # momentum-ef / momentum-noef
            local_m = B1 * m[None] + (1 - B1) * clip * g  # (nodes, n)
            sent, carry = onebit(pad(local_m), carry, block=block, feedback=feedback)
            avg, server_carry = onebit(sent.mean(0), server_carry, block=block, feedback=feedback)
            m = avg[:n]
        tf = t.astype(jnp.float32)
        tv = jnp.minimum(tf, warmup) if freeze else tf
        update = (m / (1 - B1**tf)) / (jnp.sqrt(v / (1 - B2**tv)) + EPS)
        return f - lr(t - 1) * update, m, v, t, carry, server_carry, losses.mean()

    f = flat0
    m, v, t = jnp.zeros_like(f), jnp.zeros_like(f), jnp.zeros((), jnp.int32)
    carry, server_carry = jnp.zeros((NODES, npad)), jnp.zeros((npad,))
    losses = []
    for k in tqdm(range(steps), desc=variant, leave=False, file=sys.stderr):
        batch = jnp.asarray(batches.batch_at(k))
        f, m, v, t, carry, server_carry, loss = step(
            f, m, v, t, carry, server_carry, batch, compress=k >= warmup
        )
        losses.append(loss)
    return [float(x) for x in jax.device_get(losses)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--warmup", type=non_negative_int, nargs="+", default=[100],
                   help="full-precision steps before compressing / freezing v (one run each)")
    p.add_argument("--steps", type=positive_int, default=400)
    p.add_argument("--block", type=positive_int, default=32, help="elements per 1-bit scale")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--clip", choices=CLIPS, default="global",
                   help="clipping of compressed steps (see the module docstring)")
    args = p.parse_args(argv)
    if any(w < 1 or w >= args.steps for w in args.warmup):
        p.error(f"--warmup must be in [1, --steps); got {args.warmup}")

    tail = max(1, args.steps // 10)
    rows = []
    ref = None
    for warmup in args.warmup:
        for variant in args.variants:
            if variant == "adam" and ref is not None:
                continue  # no warm-up involved: one run serves every --warmup
            losses = run(variant, steps=args.steps, warmup=warmup, block=args.block, seed=args.seed,
                         clip_mode=args.clip)
            loss = float(np.mean(losses[-tail:]))
            if not np.isfinite(loss):
                print(f"{variant} (warm-up {warmup}) diverged", file=sys.stderr)
            if variant == "adam":
                ref = loss
            rows.append(dict(variant=variant, warmup=None if variant == "adam" else warmup, loss=loss))
            print(f"{variant:<14} warm-up {warmup:>4}: {loss:.4f}", file=sys.stderr, flush=True)
    for r in rows:
        r["vs_adam"] = None if ref is None else r["loss"] / ref - 1

    print(f"\n{args.steps} steps, block {args.block}, seed {args.seed}, clipping {args.clip}: "
          f"mean loss over the last {tail} steps\n")
    print("| variant | warm-up | loss | vs adam |\n|---|---:|---:|---:|")
    for r in rows:
        gap = "-" if r["vs_adam"] is None else f"{100 * r['vs_adam']:+.2f}%"
        print(f"| {r['variant']} | {r['warmup'] or '-'} | {r['loss']:.4f} | {gap} |")
    from zeropp_jax import provenance

    print(json.dumps(dict(steps=args.steps, block=args.block, seed=args.seed, clip=args.clip,
                          rows=rows, provenance=provenance.record())))


if __name__ == "__main__":
    main()
