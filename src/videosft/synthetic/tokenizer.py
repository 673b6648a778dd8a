"""A byte-level BPE tokenizer trained here on the demo's few words and times, with the Qwen special
tokens and a ChatML template, so that the tiny checkpoint needs nothing downloaded."""

from __future__ import annotations

import json

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# ChatML as the Qwen models write it; a video part becomes the vision placeholder that the
# processor expands into per-frame timestamps and video tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_corpus() -> list[str]:
    words = (
        "you are a video editor's assistant watch clip answer which time ranges to keep show "
        "seconds from the start like or none red ball highlight system user assistant"
    )
    numbers = [f"{a}.{b}-{c}.{d}" for a in range(20) for b in range(10) for c, d in [(a + 1, (b + 5) % 10)]]
    return [words, " ".join(numbers), ", ".join(numbers[::7])] * 4


def build_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer)
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = Qwen3_5Tokenizer(
        vocab=bpe.get_vocab(),
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer
