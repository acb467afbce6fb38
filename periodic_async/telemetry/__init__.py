"""Metrics and traces: logger.py (JSONL / TensorBoard / console line), step_metrics.py (what a
step's rollout and throughput metrics are, from its groups and timings), timeline.py (generation
slots, micro-steps and weight syncs as intervals)."""
