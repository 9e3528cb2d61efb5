"""Where vLLM's V1 code differs between the tested releases (0.26.0, 0.33.0): one place each.

Each function below is named for what changed and finds the installed vLLM's way by feature
(which module exists), never by its version string, so a release in between resolves to
whichever side it already has. Everything else Proxima touches is the same in both releases:
``FreeKVCacheBlockQueue``'s methods (``popleft``, ``popleft_n``, ``remove``, ``append``,
``append_n``, ``prepend_n``, ``get_all_free_blocks``, ``iter_blocks_after``),
``SingleTypeKVCacheManager.allocate_new_blocks(request_id, num_tokens,
num_tokens_main_model)`` and ``_partial_hit_reqs``, ``KVCacheManager.free`` /
``new_step_starts``, ``Scheduler.add_request``, ``AsyncScheduler``, and the replay driver's
``Request`` / ``ModelRunnerOutput`` / ``SchedulerConfig`` arguments.

Differences that need no code here (the adapter already copes; each is covered by a test in
tests/vllm on the release that has it):

* ``BlockPool.__init__`` gained ``num_hash_lookahead_tokens=`` and ``medium=`` (0.33): the
  Proxima pool passes every argument through to stock's constructor and reads only what it
  built (``num_gpu_blocks``, ``hash_block_size``, ``blocks``, ``null_block``).
* ``KVCacheBlock.pool`` (0.33): ``BlockPool.free_blocks`` hands a block that belongs to
  another pool back to that pool. The blocks of a Proxima pool are built by stock's
  constructor with ``pool=self``, so they stay in its queue.
* ``BlockPool.unpin_blocks`` (0.33, HiSparse): released blocks go to the tail of the free
  queue (``append_n``) whether or not they carry a hash, as last-resort eviction candidates.
  In Proxima's queue that is the LRU tier: handed out only when the buddy is empty, least
  recently released first, exactly as stock.
* ``KVConnectorBase_V1.requires_kv_delivery`` (0.33): True for a ``kv_producer`` by default,
  which makes the scheduler drop a preempted request's in-flight output under async
  scheduling. The elastic connector hands off no KV and says False (a property 0.26 never
  reads), so the schedule is stock's on both.
* Partial-block prefix hits with copy-on-write (0.33, ``kv_cache_block_copies``) and
  connector-aware prefix lookups (``get_computed_blocks_for_connector``, hybrid Mamba models
  only): the connector matches no external tokens, so the local hit is stock's; compaction
  pins the copies' endpoints as it does 0.26's.
* "LIFO reuse of non-cached blocks" (0.33's comment in ``BlockPool.free_blocks``): the
  same calls as 0.26, uncached blocks ``prepend_n``-ed and cached ones ``append_n``-ed,
  which Proxima's queues serve (the buddy places the uncached ones; the LRU tier keeps the
  cached ones in stock's order). Blocks of another pool (``block.pool``) go back to it.

Differences with code here, each one function: the KV cache description
(:func:`kv_regions`, :func:`kv_region_layout`), the V2 runner's KV allocation
(:func:`kv_allocation`, :func:`vmm_kv_allocation`, :func:`kv_views`), the block tables'
entries per block (:func:`kernel_blocks_per_block`), the replay's ``KVCacheTensor``
(:func:`kv_cache_tensors`) and ``vllm serve``'s modules.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


def _first_module(*names: str):
    """The first of ``names`` that the installed vLLM has (an import error inside an
    existing module is raised, not skipped)."""
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:     # a parent package is missing
            found = False
        if found:
            return importlib.import_module(name)
    raise ImportError(f"none of {', '.join(names)} is in the installed vLLM")


def serve_cli_args():
    """The module with ``make_arg_parser`` and ``validate_parsed_serve_args`` (``vllm
    serve``'s options): ``vllm.entrypoints.openai.cli_args`` up to 0.26 (and on the card
    stack), ``vllm.entrypoints.common.cli_args`` in 0.33."""
    return _first_module("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args")


def cli_env_setup() -> None:
    """Run ``vllm serve``'s process set-up (spawn, not fork, for engine processes): it lives
    in ``vllm.entrypoints.serve.utils.api_utils`` in 0.26, ``vllm.entrypoints.common.startup``
    in 0.33."""
    _first_module("vllm.entrypoints.common.startup",
                  "vllm.entrypoints.serve.utils.api_utils").cli_env_setup()


def api_server_app():
    """``(build_app, init_app_state)`` of vLLM's OpenAI server, same signatures in both: in
    ``vllm.entrypoints.openai.api_server`` in 0.26; 0.33 moved them under
    ``vllm.entrypoints.launchers`` and left a shim there that warns when imported."""
    try:
        app = _first_module("vllm.entrypoints.launchers.app")
        state = _first_module("vllm.entrypoints.launchers.api_server.app_state")
    except ImportError:
        app = state = importlib.import_module("vllm.entrypoints.openai.api_server")
    return app.build_app, state.init_app_state



def _page_bytes(kv_cache_config, layer: str) -> int:
    """Bytes of one block of ``layer`` (its KV cache spec's page)."""
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)     # UniformTypeKVCacheSpecs
            return (specs[layer] if specs else spec).page_size_bytes
    raise ValueError(f"layer {layer} is in no KV cache group")


def kv_cache_tensors(num_blocks: int, page_bytes: int, layer_names: list[str]) -> list:
    """``KVCacheConfig.kv_cache_tensors`` for one region of ``num_blocks`` pages per layer:
    0.26 says it as one ``KVCacheTensor(size, shared_by=[layer])`` per layer; 0.33 as one
    backing allocation, ``KVCacheTensor(size, layers, layer_stride, block_stride)``
    (layer-outermost: each layer's pages contiguous)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    region = num_blocks * page_bytes
    if kv_layout_generation() == "per-layer":
        return [KVCacheTensor(size=region, shared_by=[name]) for name in layer_names]
    return [KVCacheTensor(size=region * len(layer_names), layers=list(layer_names),
                          layer_stride=region, block_stride=page_bytes)]


def _kv_cache_tensor_fields() -> set[str]:
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor

    return {f.name for f in dataclasses.fields(KVCacheTensor)}


def kv_layout_generation() -> str:
    """How this vLLM describes its KV memory: ``"per-layer"`` (0.26: one ``KVCacheTensor
    (size, shared_by, offset, block_stride)`` per layer, or several aliasing one packed buffer
    when ``block_stride > 0``) or ``"one-backing"`` (0.33: every ``KVCacheTensor(size,
    layers, layer_stride, block_stride, offset)`` places its layers in one allocation)."""
    return "per-layer" if "shared_by" in _kv_cache_tensor_fields() else "one-backing"


@dataclass(frozen=True)
class KvRegion:
    """One block-major byte range of the KV memory: block ``b`` owns ``[base + b * stride,
    base + (b + 1) * stride)``; ``base`` is a byte offset into vLLM's backing allocation
    (0.33) or 0 (0.26: each region its own buffer)."""

    base: int
    stride: int


def kv_regions(kv_cache_config) -> tuple[list[int], dict[str, int]]:
    """The KV cache config as block-major regions: their sizes in bytes (``num_blocks``
    pages each) and layer name -> region index. Granule ``g`` maps the same block ids in every
    region. See :func:`kv_region_layout` for where each region lies."""
    regions, where, _ = kv_region_layout(kv_cache_config)
    n = kv_cache_config.num_blocks
    return [r.stride * n for r in regions], where


def kv_region_layout(kv_cache_config) -> tuple[list[KvRegion], dict[str, int], list]:
    """``(regions, layer -> region index, [(KVCacheTensor, first region index)])``.

    0.26: one region per ``KVCacheTensor``, except that the tensors of a packed layout
    (``block_stride > 0``) all alias one region, as in vLLM's ``_allocate_kv_cache``.

    0.33: each ``KVCacheTensor`` places ``layers[l]``'s page of block ``b`` at ``offset +
    l * layer_stride + b * block_stride`` in one backing allocation. Layer-outermost
    (``layer_stride >= num_blocks * block_stride``): one region per layer, at ``offset + l *
    layer_stride``. Block-outermost (the layers' pages side by side in each block): one region
    at the start of the block the offset falls in. Tensors that alias (cache groups overlay
    each other) share regions; two regions that overlap without being the same one are a
    layout the granule mapping cannot serve (ValueError)."""
    n = kv_cache_config.num_blocks
    tensors = list(kv_cache_config.kv_cache_tensors)
    regions: list[KvRegion] = []
    where: dict[str, int] = {}
    placed: list = []
    if kv_layout_generation() == "per-layer":
        packed = None
        for tensor in tensors:
            if tensor.size % n:
                raise ValueError(f"a KV region of {tensor.size} bytes is not {n} equal pages")
            if tensor.block_stride > 0:
                if packed is None:
                    packed = len(regions)
                    regions.append(KvRegion(0, tensor.size // n))
                index = packed
            else:
                index = len(regions)
                regions.append(KvRegion(0, tensor.size // n))
            placed.append((tensor, index))
            for name in tensor.shared_by:
                where[name] = index
        return regions, where, placed
    found: dict[str, KvRegion] = {}
    firsts: list[KvRegion] = []
    for tensor in tensors:
        if getattr(tensor, "host_resident", False):
            raise ValueError("a host-resident KV cache tensor (HiSparse) has no GPU region")
        stride = tensor.block_stride
        pages = _page_bytes(kv_cache_config, tensor.layers[0])
        layer_outer = tensor.layer_stride >= n * stride
        if stride < pages * (1 if layer_outer else len(tensor.layers)):
            raise ValueError(f"the KV cache of {tensor.layers[0]} is not block-major (a block "
                             f"stride of {stride} bytes for pages of {pages}: heads outside "
                             f"blocks); use a layout with blocks outside heads (e.g. "
                             f"VLLM_KV_CACHE_LAYOUT=LBNHC)")
        if layer_outer:
            for l, name in enumerate(tensor.layers):
                found[name] = KvRegion(tensor.offset + l * tensor.layer_stride, stride)
            firsts.append(KvRegion(tensor.offset, stride))
        else:                                          # block-outermost
            first = KvRegion(tensor.offset - tensor.offset % stride, stride)
            found.update((name, first) for name in tensor.layers)
            firsts.append(first)
    regions = sorted(set(found.values()) | set(firsts), key=lambda r: r.base)
    for a, b in zip(regions, regions[1:]):
        if b.base < a.base + a.stride * n:
            raise ValueError(f"KV regions overlap at byte {b.base} without being one region "
                             f"(a layout the granule mapping cannot serve)")
    index = {r: i for i, r in enumerate(regions)}
    where = {name: index[r] for name, r in found.items()}
    placed = [(tensor, index[first]) for tensor, first in zip(tensors, firsts)]
    return regions, where, placed


def kv_allocation() -> tuple[object, str] | None:
    """``(module, name)`` of the V2 model runner's function that turns the KV cache config
    into memory, the one Proxima's elastic allocation replaces; None when this vLLM has
    neither.

    0.26: ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache(kv_cache_config,
    shared_layers, device)`` -> layer name -> one raw int8 tensor per ``KVCacheTensor``
    (the backend's views are taken after it, by ``_reshape_kv_cache``).
    0.33: ``allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)``, as
    ``attn_utils`` imported it from ``vllm.v1.worker.utils`` -> layer name -> the layer's
    ``[B, H, N, C]`` view of one backing allocation (``create_kv_cache_views``)."""
    try:
        attn_utils = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
    except ImportError:
        return None
    for name in ("_allocate_kv_cache", "allocate_kv_cache"):
        if callable(getattr(attn_utils, name, None)):
            return attn_utils, name
    return None


def vmm_kv_allocation(name: str, make_memory):
    """Proxima's replacement for :func:`kv_allocation`'s function ``name`` (same arguments,
    same result), over the :class:`proxima.memory.kv.KvMemory` that ``make_memory(
    kv_cache_config, device)`` reserves for :func:`kv_regions`' regions."""
    if name == "_allocate_kv_cache":
        def _allocate_kv_cache(kv_cache_config, shared_layers, device):
            import torch

            memory = make_memory(kv_cache_config, device)
            _, where = kv_regions(kv_cache_config)
            raw = [t.view(torch.int8) for t in memory.tensors()]
            tensors = {layer: raw[i] for layer, i in where.items()}
            layer_names = {n for group in kv_cache_config.kv_cache_groups
                           for n in group.layer_names}
            assert layer_names == (tensors.keys() | shared_layers.keys()), (
                "Some layers are not correctly initialized")
            return tensors

        hook = _allocate_kv_cache
    else:
        def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
            if not kv_cache_config.kv_cache_tensors:
                return {}
            memory = make_memory(kv_cache_config, device)
            backing = memory.backing()
            offsets = [b - memory.arena.base for b in memory.arena.region_base]
            return kv_views(backing, offsets, kv_cache_config, layout, kernel_block_sizes)

        hook = allocate_kv_cache
    hook.proxima_vmm = True
    return hook


def kv_views(backing, region_offsets: list[int], kv_cache_config, layout,
             kernel_block_sizes=None) -> dict:
    """0.33: layer name -> the layer's ``[B, H, N, C]`` view, as vLLM's
    ``allocate_kv_cache`` makes them (``create_kv_cache_views``), over ``backing`` (one int8
    or uint8 tensor) in which region ``i`` of :func:`kv_region_layout` starts at byte
    ``region_offsets[i]`` instead of at its ``base``: each ``KVCacheTensor``'s ``offset``
    (and, layer-outermost, its ``layer_stride``) is moved there; the block stride, the
    page and the backend's layout are vLLM's. Pure torch views: runs on CPU tensors."""
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    regions, where, placed = kv_region_layout(kv_cache_config)
    raw = backing.view(torch.int8) if backing.dtype != torch.int8 else backing
    views: dict = {}
    for tensor, first in placed:
        layers = tensor.layers
        group_id, group = next((i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if layers[0] in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layers[0]]
        if not spec.has_layer_views:
            raise ValueError(f"layer {layers[0]}'s KV cache ({type(spec).__name__}) has no "
                             f"per-layer view; elastic KV maps per-layer pages only")
        offset = region_offsets[first] + tensor.offset - regions[first].base
        layer_stride = tensor.layer_stride
        if len(layers) > 1 and where[layers[1]] != first:       # layer-outermost
            at = [where[n] for n in layers]
            steps = {region_offsets[b] - region_offsets[a] for a, b in zip(at, at[1:])}
            if at != list(range(first, first + len(layers))) or len(steps) != 1:
                raise ValueError(f"the layers of {layers[0]}'s KV cache tensor are not "
                                 f"evenly spaced regions (a layout elastic KV cannot view)")
            layer_stride = steps.pop()
        moved = dataclasses.replace(tensor, offset=offset, layer_stride=layer_stride,
                                    size=raw.numel())
        kernel = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group_id]
        views.update(zip(layers, create_kv_cache_views(
            raw, spec, kv_cache_config.num_blocks_of(tensor), layout, moved,
            kernel_block_size=kernel)))
    return views


def kernel_blocks_per_block(runner) -> set[int]:
    """Entries per vLLM block in the V2 runner's persistent block tables (KV compaction's
    table writes): 0.26 expands a block into ``BlockTables.blocks_per_kv_block`` kernel
    blocks per group; 0.33 keeps the manager's block ids there (kernel blocks are views,
    ``map_kv_caches_to_kernel_blocks``), one entry each."""
    per = getattr(runner.block_tables, "blocks_per_kv_block", None)
    return set(per) if per is not None else {1}


def warmup_request_tokens(vllm_config, decode_query_len: int) -> int:
    """Tokens whose KV blocks each request of vLLM's ``warmup_kernels`` holds at most
    (``v1/worker/gpu/warmup.py``; :func:`proxima.vllm.elastic_v1.warmup_blocks` counts
    its block ids). 0.26: a prefill of ``decode_query_len + 1`` tokens and one decode step
    of ``decode_query_len``. 0.33: up to 3 decode steps (5 with speculative decoding) and
    the drafter's lookahead slots (``VllmConfig.num_lookahead_tokens``, the property
    0.33 added), at most ``max_model_len`` -- for a model without speculative decoding
    at 16 tokens a block, one block either way. Told apart by ``vllm_config``'s class
    (no import: the replay's start-up check passes a stand-in, counted as 0.26's)."""
    prompt_len = decode_query_len + 1
    if not hasattr(type(vllm_config), "num_lookahead_tokens"):      # 0.26, or a stand-in
        return prompt_len + decode_query_len
    steps = 5 if decode_query_len > 1 else 3
    tokens = prompt_len + steps * decode_query_len
    tokens += getattr(vllm_config, "num_lookahead_tokens", 0) or 0
    max_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    return min(tokens, max_len) if max_len else tokens
