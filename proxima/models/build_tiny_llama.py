"""Write ``proxima/models/tiny-llama/``: the embedded demo model of ``proxima serve``.

    ./dev python -m proxima.models.build_tiny_llama      # rewrites the committed files

A Llama-shaped config (2 layers, hidden 256, vocab 512) and a byte-level BPE tokenizer of
exactly 512 tokens, trained here on the fixed corpus below, so the tokenizer's vocabulary and
the model's ``vocab_size`` agree by construction. There are no weights: vLLM loads the model
with ``--load-format dummy`` (random values). Byte-level BPE encodes any text (no unknown
tokens), which keeps the demo usable with arbitrary prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from proxima.models import TINY_LLAMA_DIR

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: Llama's convention
MAX_LEN = 2048

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_LEN,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}

# Role headers are plain text (byte-level BPE encodes them); the template ends with the
# assistant header when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = """\
Proxima keeps the key-value cache of a language model in long contiguous runs of blocks.
A buddy allocator splits a free run in halves until the half fits, and merges two free
buddies back into one larger run when both are free again. The server answers requests
through the OpenAI compatible API of vLLM: completions, chat completions, models, health
and metrics. This demo model has random weights, so what it writes is noise; it exists to
show that the machine, the driver, the engine and the allocator work together.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
User: Hello, who are you? Assistant: I am a small demonstration model without training.
User: What is the capital of France? Assistant: Paris is the capital of France.
User: Write a short poem about memory. Assistant: Blocks in a row, free and then taken,
runs that grow long when the requests awaken.
def allocate(n, after=None): return the ids of n free blocks, as few runs as possible.
for block in range(num_blocks): if state[block] == FREE: count += 1
{"model": "proxima-demo-random-weights", "prompt": "Hello", "max_tokens": 16}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 16384.
The scheduler admits a request when its first blocks are free, grows it one block at a
time while it decodes, and frees every block when the request finishes or is preempted.
Fragmentation is one minus the largest free run divided by the number of free blocks.
Good morning, good afternoon, good evening and good night. Thank you, please, sorry.
"""


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    size = tokenizer.get_vocab_size()
    if size != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {size} tokens, the config says {VOCAB_SIZE}: "
                         f"lengthen CORPUS so BPE finds enough merges")
    return tokenizer


def write(out: Path = TINY_LLAMA_DIR) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    dump = lambda name, obj: (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    dump("config.json", CONFIG)
    dump("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "model_max_length": MAX_LEN,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else TINY_LLAMA_DIR)
    print(f"wrote {TINY_LLAMA_DIR}")
