"""The GPU session's step tools, exercised on the CPU.

``benchmarks/step_traffic.py`` (estimated bytes per step, plain JAX vs the
trainer, from the HLO), ``benchmarks/gpu_profile.py`` (device time per
kernel from a profiler trace; on the CPU the executable's thunks) and
``gpu_train_probe.py --hlo-dir --profile-dir``, which uses both, and
``benchmarks/gpu_aot.py`` (compiling for a GPU without one: what it says
where JAX's CUDA plugin is missing) with ``gpu_code.py`` (PTX and SASS figures).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from zeropp_jax.analysis.hlo import parse_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "32", "--batch", "2"]


def _bench_module(name: str):
    """A module of benchmarks/, imported with that folder on the path (as its scripts run)."""
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, BENCH)
    try:
        import gpu_profile
        import step_traffic
        yield step_traffic, gpu_profile
    finally:
        sys.path.remove(BENCH)


def test_step_traffic_compares_the_trainer_with_plain_remat(bench_modules, tmp_path, capsys):
    step_traffic, _ = bench_modules
    out = tmp_path / "traffic.json"
    assert step_traffic.main([*TINY, "--variants", "plain_remat,zero3",
                              "--json-out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["variants"]}
    assert rows["plain_remat"]["vs_plain_remat"] == 1.0
    assert rows["zero3"]["bytes"] > 0 and rows["zero3"]["top"]
    assert rows["zero3"]["vs_plain_remat"] == rows["zero3"]["bytes"] / rows["plain_remat"]["bytes"]
    assert "vs plain_remat" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # Pallas off a GPU is its interpreter: refused
        step_traffic.main([*TINY, "--variants", "qwz_pallas"])


def test_kernel_times_attribute_a_trace_to_hlo_instructions(bench_modules, tmp_path):
    _, gpu_profile = bench_modules
    step = jax.jit(lambda s, b: (jnp.tanh(s @ s) + b, None))
    x = jnp.ones((192, 192), jnp.float32) / 192
    state, _ = step(x, x)
    state = gpu_profile.trace_steps(step, state, x, 3, str(tmp_path))
    summary = gpu_profile.kernel_times(str(tmp_path), step.lower(state, x).compile().as_text(), 3)
    assert summary["device_us_per_step"] > 0
    assert summary["top"] and all(r["opcode"] != "(not in the module)" for r in summary["top"])
    assert sum(summary["by_opcode"].values()) == pytest.approx(summary["device_us_per_step"])
    with pytest.raises(FileNotFoundError):
        gpu_profile.kernel_times(str(tmp_path / "empty"), "", 1)


def test_probe_goals_compare_step_times_and_peak_share():
    probe = _bench_module("gpu_train_probe")
    row = lambda v, ms, share: dict(variant=v, step_s=ms / 1e3, utilization=share)  # noqa: E731
    rows = [row("plain_remat", 100.0, 0.53), row("zero3", 102.5, 0.517),
            row("qwz", 104.0, 0.499), dict(variant="qwz_pallas", error="boom")]
    found = {g["goal"]: g for g in probe.goals(rows)}
    assert [g["met"] for g in found.values()] == [False, True, True, False]
    zero3 = found["zero3 within 2% of plain jit with per-layer remat"]
    assert zero3["value"] == pytest.approx(1.025) and zero3["text"].startswith("1.025x")
    assert zero3["settled"]  # one group each: no spread
    assert found["qwz (default kernels) within 2% of zero3"]["value"] == pytest.approx(104 / 102.5)
    assert probe.goals([row("zero3", 100.0, 0.6)]) == [
        dict(goal="zero3 at least 50% of the peak", value=0.6, bound=0.5, met=True, text="60.0%")]
    # groups of 99-103 ms against 100-101 ms: ratios 0.980-1.030, the bound inside
    spread = [dict(row("plain_remat", 100.5, 0.5), step_s_all=[0.100, 0.1005, 0.101]),
              dict(row("zero3", 101.0, 0.5), step_s_all=[0.099, 0.101, 0.103])]
    zero3 = probe.goals(spread)[0]
    assert zero3["met"] and not zero3["settled"]
    assert (zero3["low"], zero3["high"]) == (pytest.approx(0.099 / 0.101), pytest.approx(1.03))
    assert "not settled" in zero3["text"]


@pytest.mark.slow
def test_probe_saves_hlo_and_kernel_times(tmp_path):
    cmd = [sys.executable, os.path.join(BENCH, "gpu_train_probe.py"), "--allow-cpu", *TINY,
           "--variants", "plain_remat,zero3", "--warmup", "1", "--steps", "1", "--repeats", "1",
           "--hlo-dir", str(tmp_path / "hlo"), "--profile-dir", str(tmp_path / "profile")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(next(line[5:] for line in run.stdout.splitlines()
                             if line.startswith("JSON ")))
    for row in result["variants"]:
        assert row["traffic_bytes"] > 0 and row["device_ms_per_step"] > 0, row
        assert (tmp_path / "hlo" / f"{row['variant']}.hlo").exists()
        assert json.loads((tmp_path / "profile" / f"{row['variant']}.json").read_text())["top"]
    # what gpu_check.sh prints when a time limit cut the probe short: the same table
    (tmp_path / "probe.json").write_text(json.dumps(result))
    again = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_train_probe.py"),
                            "--table-from", str(tmp_path / "probe.json")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    table = run.stdout[run.stdout.index("\n", run.stdout.index("JSON ")) + 1:]
    assert again.stdout == table and "plain_remat" in table and "zero3" in table


def test_kernel_times_on_a_gpu_like_trace(bench_modules, tmp_path):
    # A device process with a stream line (kernels, named without dots) and a
    # derived "XLA Ops" line, which must not count the kernels twice.
    import gzip

    _, gpu_profile = bench_modules
    hlo = jax.jit(lambda a: jnp.tanh(a) * 2).lower(jnp.ones((64,))).compile().as_text()
    comps, _ = parse_module(hlo)
    inst = next(i.name for c in comps.values() for i in c.instructions if i.opcode == "fusion")
    meta = [dict(ph="M", name="process_name", pid=7, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="thread_name", pid=7, tid=1, args=dict(name="Stream #13(Compute)")),
            dict(ph="M", name="thread_name", pid=7, tid=2, args=dict(name="XLA Ops"))]
    spans = [dict(ph="X", pid=7, tid=1, ts=0, dur=10.0, name=inst.replace(".", "_")),
             dict(ph="X", pid=7, tid=1, ts=20, dur=6.0, name="sm90_gemm", args=dict(hlo_op=inst)),
             dict(ph="X", pid=7, tid=2, ts=0, dur=30.0, name=inst)]
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    summary = gpu_profile.kernel_times(str(tmp_path), hlo, steps=2)
    assert summary["device_us_per_step"] == pytest.approx(8.0)  # (10 + 6) / 2 steps
    assert {r["hlo_op"] for r in summary["top"]} == {inst}
    assert "Stream #13" in summary["source"] and "XLA Ops" not in summary["source"]


# Trimmed from the PTX Triton wrote for dequantize_sum_1bit (jax 0.10.2, sm_90a).
_PTX = """
.version 9.0
.target sm_90a
.address_size 64

.visible .entry dequantize_sum_1bit(
	.param .u64 .ptr .global .align 1 dequantize_sum_1bit_param_0,
	.param .u64 .ptr .global .align 1 dequantize_sum_1bit_param_1
)
.reqntid 32
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<9>;
	.reg .b64 	%rd<5>;
$L__tmp0:
	ld.param.b64 	%rd1, [dequantize_sum_1bit_param_0];
	// begin inline asm
	mov.u32 %r1, 0x0; mov.u32 %r2, 0x0; @%p1 ld.global.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];
	// end inline asm
	st.shared.b32 	[%rd2], %r1;
	bar.sync 	0;
	ld.shared.b32 	%r3, [%rd2+8];
	and.b32 	%r4, %r3, 4;
	setp.eq.b32 	%p2, %r4, 0;
	selp.f32 	%r5, %r1, %r2, %p2;
	add.rn.f32 	%r6, %r5, %r5;
	@!%p2 st.global.v4.b32 [ %rd3 + 0 ], { %r6, %r6, %r6, %r6 };
	ret;
}
"""


def test_ptx_figures_of_a_kernel():
    gpu_code = _bench_module("gpu_code")
    (k,) = gpu_code.ptx_kernels(_PTX)
    assert (k.name, k.threads) == ("dequantize_sum_1bit", 32)
    # mov x2, ld.global, st.shared, bar, ld.shared, and, setp, selp, add, st.global, ret
    # (+ ld.param); labels, directives, comments and braces are not statements
    assert k.instructions == 13
    assert (k.global_loads, k.global_load_bytes) == (1, 8)
    assert (k.global_stores, k.global_store_bytes) == (1, 16)
    assert (k.shared, k.barriers, k.branches) == (2, 1, 0)
    assert k.by_opcode["mov.u32"] == 2 and k.by_opcode["selp.f32"] == 1


def test_gpu_aot_compiles_for_an_h200_or_says_what_to_install():
    gpu_aot = _bench_module("gpu_aot")
    try:
        devices = gpu_aot.target_devices("h200")
    except RuntimeError as e:  # no CUDA plugin (CI): the error names the install
        assert f"jax[cuda13]=={jax.__version__}" in str(e) and "JAX_PLATFORMS=cpu" in str(e)
    else:  # the plugin is here: an H200 to compile for, nothing to run on
        assert [(d.platform, d.device_kind) for d in devices] == [("gpu", "NVIDIA H200")]
    with pytest.raises(ValueError, match="unknown target"):
        gpu_aot.target_devices("a100")


_SASS = """
	code for sm_90a
		Function : dequantize_sum_1bit
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe40000000800 */
        /*0010*/                   LOP3.LUT P0, RZ, R4, 0x1, RZ, 0xc0, !PT ;    /* 0x0000000104ff7812 */
        /*0020*/                   FSEL R5, R2, -R2, P0 ;                       /* 0x8000000202057208 */
        /*0030*/              @!P0 FADD R6, R6, R5 ;                            /* 0x0000000506067221 */
        /*0040*/                   FADD R6, R6, R5 ;                            /* 0x0000000506067221 */
        /*0050*/                   EXIT ;                                       /* 0x000000000000794d */
        /*0060*/                   BRA 0x60;                                    /* 0xfffffffc00fc7947 */
        /*0070*/                   NOP;                                         /* 0x0000000000007918 */
		..........
		Function : quantize_int8
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
"""


def test_sass_counts_of_one_kernel():
    gpu_code = _bench_module("gpu_code")
    assert gpu_code.sass_counts(_SASS, "dequantize_sum_1bit") == {
        "FADD": 2, "LDC": 1, "LOP3": 1, "FSEL": 1, "EXIT": 1, "BRA": 1}
    assert gpu_code.sass_counts(_SASS, "dequantize_sum_4bit") is None


@pytest.mark.slow
def test_gpu_check_runs_every_stage_and_leaves_what_the_device_tool_brings_back(tmp_path):
    """``CPU_SMOKE=1 bash benchmarks/gpu_check.sh``: every stage runs (tiny,
    on the CPU), the summary shows both tables and a goal line, and ``$OUT``
    holds at most the 8 files the device tool returns, the HLO and profiles
    packed into one file each."""
    import tarfile

    out = tmp_path / "out"
    run = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh")], capture_output=True,
                         text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "CPU_SMOKE": "1", "OUT": str(out),
                              "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout[run.stdout.index("== summary"):]
    assert "pytest (rc=0):" in summary and " passed" in summary
    assert "quantize int8 f32" in summary and "zero3" in summary
    # the goal lines reach the summary (on a CPU: that they were not checked, an H200's goals)
    assert "goals not checked: not a GPU" in summary
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["bench.log", "gpu_kernels.json", "gpu_train_probe.json", "hlo.tgz",
                     "probe.log", "profile.tgz", "pytest.log"]
    with tarfile.open(out / "hlo.tgz") as tar:
        assert {"hlo/plain_remat.hlo", "hlo/zero3.hlo"} <= set(tar.getnames())
    with tarfile.open(out / "profile.tgz") as tar:
        assert "profile/zero3.json" in tar.getnames()
