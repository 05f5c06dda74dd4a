"""Reading a compiled step: its collectives, bytes and a cost model.

Read in this order (each module builds on the ones above it):

* :mod:`~zeropp_jax.analysis.hlo`: optimized HLO text as computations,
  instructions, shapes, element widths and per-step call counts.
* :mod:`~zeropp_jax.analysis.replica_groups`: a collective's replica groups
  expanded to device ids.
* :mod:`~zeropp_jax.analysis.collectives`: each collective instruction with
  the bytes it moves within and across nodes (flat, and two-level).
* :mod:`~zeropp_jax.analysis.comm_report`: :func:`comm_report`, all of them
  for one compiled program, per mesh axis, per node, as JSON or a table.
* :mod:`~zeropp_jax.analysis.headline`: a trainer's headline figure (two-level
  inter-node bytes per node, over its qgZ schedule) beside zero3's.
* :mod:`~zeropp_jax.analysis.cluster`: the target cluster and workload.
* :mod:`~zeropp_jax.analysis.comm_profile`: per-collective link bytes of a
  compiled step (hierarchical counting), scaled to a target.
* :mod:`~zeropp_jax.analysis.cost_model`: step time predicted from those
  bytes on a described cluster, and the check against the ZeRO++ paper.
* :mod:`~zeropp_jax.analysis.traffic`: device-memory bytes of each kernel of
  a compiled program, with loop trip counts.
* :mod:`~zeropp_jax.analysis.overlap`: per asynchronous collective of a GPU
  schedule, the kernels (and their bytes) that run while it is in flight.
"""
