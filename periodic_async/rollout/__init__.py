"""Rollout: base.py (request / result types, the engine interface), hf_engine.py and vllm_engine.py
(the engines; sampling.py the HF engine's token sampling), worker.py (worker processes and the pool), dispatch.py (which worker
gets a request: torch-free), weight_sync.py (broadcast sync)."""
