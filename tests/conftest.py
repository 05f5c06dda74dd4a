"""Test set-up: 8 simulated CPU devices, a strict JAX and a compilation cache.

The device count must be fixed before JAX is imported anywhere, so this file
sets ``XLA_FLAGS`` at import time (pytest imports conftest first).
"""

import atexit
import os
import shutil
import tempfile

# LLVM's optimization level 0 for the CPU code XLA emits: the tests are bound
# by compilation (tiny models, few steps), and it compiles them about a third
# faster. Only code generation changes: the optimized HLO, where collectives,
# dtypes and replica groups are read, is the same text at every level (checked
# for the zero3, qwz, hpz and zeropp steps of tests/_util.gpt_step). The
# scripts the tests start inherit it (``_util.child_env``). Not when the
# kernels are checked compiled on a GPU (``PALLAS_KERNELS_COMPILED=1``,
# benchmarks/gpu_check.sh): there the references run as XLA:GPU compiles them
# for a user, at its default level.
FAST_CODEGEN_FLAG = "--xla_backend_optimization_level=0"
_COMPILED_ON_GPU = os.environ.get("PALLAS_KERNELS_COMPILED") == "1"
os.environ["XLA_FLAGS"] = " ".join(flag for flag in [
    os.environ.get("XLA_FLAGS", ""), "" if _COMPILED_ON_GPU else FAST_CODEGEN_FLAG,
    "--xla_force_host_platform_device_count=8",
] if flag)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Strict dtype promotion is not used: optax itself (bias correction in adam)
# mixes Python floats and int32 step counts, which "strict" rejects.
jax.config.update("jax_numpy_dtype_promotion", "standard")

# A persistent compilation cache private to this process (each pytest-xdist
# worker has its own): a program an earlier test compiled loads instead of
# compiling again, the same executable with the same results. Source
# locations and named scopes are part of the key, so a loaded program's HLO
# carries its own op names (the comm reports classify collectives by them);
# a location keeps only its innermost frame, so the same library code reached
# from two tests makes one key.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="zeropp-test-jax-cache-")
atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
jax.config.update("jax_traceback_in_locations_limit", 1)

# The README runs the files on two workers (``-n 2 --dist loadfile``), each
# file on one worker, handed out in collection order as workers free up
# (``--no-loadscope-reorder`` in pyproject.toml; xdist would otherwise order
# files by their number of tests). Handing out the longest files first keeps
# the two workers finishing together; with xdist's own order the notebooks
# (5 tests, 4 minutes) started last and ran alone for 3.5 minutes of a
# 21-minute run. Longest first, as measured in a full run on 2 cores
# (seconds in the suite, 2026-12-03); every other file follows in its own
# collection order.
LONGEST_FILES_FIRST = (
    "test_cli.py",            # 282
    "test_notebooks.py",      # 236
    "test_multihost.py",      # 177
    "test_checkpoint.py",     # 156
    "test_replicated.py",     # 138
    "test_zeropp.py",         # 123
    "test_momentum.py",       # 120
    "test_train.py",          # 100
    "test_wrap.py",           # 92
    "test_prefetch.py",       # 85
    "test_launch.py",         # 72
    "test_kernel_selection.py",  # 69
    "test_cluster_bench.py",  # 67
    "test_cost_model.py",     # 63
    "test_hierarchical.py",   # 57
    "test_pallas_kernels.py",  # 54
)


def pytest_collection_modifyitems(session, config, items):
    """Collect the longest files first (``LONGEST_FILES_FIRST``)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    missing = [f for f in LONGEST_FILES_FIRST if not os.path.exists(os.path.join(tests, f))]
    if missing:
        raise ValueError(f"conftest.LONGEST_FILES_FIRST names files that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
