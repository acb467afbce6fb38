"""A character-level tokenizer for the tiny embedded model, saved in Hugging Face format.

One token per character keeps the vocabulary small (so a random-init model finds rewarded tokens
often enough for RL to start) and makes every string round-trip exactly. It is a real
`tokenizers` WordLevel tokenizer wrapped in `PreTrainedTokenizerFast`, so HF engines and vLLM
can load it from the model directory.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]
# The characters the built-in tasks use; anything else maps to <unk>.
DEFAULT_ALPHABET = "0123456789+-*=:?, "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, pad_to_multiple_of: int = 8) -> PreTrainedTokenizerFast:
    """Vocabulary: specials, then the alphabet, then unused filler tokens so the size is a multiple
    of `pad_to_multiple_of` (tensor parallelism shards the vocabulary)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    while len(vocab) % pad_to_multiple_of:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def load_tokenizer(path: str):
    """Load a model directory's tokenizer. Our char tokenizer is loaded with
    PreTrainedTokenizerFast directly: AutoTokenizer on a `qwen2` directory would substitute Qwen's
    own class and change its behaviour."""
    import json
    import os
    from transformers import AutoTokenizer
    from .mcore import CheckpointError
    # without any vocabulary file transformers builds an empty tokenizer (one token) and says nothing
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, fn)) for fn in vocab_files) \
            and not any(fn.endswith(".tiktoken") for fn in os.listdir(path)):
        raise CheckpointError(f"model.path: {path} has no tokenizer ({', '.join(vocab_files)} or *.tiktoken)")
    cfg_path = os.path.join(path, "tokenizer_config.json")
    # transformers reports a missing or broken tokenizer as OSError / ValueError from deep inside
    # from_pretrained; the directory is named here so that it reads as the input error it is
    try:
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                if json.load(f).get("periodic_async_char_tokenizer"):
                    return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"model.path: no tokenizer can be loaded from {path} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def mark_char_tokenizer(path: str) -> None:
    """Tag a saved char tokenizer so `load_tokenizer` knows to bypass AutoTokenizer."""
    import json
    import os
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["periodic_async_char_tokenizer"] = True
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
