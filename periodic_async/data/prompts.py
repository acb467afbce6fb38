"""A record -> the prompt token ids the rollout engines are given (`data.prompt_template`,
`data.chat_template`, `data.system_prompt`, `data.overlong_prompt`).

The question is first wrapped by the prompt template, then, with a chat template, put in a user
message (after the system prompt, if any) and tokenized by `tokenizer.apply_chat_template(...,
add_generation_prompt=True)` itself, so the ids are exactly what the model was tuned on. Without
one the text is tokenized as it is, without special tokens. The limit `data.max_prompt_length`
counts these rendered ids. The reward never sees any of this: it scores the decoded response only
(scheduling/scorer.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from periodic_async.config import ConfigError, DataConfig
from periodic_async.config.validation import check_prompt_template
from periodic_async.data.records import DatasetError, PromptRecord

log = logging.getLogger(__name__)


def default_prompt_template(source: str) -> str:
    """data.prompt_template when it is null: GSM8K's '####' instruction (which the gsm8k reward
    reads the answer after) for the shipped sample, the prompt as it is otherwise."""
    if source == "gsm8k":
        from periodic_async.data.gsm8k_task import PROMPT_TEMPLATE
        return PROMPT_TEMPLATE
    return "{prompt}"


def record_location(cfg: DataConfig, index: int) -> str:
    """Where record `index` comes from, as the dataset readers name a row."""
    if cfg.source == "synthetic":
        return f"data.source synthetic: record {index}"
    if cfg.source == "gsm8k":
        from periodic_async.data.gsm8k_task import sample_path
        return f"{sample_path()}: row index {index}"
    return f"{cfg.path}: row index {index}"


@dataclass
class PromptRenderer:
    tokenizer: Any
    data: DataConfig
    template: str
    use_chat_template: bool
    num_skipped: int = 0        # over-long prompts dropped (overlong_prompt: skip), since pop_counts
    num_truncated: int = 0      # over-long prompts cut (overlong_prompt: truncate_left), since pop_counts

    def text(self, record: PromptRecord) -> str:
        return self.template.format(prompt=record.prompt)

    def messages(self, record: PromptRecord) -> list[dict]:
        system = [{"role": "system", "content": self.data.system_prompt}] if self.data.system_prompt is not None else []
        return system + [{"role": "user", "content": self.text(record)}]

    def token_ids(self, record: PromptRecord) -> list[int]:
        """The rendered prompt's ids, before the length limit."""
        if not self.use_chat_template:
            return list(self.tokenizer(self.text(record), add_special_tokens=False).input_ids)
        # return_dict=True: transformers 5 returns a BatchEncoding by default and 4.x a list
        # unless asked; asking gives the same type on both
        out = self.tokenizer.apply_chat_template(self.messages(record), tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])

    def render(self, record: PromptRecord) -> Optional[list[int]]:
        """The prompt's ids; None when data.overlong_prompt is skip and the prompt is too long
        (the planner then draws another record)."""
        ids = self.token_ids(record)
        if not ids:
            raise DatasetError(f"{record_location(self.data, record.index)}: the prompt is empty after templating")
        limit = self.data.max_prompt_length
        if len(ids) <= limit:
            return ids
        mode = self.data.overlong_prompt
        if mode == "skip":
            self.num_skipped += 1
            return None
        if mode == "truncate_left":
            # the end of a prompt (the question's last line, the generation prompt) is what the
            # response continues from, so the start is cut, as verl's truncation 'left' does
            self.num_truncated += 1
            return ids[-limit:]
        raise DatasetError(f"{record_location(self.data, record.index)}: the prompt has {len(ids)} tokens after "
                           f"templating, more than data.max_prompt_length={limit}; raise it, or set "
                           "data.overlong_prompt: skip | truncate_left")

    def pop_counts(self) -> dict[str, int]:
        """Skipped / truncated prompts since the last call (the step's metrics)."""
        counts = {"data/overlong_prompts_skipped": self.num_skipped,
                  "data/overlong_prompts_truncated": self.num_truncated}
        self.num_skipped = self.num_truncated = 0
        return counts


def build(cfg: DataConfig, tokenizer: Any, where: str = "the model's tokenizer") -> PromptRenderer:
    """The renderer for `cfg` (already validated) and the loaded tokenizer; `where` names the
    tokenizer (its directory) in errors."""
    check_prompt_template(cfg.prompt_template)
    template = cfg.prompt_template if cfg.prompt_template is not None else default_prompt_template(cfg.source)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat = cfg.chat_template == "auto" and has_template
    if cfg.system_prompt is not None and not use_chat:
        raise ConfigError(f"data.system_prompt: {where} has no chat template to put a system prompt in "
                          f"(data.chat_template: {cfg.chat_template}); put the text in data.prompt_template")
    log.info("prompts: %s, template %r", "the tokenizer's chat template" if use_chat else "raw text", template)
    return PromptRenderer(tokenizer, cfg, template, use_chat)
