"""Models: mcore.py (architecture -> Megatron-core GPTModel), convert.py (HF <-> Megatron weights),
tiny.py (the tiny random-init model), tokenizer.py (its char tokenizer)."""
