"""Models shipped inside the package.

``tiny-llama/`` is the embedded default of ``proxima serve``: a Llama-shaped config with a
512-token byte-level BPE tokenizer and **no weights**. vLLM fills the weights with random
numbers (``--load-format dummy``), so a fresh machine without network serves something at
once; the text it generates is noise. Regenerate the files with
``python -m proxima.models.build_tiny_llama`` (deterministic; the output is committed).
"""

from __future__ import annotations

from pathlib import Path

TINY_LLAMA_DIR = Path(__file__).resolve().parent / "tiny-llama"
# The name clients see in /v1/models: it has to say that the weights are random.
DEMO_SERVED_MODEL_NAME = "proxima-demo-random-weights"
