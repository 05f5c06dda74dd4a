"""Compile for an H200 on a machine without a GPU: the GPU's HLO and the kernels' PTX.

XLA compiles for a described GPU without one present ("deviceless"
ahead-of-time compilation): ``jax.experimental.topologies`` builds the
devices of a topology from a target description (:data:`H200_TARGET`), and
arrays placed on them lower and compile with XLA:GPU's own pipeline, its
fusion decisions, cuDNN's attention and Triton for the Pallas kernels. What
runs nowhere is the result: nothing is timed, and XLA skips autotuning (it
picks default GEMM tilings), so the HLO says which kernels move which bytes,
not how fast they run.

It needs JAX's CUDA plugin for the installed JAX, in its own environment
(the plugin wants a GPU when it is the default backend; ``JAX_PLATFORMS=cpu``
keeps the CPU the default while the plugin compiles)::

  V=$(python -c 'import jax; print(jax.__version__)')  # the project's JAX
  python -m venv /tmp/aot && . /tmp/aot/bin/activate
  pip install "jax[cuda13]==$V" flax optax nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_aot.py kernels
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_aot.py comm
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/gpu_aot.py overlap --presets zero3,qwz,zeropp
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_traffic.py --target h200 \\
      --layers 24 --d-model 2048 --heads 16 --seq 1024 --batch 8

(the first ``pip`` is a few GB of CUDA libraries, about a minute here).

``kernels`` compiles every Pallas kernel of ``gpu_kernels.py`` at its
default configuration (or ``--config TILE/WARPS[s][+bits]``) and prints, per
kernel, static figures of the code (``gpu_code.py``): from the PTX Triton wrote, instructions
per thread, threads per program, global loads and stores, shared-memory
accesses and barriers (a layout change inside the kernel goes through
shared memory); from ``ptxas`` (on the PATH or pip's ``nvidia-cuda-nvcc``),
registers per thread (they bound how many warps an SM holds); from
``cuobjdump -sass`` (pip's ``nvidia-cuda-cuobjdump``, which runs
``nvidia-cuda-nvdisasm``'s ``nvdisasm``), the machine
instructions. Machine instructions (else PTX statements) per byte the kernel
must move give an **issue bound**: the bandwidth at which the H200's
instruction issue (132 SMs x 4 schedulers x 1.98 GHz, one warp instruction
each per cycle) would be busy with nothing else; a kernel whose bound is
near the copy's bandwidth cannot reach it. It also counts the type
conversions (``I2F``, ``I2FP``, ``F2I``, ``F2F``, ``FRND``) per element: NVIDIA's
throughput table gives 16 conversions per clock per SM against 128 float
adds, so a kernel with several per element may be bound by them before
issue (``KernelConfig.decode="bits"`` decodes codes without them). A static
count is not a measurement: latency, occupancy and memory decide the rest.

``comm`` compiles each preset's step (the example GPT at bf16 on a ``(2, 4)``
mesh) for two hosts of four target GPUs and for this machine's CPU, and
prints the inter-node bytes per node of both: XLA:CPU widens bfloat16
collectives to float32, which every report of this project undoes by
counting full-precision payloads at the run's dtypes
(``zeropp_jax.analysis.headline.report_dtypes``); the GPU's HLO is what a
GPU run sends, as compiled. About 3 minutes on 2 cores.

``overlap`` compiles each preset's step at ``--shape`` for two hosts of four
target GPUs and lists every asynchronous collective with the kernels the
GPU's schedule places while it is in flight (``zeropp_jax.analysis.overlap``):
what can hide it, a schedule, not a timeline.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from zeropp_jax.cli.flags import positive_int  # noqa: E402

# One NVIDIA H200 SXM as XLA:GPU's target description (GpuTargetConfigProto,
# text format). Device limits as XLA reports them for Hopper (sm_90, the same
# die as the H100 SXM: 132 SMs, 50 MiB L2); memory as stop 16's device
# reported it (143771 MiB); bandwidth the H200's published 4.8 TB/s.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""
TARGETS = {"h200": H200_TARGET}
# Thread-instructions the H200 can issue per second: SMs x schedulers x lanes x clock.
H200_ISSUE_PER_S = 132 * 4 * 32 * 1.98e9
# SASS opcodes of type conversions, and the H200's rate for them: the CUDA C++
# Programming Guide's throughput table gives 16 conversions per clock per SM
# (against 128 float32 adds) through compute capability 9.0. Whether I2FP, the
# int-to-float form new since Ampere, issues at that rate is not documented.
CONVERSION_OPCODES = ("I2F", "I2FP", "F2I", "F2F", "FRND")
H200_CONVERSIONS_PER_S = 132 * 16 * 1.98e9


def log(message: str) -> None:
    print(f"[gpu_aot] {message}", file=sys.stderr, flush=True)


def target_devices(target: str = "h200", nodes: int = 1, local: int = 1) -> list:
    """The devices of ``nodes`` hosts with ``local`` GPUs each, to compile for.

    Arrays placed on them (``jax.ShapeDtypeStruct(..., sharding=...)``) lower
    and compile for the target; nothing can run on them.

    Raises:
      RuntimeError: naming what to install, when JAX's CUDA plugin is missing.
    """
    import jax
    from jax.experimental import topologies

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {sorted(TARGETS)}")
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGETS[target], topology=f"1x{nodes}x{local}")
    except Exception as e:  # the plugin is missing or too old: say what to install
        raise RuntimeError(
            f"cannot compile for a GPU here ({type(e).__name__}: {str(e)[:200]}). Install "
            f"JAX's CUDA plugin for this JAX in its own environment: pip install "
            f"'jax[cuda13]=={jax.__version__}', and run with JAX_PLATFORMS=cpu."
        ) from e
    return list(topology.devices)


def gpu_model(cfg):
    """``cfg`` with the attention ``"auto"`` picks on a GPU default backend:
    cuDNN's where it takes the head dimension (for 16-bit compute), else XLA's."""
    import dataclasses

    try:
        return dataclasses.replace(cfg, attention="cudnn")
    except ValueError:  # a head dimension cuDNN does not take: "auto" runs XLA's there
        return dataclasses.replace(cfg, attention="xla")


def replicated(devices) -> object:
    """A sharding that puts a whole array on the first of ``devices``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(devices[:1], ("d",)), PartitionSpec())


# ---------------------------------------------------------------------------
# The kernels of gpu_kernels.py, compiled for the target.
# ---------------------------------------------------------------------------


def kernel_rows(devices, elems: int, only: str = "", config=None) -> list[dict]:
    """One row per Pallas kernel of ``gpu_kernels.cases``: its PTX figures."""
    import jax

    import gpu_kernels
    from gpu_code import compiled_ptx, machine_code, ptx_kernels
    from pallas_kernels import _common
    from pallas_kernels.config import default_config

    sharding = replicated(devices)
    rows = []
    for name, kind, bits, block, make_inputs, pallas, _xla, nbytes in gpu_kernels.cases(elems):
        if only and not any(s in name for s in only.split(",")):
            continue
        kernel = gpu_kernels.KERNEL_NAMES[kind]
        cfg = config or default_config(kernel, bits)
        place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
        args = jax.tree.map(place, jax.eval_shape(make_inputs))
        with tempfile.TemporaryDirectory(prefix="aot_ptx_") as dump:
            ptx = compiled_ptx(jax.jit(pallas(cfg)).lower(*args), dump)
        stats = [s for s in ptx_kernels(ptx) if s.name.startswith(kernel)]
        if len(stats) != 1:
            raise RuntimeError(f"{name}: expected one PTX kernel named {kernel}*, found "
                               f"{[s.name for s in ptx_kernels(ptx)]}")
        s = stats[0]
        code = machine_code(ptx, s.name)
        sass = sum(code.sass.values()) if code.sass else None
        conversions = None if code.sass is None else sum(
            code.sass.get(op, 0) for op in CONVERSION_OPCODES)
        # what tile_elems counts: output elements for dequantize_sum, inputs elsewhere
        tiled = elems // gpu_kernels.K if kind == "dequantize_sum" else elems
        per_program = _common.tile_blocks(tiled // block, block, cfg.tile_elems) * block
        programs = tiled // per_program
        # issue bound from the machine code where cuobjdump read it, else from the PTX
        per_thread = sass if sass is not None else s.instructions
        per_byte = per_thread * s.threads * programs / nbytes
        rows.append(dict(
            name=name, kernel=s.name,
            config=gpu_kernels.config_text(gpu_kernels.config_dict(cfg)), threads=s.threads,
            instructions_per_thread=s.instructions, elements_per_program=per_program,
            instructions_per_element=s.instructions * s.threads / per_program,
            sass_per_thread=sass,
            sass_per_element=None if sass is None else sass * s.threads / per_program,
            conversions_per_element=None if conversions is None
            else conversions * s.threads / per_program,
            conversion_bound_gbs=None if not conversions
            else H200_CONVERSIONS_PER_S * nbytes / (conversions * s.threads * programs) / 1e9,
            instructions_per_byte=per_byte, issue_source="sass" if sass is not None else "ptx",
            issue_bound_gbs=H200_ISSUE_PER_S / per_byte / 1e9,
            global_loads=s.global_loads, global_stores=s.global_stores,
            global_bytes_per_thread=s.global_load_bytes + s.global_store_bytes,
            shared_per_element=s.shared * s.threads / per_program, barriers=s.barriers,
            registers=code.registers, top_sass=dict(list((code.sass or {}).items())[:8]),
            branches=s.branches, top_opcodes=dict(list(s.by_opcode.items())[:8]),
        ))
        log(f"{name}: {s.instructions} instructions x {s.threads} threads per "
            f"{per_program} elements")
    return rows


# ---------------------------------------------------------------------------
# Communication: the presets' steps compiled for two hosts of four H200s.
# ---------------------------------------------------------------------------


def example_trainer(preset: str, cfg, params_shapes, mesh):
    """The example GPT's trainer for ``preset`` at bf16 compute
    (:func:`zeropp_jax.analysis.comm_profile.example_trainer`)."""
    import jax.numpy as jnp

    import zeropp_jax as zp
    from zeropp_jax.analysis.comm_profile import example_trainer as build

    return build(zp.ZeroConfig.from_preset(preset, compute_dtype=jnp.bfloat16), cfg,
                 params_shapes, mesh)


def overlap_rows(presets, cfg, batch_size: int, target: str = "h200") -> list[dict]:
    """Per preset, the compressed (or only) step of ``cfg`` compiled for two
    hosts of four ``target`` GPUs: each asynchronous collective and what the
    GPU's schedule overlaps with it (:func:`zeropp_jax.analysis.overlap.async_overlaps`)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import zeropp_jax as zp
    from zeropp_jax.analysis.overlap import async_overlaps
    from zeropp_jax.models import gpt

    mesh = zp.make_mesh(2, 4, devices=target_devices(target, 2, 4))
    cfg = gpu_model(cfg)
    shapes = jax.eval_shape(lambda k: gpt.init_params(cfg, k), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((batch_size, cfg.seq_len + 1), jnp.int32)
    rows = []
    for preset in presets:
        trainer = example_trainer(preset, cfg, shapes, mesh)
        text = trainer.compile_from_shapes(shapes, batch).as_text()
        rows += [dict(preset=preset, **dataclasses.asdict(o))
                 for o in async_overlaps(text, (2, 4))]
        log(f"{preset}: compiled for 2 x 4 {target}")
    return rows


def comm_rows(presets, target: str = "h200", batch_size: int = 16) -> list[dict]:
    """Per preset and step variant: inter- and intra-node bytes of the example
    GPT's step (bf16 compute, ``(2, 4)`` mesh) compiled for ``target`` (two
    hosts of four) and for this machine's CPU devices (needs 8: run with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), the CPU's both as
    compiled and at the run's dtypes (``headline.report_dtypes``, what every
    figure of this project reports), and the GPU's collectives by kind and dtype.
    """
    import jax
    import jax.numpy as jnp

    import zeropp_jax as zp
    from zeropp_jax.analysis import headline
    from zeropp_jax.analysis.comm_report import comm_report
    from zeropp_jax.models import gpt

    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        raise RuntimeError(f"comm needs 8 CPU devices, found {len(cpus)}: set "
                           "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    meshes = {"cpu": zp.make_mesh(2, 4, devices=cpus[:8]),
              target: zp.make_mesh(2, 4, devices=target_devices(target, 2, 4))}
    models = {"cpu": gpt.GPTConfig(), target: gpu_model(gpt.GPTConfig())}  # same parameters
    shapes = jax.eval_shape(lambda k: gpt.init_params(models["cpu"], k), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((batch_size, models["cpu"].seq_len + 1), jnp.int32)
    rows = []
    for preset in presets:
        found = {}
        for where, mesh in meshes.items():
            trainer = example_trainer(preset, models[where], shapes, mesh)
            for variant, compress in headline.step_variants(trainer).items():
                text = trainer.compile_from_shapes(shapes, batch, compress=compress).as_text()
                found[where, variant] = (
                    comm_report(text, mesh_shape=(2, 4)),
                    comm_report(text, mesh_shape=(2, 4), **headline.report_dtypes(trainer)))
            log(f"{preset}: compiled for cpu and {target}")
        for variant in sorted({v for _, v in found}):
            cpu_raw, cpu_run = found["cpu", variant]
            gpu_raw, _ = found[target, variant]
            kinds = collections.Counter()
            for c in gpu_raw.collectives:
                if c.axis != "none":
                    kinds[f"{c.kind} {c.dtype}"] += c.count
            rows.append(dict(
                preset=preset, variant=variant,
                cpu_inter_as_compiled=cpu_raw.inter_node_bytes,
                cpu_inter_at_run_dtypes=cpu_run.inter_node_bytes,
                gpu_inter_as_compiled=gpu_raw.inter_node_bytes,
                cpu_intra_at_run_dtypes=cpu_run.intra_node_bytes,
                gpu_intra_as_compiled=gpu_raw.intra_node_bytes,
                gpu_collectives=dict(sorted(kinds.items()))))
    return rows


def _shape(text: str) -> tuple[int, ...]:
    """``--shape``: five positive integers, LAYERS,D_MODEL,HEADS,SEQ,BATCH."""
    values = tuple(positive_int(v) for v in text.split(","))
    if len(values) != 5:
        raise argparse.ArgumentTypeError(
            f"--shape is LAYERS,D_MODEL,HEADS,SEQ,BATCH (five integers), got {text!r}")
    return values


def _parse_config(text: str | None):
    if not text:
        return None
    from pallas_kernels.config import KernelConfig

    m = re.fullmatch(r"(\d+)/(\d+)(s?)(\+bits)?", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"--config is TILE/WARPS[s][+bits] (s: split layout, +bits: decode by bits), "
            f"e.g. 1024/1s+bits; got {text!r}")
    return KernelConfig(tile_elems=int(m.group(1)), num_warps=int(m.group(2)),
                        split_bytes=bool(m.group(3)), decode="bits" if m.group(4) else "convert")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kernels", "comm", "overlap"],
                        help="what to compile and report")
    parser.add_argument("--target", default="h200", choices=sorted(TARGETS))
    parser.add_argument("--elems", type=positive_int, default=2**24,
                        help="elements per input (2**24; only the grid depends on it)")
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    parser.add_argument("--config", default=None, type=_parse_config,
                        help="TILE/WARPS[s] for every kernel instead of its default")
    parser.add_argument("--presets", default="zero3,qwz,hpz,qgz,zeropp,zeropp-max",
                        help="comm: the presets compiled")
    parser.add_argument("--shape", default=(24, 2048, 16, 1024, 16), type=_shape,
                        help="overlap: LAYERS,D_MODEL,HEADS,SEQ,BATCH of the example GPT "
                             "(default the probe's 1.2B, batch 2 per device)")
    parser.add_argument("--json-out", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    config = args.config
    if args.what == "comm" and "xla_force_host_platform_device_count" not in os.environ.get(
            "XLA_FLAGS", ""):  # before JAX starts: the CPU mesh to compare with
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

    if args.what == "comm":
        rows = comm_rows(args.presets.split(","), args.target)
    elif args.what == "overlap":
        from zeropp_jax.models import gpt

        layers, d_model, heads, seq, batch = args.shape
        cfg = gpt.GPTConfig(seq_len=seq, n_layers=layers, d_model=d_model, n_heads=heads)
        rows = overlap_rows(args.presets.split(","), cfg, batch, args.target)
    else:
        rows = kernel_rows(target_devices(args.target), args.elems, args.only, config)
    from zeropp_jax import provenance

    result = dict(provenance=provenance.record(), target=args.target, what=args.what, rows=rows)
    print("JSON " + json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.what == "overlap":
        print(f"Asynchronous collectives of each step compiled for 2 x 4 {args.target} and the "
              f"kernels its schedule runs while each is in flight (x = executions per step)")
        for r in rows:
            print(f"{r['preset']:<11}{r['kind']:<16}x{r['count']:<4}{r['axis']:<11}"
                  f"{r['operand_bytes'] / 1e6:8.1f} MB  {r['kernels']:>3} kernels "
                  f"{r['kernel_bytes'] / 1e6:8.1f} MB  {r['computation']}")
        return 0
    if args.what == "comm":
        print(f"Inter-node bytes per node per step, example GPT, bf16, 2 x 4 devices: compiled "
              f"for {args.target} vs for the CPU (as compiled, and at the run's dtypes)")
        print(f"{'preset':<11}{'variant':<16}{'cpu compiled':>13}{'cpu run dtypes':>15}"
              f"{args.target:>10}{'difference':>11}  {args.target} collectives (kind dtype: count)")
        for r in rows:
            diff = r["gpu_inter_as_compiled"] - r["cpu_inter_at_run_dtypes"]
            kinds = ", ".join(f"{k}: {v}" for k, v in r["gpu_collectives"].items())
            print(f"{r['preset']:<11}{r['variant']:<16}{r['cpu_inter_as_compiled']:>13}"
                  f"{r['cpu_inter_at_run_dtypes']:>15}{r['gpu_inter_as_compiled']:>10}"
                  f"{diff:>+11}  {kinds}")
        return 0
    print(f"PTX for {args.target} (static, per program; issue / conv bound = the bandwidth at "
          f"which instruction issue / type conversions alone are saturated)")
    print(f"{'kernel':<24}{'config':>13}{'thr':>5}{'ptx/el':>7}{'sass/el':>8}{'conv/el':>8}"
          f"{'instr/B':>8}{'issue GB/s':>11}{'conv GB/s':>10}{'shared/el':>10}{'bar':>5}"
          f"{'regs':>6}")
    for r in rows:
        sass = "-" if r["sass_per_element"] is None else f"{r['sass_per_element']:.1f}"
        conv = "-" if r["conversions_per_element"] is None else f"{r['conversions_per_element']:.1f}"
        bound = "-" if not r["conversion_bound_gbs"] else f"{r['conversion_bound_gbs']:.0f}"
        print(f"{r['name']:<24}{r['config']:>13}{r['threads']:>5}"
              f"{r['instructions_per_element']:>7.1f}{sass:>8}{conv:>8}"
              f"{r['instructions_per_byte']:>8.2f}{r['issue_bound_gbs']:>11.0f}{bound:>10}"
              f"{r['shared_per_element']:>10.2f}{r['barriers']:>5}"
              f"{r['registers'] if r['registers'] is not None else '-':>6}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
