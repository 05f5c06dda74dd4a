"""Reading a compiled step: its collectives, bytes and a cost model.

* :mod:`~zeropp_jax.analysis.comm_report`: collectives parsed from the
  optimized HLO, bytes per mesh axis and per node.
* :mod:`~zeropp_jax.analysis.cost_model`: step time predicted from those
  bytes on a described cluster.
"""
