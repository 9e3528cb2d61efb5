"""How ``proxima serve --elastic`` sizes an engine when no sizing flag is given, and whether
several models fit on one GPU. Pure Python (no torch, no vLLM): the facts come in as
arguments, the tests give any.

An elastic engine's KV pool is *reserved* (virtual addresses) and backed by GPU memory only
as the load needs it, so the reservation may be as large as the GPU could ever hold for KV;
what bounds the memory is the policy's minimum and maximum. For one engine of a model whose
non-KV memory (weights, activations, CUDA graphs; :func:`nonkv_estimate`) is ``W`` on a GPU
of ``T`` bytes, with the other engines ``j`` on that GPU holding ``W_j`` besides their KV
and keeping at least ``min_j`` (their ledger records, :mod:`proxima.memory.ledger`)::

    room        = T - W - sum_j (W_j + min_j)          what the others can never take back
    kv_min      = --kv-min, else DEFAULT_KV_MIN (at most room)
    kv_max      = --kv-max, else room                  (refused: room < kv_min)
    reservation = --kv-cache-memory-bytes, else max(kv_max, T - W)   (virtual: the most
                  this engine could map were it alone, so a later --max may raise it)
    (kv_max and the reservation bounded by the KV the engine could ever use: max_num_seqs
    sequences of max_model_len tokens)
    utilization = --gpu-memory-utilization, else (W + kv_min) / T rounded up to 0.01:
                  with the KV size given, vLLM uses it only for its start-up check that
                  this share of the GPU is free (vllm/v1/worker/utils.py request_memory)

At run time the same bound on the maximum is kept by each engine from the ledger
(:class:`proxima.memory.sharing.SharedPolicyStep`), so an engine sized alone makes room for
one started later; without ``--kv-max`` the engine is given the reservation as its fixed
maximum (``kv_max`` is then only what the others leave now), so one started beside others
grows into what they give up when they stop or sleep. An engine started while another
holds memory: when the GPU's free memory is known and below ``W + kv_min``,
:attr:`Sizing.ask_bytes` is the difference; the others' memory above their minimums
(``mapped_j - min_j``) is what they could give back when asked through the ledger (posted
as unmet demand); more than that is refused before anything starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from proxima.config import GiB, MiB
from proxima.errors import UserError

#: the least KV memory an engine keeps mapped by default (a few requests' worth)
DEFAULT_KV_MIN = 512 * MiB
#: what an engine holds besides its weights: CUDA context, the profile run's activations,
#: CUDA graphs (measured on the H200: graph capture took 0.09-0.99 GiB in the run logs of
#: docs/results/h200x2-2026-11-30 and h200-2026-12-01-s5), as a fixed part plus a share
#: of the weights (activations grow with the model's width)
NONKV_FIXED = 2 * GiB
NONKV_SHARE = 0.05
#: vLLM's dtype names -> bytes per parameter ("auto": the config's; float32 becomes 16-bit)
DTYPE_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float": 4, "float32": 4,
               "fp8": 1, "float8": 1, "float8_e4m3fn": 1}


def _text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) Hugging Face config."""
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict):
            return {**config, **config[key]}
    return config


def _first(config: dict, *keys, default=None):
    for key in keys:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return value
    return default


def parameter_count(config: dict) -> int:
    """The parameters of a decoder-only transformer from its Hugging Face ``config.json``:
    embeddings (twice unless tied), per layer the attention's q/k/v/o projections, the
    gated MLP (or the experts', shared experts' and router's of a mixture) and two norms.
    Biases are left out (well under 0.1%). ValueError naming the field that is missing."""
    c = _text_config(config)
    hidden = _first(c, "hidden_size", "n_embd", "d_model")
    layers = _first(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(c, "num_attention_heads", "n_head")
    vocab = _first(c, "vocab_size")
    for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers),
                        ("num_attention_heads", heads), ("vocab_size", vocab)):
        if value is None:
            raise ValueError(f"config.json has no {name}")
    hidden, layers, heads, vocab = int(hidden), int(layers), int(heads), int(vocab)
    kv_heads = int(_first(c, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_first(c, "head_dim", default=hidden // heads))
    inter = int(_first(c, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        expert_inter = int(_first(c, "moe_intermediate_size", default=inter))
        shared = int(_first(c, "shared_expert_intermediate_size", default=0)) or \
            int(_first(c, "n_shared_experts", default=0)) * expert_inter
        mlp = 3 * hidden * (int(experts) * expert_inter + shared) + hidden * int(experts)
        dense = int(_first(c, "first_k_dense_replace", default=0))
        per_layer = [attention + (3 * hidden * inter if i < dense else mlp) + 2 * hidden
                     for i in range(layers)]
        body = sum(per_layer)
    else:
        body = layers * (attention + 3 * hidden * inter + 2 * hidden)
    tied = bool(c.get("tie_word_embeddings", False))
    return body + vocab * hidden * (1 if tied else 2) + hidden


def bytes_per_parameter(config: dict, dtype: str | None = None,
                        quantization: str | None = None) -> float:
    """What one parameter takes on the GPU: ``--quantization`` or the config's
    ``quantization_config`` (its ``bits``; fp8: 1), else ``--dtype``, else the config's
    (float32 checkpoints are served in 16 bits by vLLM's ``auto``), else 2."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        bits = quant.get("bits") or quant.get("weight_bits")
        if isinstance(bits, int) and 0 < bits <= 16:
            return bits / 8
        if "fp8" in str(quant.get("quant_method", "")).lower():
            return 1
    if quantization and "fp8" in quantization.lower():
        return 1
    if dtype and dtype != "auto":
        return DTYPE_BYTES.get(dtype.lower().removeprefix("torch."), 2)
    written = str(_text_config(config).get("torch_dtype") or config.get("dtype") or "")
    return min(2, DTYPE_BYTES.get(written.lower().removeprefix("torch."), 2))


def weights_estimate(config: dict, dtype: str | None = None,
                     quantization: str | None = None) -> int:
    """Parameter count x bytes per parameter (:func:`parameter_count`,
    :func:`bytes_per_parameter`)."""
    return math.ceil(parameter_count(config) * bytes_per_parameter(config, dtype, quantization))


def kv_bytes_per_token(config: dict, kv_dtype_bytes: float = 2) -> int:
    """The KV cache one token takes in every layer: keys and values of the KV heads (an MLA
    model's one latent vector and its rope part)."""
    c = _text_config(config)
    layers = int(_first(c, "num_hidden_layers", "n_layer", "num_layers", default=1))
    if _first(c, "kv_lora_rank"):
        width = int(c["kv_lora_rank"]) + int(_first(c, "qk_rope_head_dim", default=0))
    else:
        heads = int(_first(c, "num_attention_heads", "n_head", default=1))
        kv_heads = int(_first(c, "num_key_value_heads", "num_kv_heads", default=heads))
        hidden = int(_first(c, "hidden_size", "n_embd", "d_model", default=heads))
        width = 2 * kv_heads * int(_first(c, "head_dim", default=hidden // heads))
    return math.ceil(layers * width * kv_dtype_bytes)


def nonkv_estimate(weights: int) -> int:
    """What an engine holds besides its KV: the weights, plus :data:`NONKV_FIXED` and
    :data:`NONKV_SHARE` of them for the CUDA context, activations and CUDA graphs."""
    return weights + NONKV_FIXED + math.ceil(NONKV_SHARE * weights)


def read_model_config(model: str) -> dict | None:
    """The ``config.json`` of a local model directory (None: not a local directory, e.g. a
    Hugging Face id, or no config.json). UserError when it is there and unreadable."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: cannot read the model's config ({exc}): fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the model's config is not a JSON object")
    return data


@dataclass(frozen=True)
class Other:
    """Another engine on the GPU, as its ledger record says (bytes)."""

    nonkv: int = 0          # what it holds besides KV (0: not said)
    min: int = 0            # its minimum KV
    mapped: int = 0         # its KV mapped now
    label: str = ""

    @property
    def claim(self) -> int:
        """What it keeps whatever happens: its non-KV memory and its minimum."""
        return self.nonkv + self.min

    @property
    def above_min(self) -> int:
        """What it could give back when asked."""
        return max(0, self.mapped - self.min)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class Sizing:
    """What one elastic engine is given (bytes; ``utilization`` a share of the GPU)."""

    gpu_total: int
    nonkv: int
    reservation: int
    utilization: float
    kv_min: int
    kv_max: int
    others: int = 0         # how many other engines share the GPU
    others_claim: int = 0   # their non-KV memory and minimums
    ask_bytes: int = 0      # what the others must give back before this engine can start
    follows: bool = False   # kv_max is only what the others leave now (no --kv-max given)

    def line(self) -> str:
        others = (f", {self.others} other engine(s) on it keep {_gib(self.others_claim)}"
                  if self.others else "")
        return (f"elastic sizing: GPU {_gib(self.gpu_total)}, this model ~{_gib(self.nonkv)} "
                f"besides KV{others}: KV reserved {_gib(self.reservation)} (virtual), "
                f"--kv-min {_gib(self.kv_min)}, --kv-max {_gib(self.kv_max)}"
                f"{' now (it follows what the others leave)' if self.follows else ''}, "
                f"--gpu-memory-utilization {self.utilization:g} (vLLM's start-up check only)")


def plan(gpu_total: int, nonkv: int, others=(), *, kv_min: int | None = None,
         kv_max: int | None = None, reservation: int | None = None,
         utilization: float | None = None, gpu_free: int | None = None,
         usable: int | None = None, what: str = "this model") -> Sizing:
    """One engine's sizing (see the module's doc); the given values are kept, the others
    computed. ``usable``: the most KV the engine could ever use (its sequences at their
    longest; None: no bound), which bounds the default maximum and the reservation (a
    small model's pool would otherwise count millions of blocks). UserError (one line, with the sums) when it cannot fit beside the others."""
    if gpu_total <= 0:
        raise UserError(f"the GPU's memory must be above 0 bytes, got {gpu_total}")
    others = tuple(others)
    claim = sum(o.claim for o in others)
    room = gpu_total - nonkv - claim
    least = DEFAULT_KV_MIN if kv_min is None else kv_min
    if kv_min is None and 0 < room < least:
        least = room                       # a small GPU: what there is
    if kv_min is None and reservation is not None:
        least = min(least, reservation)    # a given pool smaller than the default minimum
    if room < least or room <= 0:
        beside = f" + {len(others)} other engine(s) {_gib(claim)}" if others else ""
        raise UserError(
            f"{what} does not fit on the GPU even at its minimum: ~{_gib(nonkv)} besides KV "
            f"+ --kv-min {_gib(least)}{beside} = {_gib(nonkv + least + claim)} > the GPU's "
            f"{_gib(gpu_total)}: {'stop an engine, ' if others else ''}lower --kv-min, or "
            f"use a smaller model")
    most = (room if usable is None else max(least, min(room, usable))) if kv_max is None \
        else kv_max
    if most < least:
        raise UserError(f"--kv-max {_gib(most)} is below --kv-min {_gib(least)}: give a "
                        f"maximum at least the minimum")
    alone = gpu_total - nonkv if usable is None else min(gpu_total - nonkv, usable)
    pool = max(most, alone) if reservation is None else reservation
    if reservation is not None and kv_max is None:
        most = max(least, min(most, reservation))
    if reservation is not None and least > reservation:
        raise UserError(f"--kv-min {_gib(least)} is above the KV pool of {_gib(reservation)} "
                        f"(--kv-cache-memory-bytes): lower --kv-min or raise the pool")
    if utilization is None:
        utilization = min(0.95, max(0.01, math.ceil(100 * (nonkv + least) / gpu_total) / 100))
    ask = 0
    if gpu_free is not None and gpu_free < nonkv + least:
        ask = nonkv + least - gpu_free
        could = sum(o.above_min for o in others)
        if ask > could:
            raise UserError(
                f"{what} needs ~{_gib(nonkv + least)} free to start (~{_gib(nonkv)} besides "
                f"KV + --kv-min {_gib(least)}) and the GPU has {_gib(gpu_free)} free; the "
                f"other Proxima engines could give back {_gib(could)}: free memory on the "
                f"GPU (another process holds it) or lower --kv-min")
    return Sizing(gpu_total, nonkv, pool, utilization, least, most, len(others), claim, ask)


def check_fit(models, gpu_total: int, others=(), *, source: str = "the GPU") -> int:
    """Several models on one GPU: ``models`` as ``(name, nonkv or None, kv_min)``; their
    non-KV memory and minimums, with the other engines' claims, must fit in ``gpu_total``.
    Returns the bytes needed; UserError naming the sum, each model and the GPU's size."""
    others = tuple(others)
    parts, total, unknown = [], sum(o.claim for o in others), []
    for name, nonkv, least in models:
        if nonkv is None:
            unknown.append(name)
            nonkv = 0
        total += nonkv + least
        parts.append(f"{name} {_gib(nonkv + least)}")
    if total > gpu_total:
        beside = (f" + {len(others)} engine(s) already on it {_gib(sum(o.claim for o in others))}"
                  if others else "")
        left = f" ({', '.join(unknown)} not counted: no local config.json)" if unknown else ""
        raise UserError(
            f"the models do not fit on one GPU even at their minimums: {' + '.join(parts)}"
            f"{beside} = {_gib(total)} > {source}'s {_gib(gpu_total)} (weights estimated "
            f"from each config.json, plus activations and --kv-min){left}: serve fewer "
            f"models, lower their --kv-min, or give --gpu-memory-bytes for a larger GPU")
    return total
