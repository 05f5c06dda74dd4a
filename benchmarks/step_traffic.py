"""Estimated memory traffic of one training step: plain JAX vs the trainer, from the HLO.

On one GPU the trainer's step moves no data between devices, so what it
costs over plain ``jax.jit`` with per-layer ``jax.checkpoint`` is the extra
bytes its kernels read and write (issue 18: ``zero3`` within 2% of plain
remat). This script compiles the variants of ``gpu_train_probe.py`` (plain,
plain_remat, zero3, qwz, qwz_pallas, qwz_xla) from shapes alone (nothing is
allocated) on the current backend, or reads the optimized HLO a GPU run
saved (``gpu_train_probe.py --hlo-dir``), and estimates each one's bytes
with :func:`zeropp_jax.analysis.traffic.memory_traffic` (an estimate from
the HLO, not a measurement: see that module).

Per variant: bytes per step, per parameter, against ``plain_remat``, and the
instructions that move the most. Compiled on the CPU the figures describe
XLA:CPU's fusions (which, for one, widens bfloat16 matrix products to
float32); only HLO saved on a GPU describes the GPU's.

Prints one ``JSON`` line and a table last.

Usage::

  python benchmarks/step_traffic.py                                # CPU, ~20 s
  python benchmarks/step_traffic.py --layers 24 --d-model 2048 --heads 16 --seq 1024 --batch 8
  python benchmarks/step_traffic.py --hlo-dir hlo   # HLO saved on a GPU (gpu_check.sh: tar xzf hlo.tgz)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import gpu_train_probe as probe
from zeropp_jax.cli.flags import positive_int  # noqa: E402

DEFAULT_VARIANTS = ("plain", "plain_remat", "zero3", "qwz_xla")


def compiled_hlo(variant: str, cfg, batch_rows: int, devices=None) -> str:
    """The variant's optimized HLO, compiled from shapes for ``devices`` (default:
    the default backend's; ``gpu_aot.target_devices()`` for a GPU without one)."""
    import jax
    import jax.numpy as jnp
    import optax

    from zeropp_jax.models import gpt

    shapes = jax.eval_shape(lambda k: gpt.init_params(cfg, k), jax.random.key(0))
    built = probe.build(variant, cfg, optax.adam(1e-4), shapes, devices=devices)
    batch = jax.ShapeDtypeStruct((batch_rows, cfg.seq_len + 1), jnp.int32)
    return built.lower(*built.abstract(shapes, batch)).compile().as_text()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    probe.add_model_args(parser, variants=",".join(DEFAULT_VARIANTS), layers=4, d_model=512,
                         heads=4, seq=256)
    parser.add_argument("--hlo-dir", default=None,
                        help="read <variant>.hlo from here (gpu_train_probe.py --hlo-dir) "
                             "instead of compiling; the shape flags must match that run's")
    parser.add_argument("--target", default=None, choices=["h200"],
                        help="compile for this GPU from any machine (gpu_aot.py: needs JAX's "
                             "CUDA plugin, no GPU), with the attention a GPU run picks")
    parser.add_argument("--top", type=positive_int, default=8, help="instructions listed per variant")
    parser.add_argument("--json-out", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    variants = probe.parse_variants(parser, args.variants)
    probe.check_shape(parser, args)

    import jax

    from zeropp_jax.analysis.traffic import memory_traffic, traffic_summary
    from zeropp_jax.models import gpt

    if args.hlo_dir and args.target:
        parser.error("--hlo-dir reads a GPU run's HLO; --target compiles it: choose one")
    cfg = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers,
                        d_model=args.d_model, n_heads=args.heads)
    devices = None
    if args.target:
        import gpu_aot

        devices = gpu_aot.target_devices(args.target)
        cfg = gpu_aot.gpu_model(cfg)  # what "auto" picks on the GPU compiled for
    params = gpt.count_params(cfg)
    rows = []
    for variant in variants:
        if args.hlo_dir:
            path = os.path.join(args.hlo_dir, f"{variant}.hlo")
            if not os.path.exists(path):
                parser.error(f"{path} does not exist (run gpu_train_probe.py --hlo-dir first)")
            with open(path) as f:
                hlo, source = f.read(), path
        else:
            if variant == "qwz_pallas" and jax.default_backend() != "gpu" and not devices:
                parser.error("qwz_pallas compiles to the Pallas interpreter off a GPU, whose HLO "
                             "says nothing of the kernels' bytes; read a GPU run's with --hlo-dir "
                             "or compile for one with --target")
            print(f"[step_traffic] compiling {variant}", file=sys.stderr, flush=True)
            hlo = compiled_hlo(variant, cfg, args.batch, devices)
            source = f"{args.target} (compiled here)" if devices else jax.default_backend()
        summary = traffic_summary(memory_traffic(hlo), top=args.top)
        rows.append(dict(variant=variant, source=source, bytes=summary["bytes"],
                         bytes_per_param=summary["bytes"] / params,
                         by_opcode=summary["by_opcode"], top=summary["top"]))

    base = next((r for r in rows if r["variant"] == "plain_remat"), None)
    for r in rows:
        r["vs_plain_remat"] = r["bytes"] / base["bytes"] if base else None
    from zeropp_jax import provenance

    result = dict(provenance=provenance.record(), params=params,
                  shape=dict(layers=args.layers, d_model=args.d_model, heads=args.heads,
                             seq=args.seq, vocab=args.vocab, batch=args.batch),
                  variants=rows)
    print("JSON " + json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{params / 1e6:.1f}M params; estimated bytes read + written per step, from the HLO")
    print(f"{'variant':<13}{'GB/step':>9}{'B/param':>9}{'vs plain_remat':>16}  source")
    for r in rows:
        rel = f"{r['vs_plain_remat']:.3f}x" if base else "-"
        print(f"{r['variant']:<13}{r['bytes'] / 1e9:>9.2f}{r['bytes_per_param']:>9.1f}{rel:>16}"
              f"  {r['source']}")
    for r in rows:
        print(f"-- {r['variant']}: largest instructions (B/param, executions, op)")
        for t in r["top"]:
            print(f"   {t['bytes'] / params:6.1f} x{t['count']:<4} {t['name'][:40]:<40} "
                  f"{t['op_name'][-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
