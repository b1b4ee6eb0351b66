"""Build the bundled tokenizer, ``asgi_generate/assets/tokenizer.json``.

Run ``python -m asgi_generate.assets.build_tokenizer`` to rebuild it; the
result is committed, so nothing trains at install or run time.

The tokenizer is a small byte-level BPE (vocabulary 4096) trained with the
``tokenizers`` library on the English docstrings and comments of the running
Python's standard library, with the chat-style special tokens of Qwen-family
models so that simulated output can carry reasoning and tool-call markup.
"""

import pathlib
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
VOCAB_SIZE = 4096
OUT = pathlib.Path(__file__).with_name("tokenizer.json")


def corpus() -> list[str]:
    """The training text: the first 200 stdlib modules, in name order."""
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))[:200]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def build() -> Tokenizer:
    """Train and return the tokenizer (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


if __name__ == "__main__":
    build().save(str(OUT))
    print(f"wrote {OUT}")
