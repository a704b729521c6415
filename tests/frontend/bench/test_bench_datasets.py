"""Workload generators: exact token lengths, determinism, length mixes, JSONL."""

import json

import pytest

from tidal.frontend.bench.datasets import (
    DatasetConfig, build_dataset, load_tokenizer, sharegpt_like_lengths,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _encoded_len(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_lengths_are_exact_and_in_range(tokenizer):
    config = DatasetConfig(name="random", num_prompts=40, input_len=40, output_len=20,
                           range_ratio=0.5)
    requests = build_dataset(config, tokenizer)
    assert len(requests) == 40
    for r in requests:
        assert 20 <= r.prompt_len <= 60 and 10 <= r.output_len <= 30
        assert _encoded_len(tokenizer, r.prompt) == r.prompt_len == len(r.prompt_token_ids)
    assert len({r.prompt_len for r in requests}) > 5  # the ratio spreads lengths


def test_range_ratio_zero_gives_fixed_lengths(tokenizer):
    requests = build_dataset(DatasetConfig(num_prompts=10, input_len=17, output_len=9), tokenizer)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(17, 9)}


def test_same_seed_same_workload_other_seed_differs(tokenizer):
    config = DatasetConfig(name="sharegpt-like", num_prompts=20, seed=3)
    first = build_dataset(config, tokenizer)
    again = build_dataset(config, tokenizer)
    other = build_dataset(DatasetConfig(name="sharegpt-like", num_prompts=20, seed=4), tokenizer)
    assert [(r.prompt, r.output_len) for r in first] == [(r.prompt, r.output_len) for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_sharegpt_like_mix_is_long_tailed_and_bounded():
    config = DatasetConfig(name="sharegpt-like", num_prompts=2000, max_input_len=1024,
                           max_total_len=2048)
    import numpy as np

    pairs = sharegpt_like_lengths(config, np.random.default_rng(0))
    inputs = np.array([p[0] for p in pairs])
    outputs = np.array([p[1] for p in pairs])
    assert inputs.min() >= 4 and outputs.min() >= 4
    assert inputs.max() <= 1024 and (inputs + outputs).max() <= 2048
    assert 150 < inputs.mean() < 300 and 120 < outputs.mean() < 280  # ShareGPT-like means
    assert inputs.mean() > 1.3 * np.median(inputs)  # a long tail to the right


def test_sharegpt_like_respects_small_limits(tokenizer):
    config = DatasetConfig(name="sharegpt-like", num_prompts=30, max_input_len=64,
                           max_total_len=128)
    for r in build_dataset(config, tokenizer):
        assert r.prompt_len <= 64 and r.prompt_len + r.output_len <= 128


def test_shared_prefix_requests_share_their_prefix_tokens(tokenizer):
    config = DatasetConfig(name="shared-prefix", num_prompts=6, prefix_len=32, input_len=8,
                           output_len=5, num_prefixes=2)
    requests = build_dataset(config, tokenizer)
    assert requests[0].prompt_token_ids[:32] == requests[2].prompt_token_ids[:32]
    assert requests[1].prompt_token_ids[:32] == requests[3].prompt_token_ids[:32]
    assert requests[0].prompt_token_ids[:32] != requests[1].prompt_token_ids[:32]
    assert all(r.prompt_len == 40 and r.output_len == 5 for r in requests)


def test_without_tokenizer_prompts_are_words_of_the_length():
    requests = build_dataset(DatasetConfig(num_prompts=5, input_len=12, output_len=3,
                                           prefix_len=4))
    assert all(len(r.prompt.split()) == 16 == r.prompt_len for r in requests)
    assert all(r.prompt_token_ids is None for r in requests)


def test_jsonl_rows_cycle_and_take_output_len(tmp_path, tokenizer):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "hello world", "output_len": 7}) + "\n\n"
                    + json.dumps({"prompt": "the quick brown fox", "max_tokens": 3}) + "\n"
                    + json.dumps({"prompt": "no length"}) + "\n")
    config = DatasetConfig(name="jsonl", path=str(path), num_prompts=4, output_len=11)
    requests = build_dataset(config, tokenizer)
    assert [r.output_len for r in requests] == [7, 3, 11, 7]
    assert requests[3].prompt == "hello world"
    assert requests[1].prompt_len == _encoded_len(tokenizer, "the quick brown fox")


@pytest.mark.parametrize("kwargs, field", [
    (dict(name="bogus"), "dataset name"),
    (dict(num_prompts=0), "num_prompts"),
    (dict(range_ratio=1.5), "range_ratio"),
    (dict(name="jsonl"), "path"),
    (dict(input_len=0), "input_len"),
])
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DatasetConfig(**kwargs)


def test_jsonl_bad_row_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'prompt'"):
        build_dataset(DatasetConfig(name="jsonl", path=str(path), num_prompts=1))
