"""Elastic KV memory inside vLLM 0.26 (V1 engine, V2 model runner): the thin part.

Two hooks, nothing else patched:

1. **Configuration** (front end): with ``PROXIMA_ELASTIC=1`` (beside ``PROXIMA_ALLOCATOR=1``)
   :func:`activate` wraps ``EngineArgs.create_engine_config`` so the engine's
   ``kv_transfer_config`` names Proxima's KV connector
   (:mod:`proxima.engines.elastic_connector`), composed with the user's connector through
   vLLM's ``MultiConnector`` when there is one. The connector is the channel that carries
   map/unmap ops from the scheduler to the workers before each forward (see its module).
   The same thing can be configured by hand, without the plugin::

       --kv-transfer-config '{"kv_connector": "ProximaElasticConnector",
           "kv_connector_module_path": "proxima.engines.elastic_connector",
           "kv_role": "kv_producer"}'

2. **Allocation** (each worker): the connector's worker side, which vLLM builds before
   the KV cache (``gpu_worker.initialize_from_config``), installs
   :func:`_allocate_kv_cache_vmm` in place of ``vllm.v1.worker.gpu.attn_utils.
   _allocate_kv_cache``. That is the right place, and the only one: it is the one
   function of the V2 runner (``initialize_kv_cache`` -> ``init_kv_cache`` ->
   ``_allocate_kv_cache``) that turns the KV cache config's byte sizes into memory -- one
   raw int8 tensor per ``KVCacheTensor``. Everything after it (the backend's layout views
   in ``_reshape_kv_cache``, binding to the attention layers, connector registration,
   CUDA-graph capture, vLLM's own block zeroing and copy-on-write copies) takes views of
   what it returns. Backing those tensors with a reserved virtual range changes where the
   bytes live and nothing else: no shape, stride or kernel. Hooking higher
   (``initialize_kv_cache``) would copy vLLM's reshape logic; lower (torch's allocator)
   would touch every allocation. vLLM's V1 model runner allocates elsewhere and is not
   supported (the connector refuses to start on it).

What warm-up and capture touch (vLLM 0.26): ``profile_run`` runs before the KV cache
exists. ``_dummy_run`` (compile sizes, CUDA-graph capture) fills every slot mapping with
``PAD_SLOT_ID`` (no KV writes) and reads through the persistent block tables, all zeros at
start-up (block 0, the null block, which is never unmapped). ``warmup_kernels`` then runs
real steps writing block ids from 1 up to about ``max_num_seqs`` -- so the whole pool is
mapped at start-up, and the scheduler's first step may release granules
(``initial_granules``). CUDA graphs capture virtual addresses, which never move, so they
replay correctly whatever is mapped under the blocks they do not touch. Later dummy runs
(data-parallel ranks with no work) read stale block ids and are why elastic mode refuses
``data_parallel_size > 1``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from proxima.engines import activation
from proxima.errors import UserError

logger = logging.getLogger("vllm.proxima")

ENV = activation.ELASTIC_ENV
CONNECTOR = "ProximaElasticConnector"
CONNECTOR_MODULE = "proxima.engines.elastic_connector"


def enabled(environ: dict | None = None) -> bool:
    """True when ``PROXIMA_ELASTIC=1`` (0 / unset: off; anything else: ActivationError);
    the variable is declared with the others in :mod:`proxima.engines.activation`."""
    return activation.elastic(environ)


# ----------------------------------------------------------------------------- options

@dataclass(frozen=True)
class ElasticOptions:
    """The connector's ``kv_connector_extra_config`` (same dict on both sides).

    ``granule_bytes``: the mapping grain per region (a multiple of the GPU's granularity).
    ``initial_granules``: granules left mapped after start-up (None: all).
    ``force_cycle_every`` / ``force_cycle_hold`` / ``force_cycle_granules``: a test policy
    that every N steps releases up to ``granules`` free granules and maps them back ``hold``
    steps later (0: off). ``stats_file``: where the scheduler side writes its counters
    (JSON). ``verify``: check every step that no new block lies in an unmapped granule.
    ``compaction``: KV compaction's settings (:class:`proxima.engines.compaction_v1.
    CompactionOptions`; None: ``PROXIMA_COMPACTION`` and the defaults).
    """

    granule_bytes: int = 2 << 20
    initial_granules: int | None = None
    force_cycle_every: int = 0
    force_cycle_hold: int = 2
    force_cycle_granules: int = 4
    stats_file: str | None = None
    verify: bool = True
    compaction: dict | None = None

    @classmethod
    def from_extra(cls, extra: dict | None) -> "ElasticOptions":
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise UserError(f"{CONNECTOR}: unknown option(s) {', '.join(unknown)} in "
                            f"kv_connector_extra_config; known: {', '.join(sorted(names))}")
        opts = cls(**extra)
        for name in ("granule_bytes", "force_cycle_hold", "force_cycle_granules"):
            value = getattr(opts, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{CONNECTOR}: {name} must be a positive integer, got "
                                f"{value!r}")
        if not isinstance(opts.force_cycle_every, int) or opts.force_cycle_every < 0:
            raise UserError(f"{CONNECTOR}: force_cycle_every must be 0 (off) or a number of "
                            f"steps, got {opts.force_cycle_every!r}")
        if opts.initial_granules is not None and (
                not isinstance(opts.initial_granules, int) or opts.initial_granules < 1):
            raise UserError(f"{CONNECTOR}: initial_granules must be at least 1 (granule 0 "
                            f"holds the null block), got {opts.initial_granules!r}")
        return opts


def connector_config(extra: dict | None = None) -> dict:
    """The ``KVTransferConfig`` fields that select Proxima's connector.

    ``kv_producer``, not ``kv_both``: vLLM defers freeing blocks for a *consumer* role
    under async scheduling, which would change scheduling; this connector loads nothing.
    """
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer", "kv_connector_extra_config": dict(extra or {})}


def with_elastic_connector(ktc):
    """``ktc`` (a vLLM ``KVTransferConfig``, a dict or None) with Proxima's connector in it:
    alone, already there, prepended to a ``MultiConnector``'s list, or composed with the
    user's connector in a new ``MultiConnector`` (Proxima's first, so its maps are applied
    before another connector loads KV into fresh blocks)."""
    from vllm.config import KVTransferConfig

    ours = connector_config()
    if ktc is None:
        return KVTransferConfig(**ours)
    if isinstance(ktc, dict):
        ktc = KVTransferConfig(**ktc)
    if ktc.kv_connector == CONNECTOR:
        return ktc
    if ktc.kv_connector == "MultiConnector":
        children = list(ktc.kv_connector_extra_config.get("connectors", []))
        if any(c.get("kv_connector") == CONNECTOR for c in children):
            return ktc
        extra = dict(ktc.kv_connector_extra_config, connectors=[ours, *children])
        return dataclasses.replace(ktc, kv_connector_extra_config=extra)
    # A MultiConnector child must not carry engine_id (MultiConnector passes its own).
    theirs = {f.name: getattr(ktc, f.name) for f in dataclasses.fields(ktc)
              if f.name != "engine_id"}
    return KVTransferConfig(kv_connector="MultiConnector", kv_role=ktc.kv_role,
                            engine_id=ktc.engine_id,
                            kv_load_failure_policy=ktc.kv_load_failure_policy,
                            kv_connector_extra_config={"connectors": [ours, theirs]})


# ----------------------------------------------------------------------------- patching

_saved: list[tuple[object, str, object]] = []


def _patch(owner, name: str, value) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def is_active() -> bool:
    return bool(_saved)


def unsupported_reason() -> str | None:
    """Why this vLLM cannot run elastic KV memory, or None when it can.

    The one place that knows which KV allocation the hook understands: vLLM 0.26's V2 model
    runner, where ``attn_utils._allocate_kv_cache`` makes one raw buffer per
    ``KVCacheTensor(size, shared_by)``. vLLM 0.33 replaced that with one backing allocation
    described by ``KVCacheTensor(size, layers, offset, layer_stride, block_stride)``; the hook
    has not been ported to it (Proxima's allocator itself runs there unchanged)."""
    import dataclasses

    import vllm
    from vllm.v1.kv_cache_interface import KVCacheTensor

    try:
        import vllm.v1.worker.gpu.attn_utils as attn_utils
    except ImportError:
        attn_utils = None
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)} \
        if dataclasses.is_dataclass(KVCacheTensor) else set()
    if attn_utils is None or not hasattr(attn_utils, "_allocate_kv_cache") \
            or "shared_by" not in fields:
        return (f"{ENV}=1 needs the KV allocation of vLLM 0.26's V2 model runner (one buffer "
                f"per KVCacheTensor(size, shared_by)); vLLM {vllm.__version__} allocates its "
                f"KV cache differently: run elastic KV on vLLM 0.26.0, or unset {ENV}")
    return None


def activate() -> None:
    """Route every engine this process configures through Proxima's KV connector."""
    if any(name == "create_engine_config" for _, name, _ in _saved):
        return
    reason = unsupported_reason()
    if reason:
        raise activation.ActivationError(reason)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if getattr(self, "kv_offloading_size", None) is not None:
            # vLLM would then overwrite the connector name with its offloading connector
            raise activation.ActivationError(
                f"{ENV}=1 cannot be combined with --kv-offloading-size: pass the offloading "
                "connector as --kv-transfer-config instead (Proxima composes with it), or "
                f"unset {ENV}")
        self.kv_transfer_config = with_elastic_connector(self.kv_transfer_config)
        return original(self, *args, **kwargs)

    _patch(EngineArgs, "create_engine_config", create_engine_config)
    logger.info("Proxima elastic KV memory: engines get the %s (KV mapped by granules)",
                CONNECTOR)


def deactivate() -> None:
    """Undo every patch of this module (configuration and allocation hooks)."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


# ----------------------------------------------------------------------------- allocation

class _Worker:
    options: ElasticOptions | None = None
    memory = None      # the KvMemory of this worker process, once allocated


def kv_memory():
    """This worker's :class:`proxima.memory.kv.KvMemory` (None before the KV cache)."""
    return _Worker.memory


def install_allocation_hook(options: ElasticOptions) -> None:
    """Make vLLM's V2 model runner allocate its KV tensors in a VMM range (idempotent)."""
    import vllm.v1.worker.gpu.attn_utils as attn_utils

    _Worker.options = options
    if attn_utils._allocate_kv_cache is not _allocate_kv_cache_vmm:
        _patch(attn_utils, "_allocate_kv_cache", _allocate_kv_cache_vmm)


def kv_regions(kv_cache_config) -> tuple[list[int], dict[str, int]]:
    """vLLM's ``KVCacheTensor`` list as region sizes and layer name -> region index (the
    packed layout's tensors all alias one backing, as in vLLM's ``_allocate_kv_cache``)."""
    sizes: list[int] = []
    where: dict[str, int] = {}
    packed = None
    for tensor in kv_cache_config.kv_cache_tensors:
        if tensor.block_stride > 0:
            if packed is None:
                packed = len(sizes)
                sizes.append(tensor.size)
            index = packed
        else:
            index = len(sizes)
            sizes.append(tensor.size)
        for name in tensor.shared_by:
            where[name] = index
    return sizes, where


def _allocate_kv_cache_vmm(kv_cache_config, shared_layers, device):
    """vLLM's ``_allocate_kv_cache`` (same arguments, same result: layer name -> raw int8
    tensor of the same size), over one reserved range mapped by granules."""
    import torch

    from proxima.memory.kv import KvMemory

    options = _Worker.options or ElasticOptions()
    sizes, where = kv_regions(kv_cache_config)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # --- KV compaction (issue 14): its scratch granules, past the pool (compaction_v1)
    from proxima.engines.compaction_v1 import CompactionOptions

    compaction = CompactionOptions.resolve(options.compaction)
    spare = compaction.scratch_granules if compaction is not None else 0
    # ---
    memory = KvMemory(sizes, kv_cache_config.num_blocks, granule_bytes=options.granule_bytes,
                      device=index, spare_granules=spare)
    raw = [t.view(torch.int8) for t in memory.tensors()]
    tensors = {name: raw[i] for name, i in where.items()}
    layer_names = {n for group in kv_cache_config.kv_cache_groups for n in group.layer_names}
    assert layer_names == (tensors.keys() | shared_layers.keys()), (
        "Some layers are not correctly initialized")
    _Worker.memory = memory
    logger.info("Proxima elastic KV: %d blocks in %d granules of %d blocks (%.1f MiB each, "
                "%d regions), %.2f GiB reserved, %d granules mapped", memory.num_blocks,
                memory.num_granules, memory.granule_blocks, memory.bytes_per_granule / 2**20,
                len(sizes), memory.arena.reserved_bytes / 2**30, memory.mapped_granules)
    return tensors
