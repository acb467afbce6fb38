"""Training fast paths for Megatron-core's local layer spec: RoPE, SwiGLU and RMSNorm in fewer
passes over the activations, exact (tests/test_models.py). autograd.py holds the autograd
functions (pure torch), megatron.py the Megatron modules that run them; models/mcore.py's
`fast_layer_spec` / `fast_block_spec` build a layer spec with those modules.
"""
