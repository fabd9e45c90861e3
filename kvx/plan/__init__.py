"""Capacity planning for kvx clusters: how many instances, NICs and how much metadata
service a workload needs (docs/plan.md, docs/plan-simulate.md)."""
