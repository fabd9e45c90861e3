"""``kvx plan``: how long KV transfer takes in a prefill/decode cluster, and
what it needs (docs/plan.md).

- :mod:`kvx.plan.shapes`: a model's KV bytes per token and per request.
- :mod:`kvx.plan.links`: links and curves (time of one transfer by size).
- :mod:`kvx.plan.model`: the queueing model (pure functions).
- :mod:`kvx.plan.simulate`: the discrete-event cluster simulator
  (docs/plan-simulate.md).
"""

from kvx.plan.links import LINKS, Curve, Link, parse_link
from kvx.plan.model import (
    Cluster,
    Plan,
    evaluate,
    mean_ttft_s,
    mg1_wait_mean_s,
    nics_needed,
    transfer_queue_mean_s,
    wait_pmf,
)
from kvx.plan.shapes import PRESETS, KVShape, load_shape, shape_from_config

__all__ = [
    "LINKS",
    "PRESETS",
    "Cluster",
    "Curve",
    "KVShape",
    "Link",
    "Plan",
    "evaluate",
    "load_shape",
    "mean_ttft_s",
    "mg1_wait_mean_s",
    "nics_needed",
    "parse_link",
    "shape_from_config",
    "transfer_queue_mean_s",
    "wait_pmf",
]
