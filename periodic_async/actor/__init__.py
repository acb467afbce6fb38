"""Megatron mechanics of training: tri_model.py (policy, old and reference on one TP/PP/DP layout;
the objective is injected from algo/), packing.py (samples -> micro-batches, incl. shared-prompt),
logprobs.py (vocab-parallel log-probs and entropy)."""
