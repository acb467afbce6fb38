"""Prompts: records.py (PromptRecord), dataset.py (jsonl / parquet / HF readers, the resumable
loader), prompts.py (record -> prompt ids: prompt and chat templates, the length limit),
synthetic.py (the built-in task), gsm8k_task.py + gsm8k/ (the shipped GSM8K sample)."""
