"""The embedded demo model: a tokenizer whose vocabulary is the config's, loadable by vLLM."""

from __future__ import annotations

import json

import pytest

from proxima.models import TINY_LLAMA_DIR, build_tiny_llama


def test_committed_files_are_what_the_generator_writes(tmp_path):
    build_tiny_llama.write(tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tmp_path / name).read_text() == (TINY_LLAMA_DIR / name).read_text(), name
    assert not list(TINY_LLAMA_DIR.glob("*.safetensors"))  # no weights: load_format=dummy


def test_vocab_matches_and_vllm_loads_the_tokenizer():
    pytest.importorskip("vllm")
    try:
        from vllm.tokenizers import get_tokenizer
    except ModuleNotFoundError:  # vLLM 0.6 (the card stack)
        from vllm.transformers_utils.tokenizer import get_tokenizer

    config = json.loads((TINY_LLAMA_DIR / "config.json").read_text())
    tokenizer = get_tokenizer(str(TINY_LLAMA_DIR))
    assert len(tokenizer) == config["vocab_size"] == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"],
                                                                 config["eos_token_id"])
    text = "Hello, wörld! 日本 {\"json\": 1}"
    ids = tokenizer.encode(text)
    assert max(ids) < config["vocab_size"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: no unknowns
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"
