"""Elastic KV memory inside vLLM 0.26 and 0.33 (V1 engine, V2 model runner): the thin part.

Two hooks, nothing else patched:

1. **Configuration** (front end): with ``PROXIMA_ELASTIC=1`` (beside ``PROXIMA_ALLOCATOR=1``)
   :func:`activate` wraps ``EngineArgs.create_engine_config`` so the engine's
   ``kv_transfer_config`` names Proxima's KV connector
   (:mod:`proxima.vllm.elastic_connector`), composed with the user's connector through
   vLLM's ``MultiConnector`` when there is one. The connector is the channel that carries
   map/unmap ops from the scheduler to the workers before each forward (see its module).
   The same thing can be configured by hand, without the plugin::

       --kv-transfer-config '{"kv_connector": "ProximaElasticConnector",
           "kv_connector_module_path": "proxima.vllm.elastic_connector",
           "kv_role": "kv_producer"}'

2. **Allocation** (each worker): the connector's worker side, which vLLM builds before the
   KV cache (``gpu_worker.initialize_from_config``), installs a function over
   :func:`_vmm_memory` in place of ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache``
   (0.26; in 0.33 ``allocate_kv_cache``, which also takes the views:
   :func:`proxima.vllm.vllm_v1_compat.vmm_kv_allocation`). That is the right place, and
   the only one: it is the one function of the V2 runner (``initialize_kv_cache`` ->
   ``init_kv_cache`` -> ``_allocate_kv_cache``) that turns the KV cache config's byte sizes
   into memory -- one raw int8 tensor per ``KVCacheTensor``. Everything after it (the
   backend's layout views in ``_reshape_kv_cache``, binding to the attention layers,
   connector registration, CUDA-graph capture, vLLM's own block zeroing and copy-on-write
   copies) takes views of what it returns. Backing those tensors with a reserved virtual
   range changes where the bytes live and nothing else: no shape, stride or kernel. Hooking
   higher (``initialize_kv_cache``) would copy vLLM's reshape logic; lower (torch's
   allocator) would touch every allocation. vLLM's V1 model runner allocates elsewhere and
   is not supported (the connector refuses to start on it). On 0.33 the worker side has run
   on CPU only and is refused unless ``PROXIMA_ALLOW_UNPROVEN_ELASTIC=1``
   (:func:`unsupported_reason`).

What warm-up and capture touch (vLLM 0.26): ``profile_run`` runs before the KV cache
exists. ``_dummy_run`` (compile sizes, CUDA-graph capture) fills every slot mapping with
``PAD_SLOT_ID`` (no KV writes) and reads through the persistent block tables, all zeros at
start-up (block 0, the null block, which is never unmapped). ``warmup_kernels`` then runs
real steps writing block ids from 1 up to about ``max_num_seqs`` -- so the workers map
those granules and the initial size at start-up (:func:`startup_granules`, computed from
the same configs on both sides), and the scheduler releases what is above the initial size
before the first request. CUDA graphs capture virtual addresses, which never move, so they
replay correctly whatever is mapped under the blocks they do not touch. Later dummy runs
(data-parallel ranks with no work) read stale block ids and are why elastic mode refuses
``data_parallel_size > 1``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from proxima import config
from proxima.vllm import activation, patches
from proxima.errors import UserError
from proxima.memory.policy_options import PolicyOptions

logger = logging.getLogger("vllm.proxima")

ENV = activation.ELASTIC_ENV
CONNECTOR = "ProximaElasticConnector"
CONNECTOR_MODULE = "proxima.vllm.elastic_connector"


def enabled(environ: dict | None = None) -> bool:
    """True when ``PROXIMA_ELASTIC=1`` (0 / unset: off; anything else: ActivationError);
    the variable is declared with the others in :mod:`proxima.vllm.activation`."""
    return activation.elastic(environ)


# ----------------------------------------------------------------------------- options

POLICIES = config.ELASTIC_POLICIES
_POLICY = PolicyOptions()          # the grow/shrink defaults: one place (proxima.memory.policy)


@dataclass(frozen=True)
class ElasticOptions:
    """The connector's ``kv_connector_extra_config`` (same dict on both sides), also read
    from ``PROXIMA_ELASTIC_OPTIONS`` (``key=value,key=value`` or a JSON object) when the
    plugin configures the connector. Sizes take a unit (``2GiB``, ``512MiB``, ``8GB``).

    ``policy``: ``auto`` (the default: the pool places by granule and the memory grows and
    shrinks with the load, :mod:`proxima.memory.policy`), ``fixed`` (placement by granule,
    the whole pool mapped) or ``off`` (item 1: the whole
    pool mapped, the pool unchanged; the channel carries other ops only).
    ``min_bytes`` / ``max_bytes`` (None: the whole pool) bound the mapped KV memory;
    ``initial_bytes`` (None, policy ``auto``: what vLLM's warm-up mapped, grown at the
    first step to twice what it writes within the GPU's free memory,
    :func:`startup_target`; else ``min_bytes``) what is mapped after start-up (at least
    ``min_bytes``; above the minimum it is excess as any: the engine steps from
    start-up, gives it to another engine that asks, returns it after ``release_delay_s``
    when no request came); ``headroom``, ``band``, ``reserve_blocks``, ``release_delay_s``,
    ``retry_s``, ``retry_max_s``, ``forecast``: see :class:`proxima.memory.policy.PolicyOptions`.
    ``eviction``: :meth:`proxima.allocator.eviction.EvictionPolicy.parse` (``auto``,
    ``lru``, ``age:N``, ``window:W``). ``compactor``: a hook, ``module:factory`` or
    ``{"factory": "module:factory", ...keyword arguments}``, called as ``factory(queue,
    channel, **kwargs)`` once the pool places by granule (policy ``auto`` or ``fixed``). A
    callable result is the grow/shrink policy's compactor, ``fn(queue, granules_wanted) ->
    emptied``, asked before a shrink that finds too few empty granules (None: KV
    compaction's own when it is on); a result with ``tick`` is driven at every step
    boundary (see :class:`proxima.vllm.elastic_control.StepHook`; the tests' forced
    cycles, ``tests/support/forced.py``).
    ``idle_sleep_s``: while a release waits for its delay in an idle engine, each empty
    step sleeps this long (the engine loop's only wake-up; 0: none).
    ``granule_bytes``: the mapping grain per region (a multiple of the GPU's granularity);
    None (default): :func:`proxima.memory.layout.auto_granule_bytes`, the largest of 32, 16,
    8, 4 and 2 MiB that leaves the pool at least 8 granules (one physical allocation per region and
    granule: a 32 MiB grain maps ~16x faster than 2 MiB, tools/gpu/map_rate.py).
    ``zero_on_map``: zero-fill memory when it is mapped (default true; stock vLLM does not
    zero its KV memory unless its KV cache config needs it, so false is what stock does).
    ``initial_granules``: granules mapped after start-up (overrides ``initial_bytes``).
    ``map_in_background``: workers map and unmap on a thread of their own while the
    forward runs (default true, :mod:`proxima.memory.background`); false applies them
    before the step's forward, which waits for them.
    ``stats_file``: where the scheduler side writes its
    counters (JSON). ``verify``: check every step that no new block lies in an unmapped
    granule.
    ``compaction``: KV compaction's settings (:class:`proxima.vllm.compaction_options.
    CompactionOptions`; None: ``PROXIMA_COMPACTION`` and the defaults).
    ``cache_hold_s``, ``gpu_free_low``: when granules of cached blocks are given back
    (:class:`proxima.memory.policy.PolicyOptions`). ``ledger``: on a GPU, share the
    engines' demand through the GPU's ledger (:mod:`proxima.memory.ledger`; default true);
    ``ledger_dir``: where its file lives (None: ``PROXIMA_LEDGER_DIR``, else ``/dev/shm``).
    ``ledger_model``, ``ledger_port``, ``ledger_nonkv_bytes``: what the ledger says of this
    engine besides its KV memory (the model, the port, the bytes it holds besides KV), for
    ``proxima kv`` and the sizing of engines started later; ``proxima serve`` sets them.
    ``idle_release_s``: an engine idle this long gives back all its KV memory, its
    minimum included, and grows again on its next request (None: never;
    :class:`proxima.memory.policy.PolicyOptions`).
    ``sleep_mode``: this engine runs with vLLM's ``--enable-sleep-mode`` beside elastic KV
    (``proxima serve --sleep-mode``, set for a model given ``--sleep-after``): its weights
    go to host memory only once the idle release gave back its KV (``POST /proxima/sleep``;
    needs ``idle_release_s``, policy ``auto``); without it a sleep-mode engine is refused.
    """

    policy: str = "auto"
    min_bytes: int = _POLICY.min_bytes
    max_bytes: int | None = _POLICY.max_bytes
    initial_bytes: int | None = None
    headroom: float = _POLICY.headroom
    band: float = _POLICY.band
    reserve_blocks: int = _POLICY.reserve_blocks
    release_delay_s: float = _POLICY.release_delay_s
    retry_s: float = _POLICY.retry_s
    retry_max_s: float = _POLICY.retry_max_s
    forecast: bool = _POLICY.forecast
    eviction: str = "auto"
    compactor: str | dict | None = None
    idle_sleep_s: float = 0.005
    granule_bytes: int | None = None
    zero_on_map: bool = True
    initial_granules: int | None = None
    map_in_background: bool = True
    stats_file: str | None = None
    verify: bool = True
    compaction: dict | None = None
    cache_hold_s: float = _POLICY.cache_hold_s
    gpu_free_low: float = _POLICY.gpu_free_low
    ledger: bool = True
    ledger_dir: str | None = None
    idle_release_s: float | None = _POLICY.idle_release_s
    ledger_model: str | None = None
    ledger_port: int | None = None
    ledger_nonkv_bytes: int = 0
    sleep_mode: bool = False

    @classmethod
    def from_extra(cls, extra: dict | None) -> "ElasticOptions":
        """The options of ``extra`` (sizes as bytes or with a unit), checked by the one
        table of :data:`proxima.config.ELASTIC_OPTIONS`; UserError naming a bad one."""
        return cls(**config.elastic_options(dict(extra or {}), CONNECTOR))

    @classmethod
    def from_env(cls, environ: dict | None = None) -> dict:
        """``PROXIMA_ELASTIC_OPTIONS`` as an extra-config dict (validated): empty when
        unset. ``key=value`` pairs are comma-separated; values are JSON where they parse
        (numbers, true/false, null), else strings (sizes with units, policy names)."""
        return dict(activation.read(activation.ELASTIC_OPTIONS_ENV, environ))

    def eviction_policy(self):
        from proxima.allocator.eviction import EvictionPolicy

        return EvictionPolicy.parse(self.eviction)

    def policy_options(self, reserve_blocks: int = 0):
        return PolicyOptions(min_bytes=self.min_bytes, max_bytes=self.max_bytes,
                             headroom=float(self.headroom),
                             reserve_blocks=max(self.reserve_blocks, reserve_blocks),
                             release_delay_s=float(self.release_delay_s),
                             retry_s=float(self.retry_s), retry_max_s=float(self.retry_max_s),
                             forecast=self.forecast,
                             band=float(self.band), cache_hold_s=float(self.cache_hold_s),
                             gpu_free_low=float(self.gpu_free_low),
                             idle_release_s=None if self.idle_release_s is None
                             else float(self.idle_release_s))


def warmup_blocks(vllm_config, kv_cache_config) -> int:
    """The highest block id vLLM's ``warmup_kernels`` (``v1/worker/gpu/warmup.py``)
    writes: ``num_reqs`` requests, each given distinct ids from 1 for every KV cache group
    (prefill of ``decode_query_len + 1`` tokens, then decode steps: the tokens per
    request as :func:`proxima.vllm.vllm_v1_compat.warmup_request_tokens` says for 0.26
    and 0.33). Both sides compute it from the same configs, so the scheduler knows what
    the workers map at start-up."""
    from proxima.vllm.vllm_v1_compat import warmup_request_tokens

    sched = vllm_config.scheduler_config
    spec_config = getattr(vllm_config, "speculative_config", None)
    num_spec = getattr(spec_config, "num_speculative_tokens", 0) or 0 if spec_config else 0
    decode_query_len = 1 + num_spec
    prompt_len = decode_query_len + 1
    decode_len = warmup_request_tokens(vllm_config, decode_query_len)
    per_req = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        block_size = getattr(spec, "block_size", 16)
        per_req += -(-decode_len // block_size) + getattr(spec, "num_speculative_blocks", 0)
    per_req = max(per_req, 1)
    num_reqs = min(sched.max_num_seqs,
                   sched.max_num_batched_tokens // max(prompt_len, decode_query_len),
                   max(1, (kv_cache_config.num_blocks - 1) // per_req))
    return num_reqs * per_req


def startup_granules(options: ElasticOptions, vllm_config, kv_cache_config,
                     granule_blocks: int, bytes_per_granule: int) -> tuple[int, int]:
    """``(mapped at start-up, kept after the first step)`` in granules (always from 0):
    the workers map what warm-up writes and the initial size, the scheduler releases what
    is above the initial size before the first request. With no initial size given
    (policy ``auto``) it keeps what warm-up mapped, and its policy grows from there
    (:func:`startup_target`)."""
    total = -(-kv_cache_config.num_blocks // granule_blocks)
    if options.policy == "off":
        return total, total
    if options.initial_granules is not None:
        initial = options.initial_granules
    elif options.policy == "fixed":
        initial = total
    else:
        size = options.min_bytes if options.initial_bytes is None else options.initial_bytes
        initial = -(-size // bytes_per_granule)
    warm = -(-(warmup_blocks(vllm_config, kv_cache_config) + 1) // granule_blocks)
    initial = min(total, max(1, initial))
    mapped = min(total, max(initial, warm))
    return mapped, mapped if _default_initial(options) else initial


def _default_initial(options: ElasticOptions) -> bool:
    return (options.policy == "auto" and options.initial_granules is None
            and options.initial_bytes is None)


def startup_target(options: ElasticOptions, vllm_config, kv_cache_config,
                   granule_blocks: int) -> int:
    """Granules the policy grows to at its first step, before the first request (0: no
    start-up grow): with no initial size given (policy ``auto``), twice what vLLM's
    warm-up writes, at most the pool (issue 33, the cold start: at its minimum the first
    steps admit against one granule while the load's first grow maps; the first grow
    takes up to two steps to map, as the step reserve counts). The policy asks the GPU
    for no more than it has free (:class:`proxima.memory.policy.GrowShrinkPolicy`); an
    initial size given wins."""
    if not _default_initial(options):
        return 0
    total = -(-kv_cache_config.num_blocks // granule_blocks)
    blocks = warmup_blocks(vllm_config, kv_cache_config)
    return min(total, -(-(2 * blocks + 1) // granule_blocks))


def connector_config(extra: dict | None = None) -> dict:
    """The ``KVTransferConfig`` fields that select Proxima's connector.

    ``kv_producer``, not ``kv_both``: vLLM defers freeing blocks for a *consumer* role
    under async scheduling, which would change scheduling; this connector loads nothing.
    """
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer", "kv_connector_extra_config": dict(extra or {})}


def with_elastic_connector(ktc, extra: dict | None = None):
    """``ktc`` (a vLLM ``KVTransferConfig``, a dict or None) with Proxima's connector in it:
    alone, already there, prepended to a ``MultiConnector``'s list, or composed with the
    user's connector in a new ``MultiConnector`` (Proxima's first, so its maps are applied
    before another connector loads KV into fresh blocks)."""
    from vllm.config import KVTransferConfig

    ours = connector_config(extra)
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

PATCHES = "elastic"     # this module's patch set (proxima.vllm.patches)


def _patch(*patch_list: patches.Patch) -> None:
    patches.apply(patches.PatchSet(PATCHES, "v1", lambda: patch_list))


def is_active() -> bool:
    return patches.is_applied(PATCHES)


def unsupported_reason(side: str = "engine", environ=None) -> str | None:
    """Why this vLLM cannot run elastic KV memory (and so compaction), or None when it can.

    ``side="scheduler"``: the pool, the connector's scheduler side and the compactor, all
    that the CPU replay runs; they need vLLM's KV cache description, which
    :mod:`proxima.vllm.vllm_v1_compat` reads for 0.26 and 0.33 alike. ``side="engine"``
    (a real engine: the plugin, ``proxima serve``, the connector's worker): also the worker
    side, the V2 model runner's KV allocation that :func:`install_allocation_hook` replaces
    (:func:`proxima.vllm.vllm_v1_compat.kv_allocation`), and how far the version table
    says it is proven (:func:`proxima.vllm.activation.unproven_refusal`: refused where it
    has run on CPU only, unless ``PROXIMA_ALLOW_UNPROVEN_ELASTIC=1``)."""
    import vllm

    from proxima.vllm import vllm_v1_compat as compat

    if side not in ("scheduler", "engine"):
        raise ValueError(f"side must be 'scheduler' or 'engine', got {side!r}")
    try:
        compat.kv_layout_generation()
    except Exception:    # noqa: BLE001 - any vLLM without the KV description Proxima reads
        return (f"{ENV}=1 needs vLLM's KVCacheTensor of 0.26 or 0.33 to place granules; vLLM "
                f"{vllm.__version__} describes its KV cache differently: run elastic KV on "
                f"vLLM 0.26.0, or unset {ENV}")
    if side == "scheduler":
        return None
    if compat.kv_allocation() is None:
        return (f"{ENV}=1 needs the KV allocation of vLLM's V2 model runner (0.26's "
                f"attn_utils._allocate_kv_cache or 0.33's allocate_kv_cache); vLLM "
                f"{vllm.__version__} allocates its KV cache differently: run elastic KV on "
                f"vLLM 0.26.0, or unset {ENV}")
    return activation.unproven_refusal(vllm.__version__, f"{ENV}=1", environ)


def _env_options() -> dict:
    """``PROXIMA_ELASTIC_OPTIONS`` now (validated; ActivationError, one line, when bad)."""
    try:
        return ElasticOptions.from_env()
    except UserError as exc:
        raise activation.ActivationError(str(exc)) from None


def activate() -> None:
    """Route every engine this process configures through Proxima's KV connector (with the
    options ``PROXIMA_ELASTIC_OPTIONS`` holds when the engine's config is built, not when
    the plugin loaded: ``proxima serve`` builds vLLM's parser, which loads the plugin,
    before it sizes the engine and writes the sizing into the variable), and give the
    engine core the ``proxima_kv`` utility method (run-time control:
    :func:`engine_core_proxima_kv`)."""
    if patches.is_applied(PATCHES, "create_engine_config"):
        return
    reason = unsupported_reason()
    if reason:
        raise activation.ActivationError(reason)
    extra = _env_options()          # a bad value stops the plugin now, not at the config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if getattr(self, "kv_offloading_size", None) is not None:
            # vLLM would then overwrite the connector name with its offloading connector
            raise activation.ActivationError(
                f"{ENV}=1 cannot be combined with --kv-offloading-size: pass the offloading "
                "connector as --kv-transfer-config instead (Proxima composes with it), or "
                f"unset {ENV}")
        options = _env_options()
        if options != extra:
            logger.info("Proxima elastic KV memory: the engine's connector options %s",
                        options)
        self.kv_transfer_config = with_elastic_connector(self.kv_transfer_config, options)
        return original(self, *args, **kwargs)

    _patch(patches.Patch(EngineArgs, "create_engine_config", create_engine_config),
           *([] if hasattr(EngineCore, UTILITY) else
             [patches.Patch(EngineCore, UTILITY, engine_core_proxima_kv)]))
    logger.info("Proxima elastic KV memory: engines get the %s (KV mapped by granules)%s",
                CONNECTOR, f", options {extra}" if extra else "")


UTILITY = "proxima_kv"


def engine_core_proxima_kv(self, request: dict | None = None) -> dict:
    """vLLM engine-core utility method (``call_utility(_async)("proxima_kv", request)``
    from the API process): the elastic KV status, after applying ``request``
    (``{"min_bytes": int, "max_bytes": int | None}``; empty: just read). Runs in the engine
    loop between steps. Errors come back as ``{"error": "..."}``, never raised."""
    connector = find_connector(getattr(self.scheduler, "connector", None))
    if connector is None:
        return {"error": f"elastic KV memory is not active in this engine (start it with "
                         f"{ENV}=1, or proxima serve --elastic)"}
    return connector.control(request or {})


def find_connector(connector):
    """Proxima's connector: ``connector`` itself, or its child in a MultiConnector."""
    if connector is None:
        return None
    if type(connector).__name__ == CONNECTOR:
        return connector
    for child in getattr(connector, "_connectors", ()):
        if type(child).__name__ == CONNECTOR:
            return child
    return None


def deactivate() -> None:
    """Undo every patch of this module (configuration and allocation hooks)."""
    patches.restore(PATCHES)


# ----------------------------------------------------------------------------- allocation

class _Worker:
    options: ElasticOptions | None = None
    vllm_config = None
    spare_granules = 0  # past the pool: KV compaction's scratch (its settings say how many)
    memory = None      # the KvMemory of this worker process, once allocated


def kv_memory():
    """This worker's :class:`proxima.memory.kv.KvMemory` (None before the KV cache)."""
    return _Worker.memory


def install_allocation_hook(options: ElasticOptions, vllm_config=None,
                            spare_granules: int = 0) -> None:
    """Make vLLM's V2 model runner allocate its KV tensors in a VMM range (idempotent);
    ``spare_granules`` more are reserved past the pool (KV compaction's scratch blocks:
    the connector reads how many from compaction's settings). Which function that replaces
    is :func:`proxima.vllm.vllm_v1_compat.kv_allocation` (0.26 and 0.33 differ)."""
    from proxima.vllm import vllm_v1_compat as compat

    reason = unsupported_reason("engine")      # the runner's allocation, and proven?
    if reason:
        raise UserError(reason)
    site = compat.kv_allocation()
    _Worker.options = options
    _Worker.vllm_config = vllm_config
    _Worker.spare_granules = spare_granules
    owner, name = site
    if not getattr(getattr(owner, name), "proxima_vmm", False):
        _patch(patches.Patch(owner, name, compat.vmm_kv_allocation(name, _vmm_memory)))


def kv_regions(kv_cache_config) -> tuple[list[int], dict[str, int]]:
    """vLLM's KV cache config as block-major region sizes and layer name -> region index
    (:func:`proxima.vllm.vllm_v1_compat.kv_regions`: 0.26's and 0.33's descriptions)."""
    from proxima.vllm.vllm_v1_compat import kv_regions as regions

    return regions(kv_cache_config)


def grain_of(options: ElasticOptions, kv_cache_config) -> int:
    """The mapping grain per region: ``options.granule_bytes``, or when None the automatic
    one for this KV cache (the scheduler and every worker derive the same)."""
    if options.granule_bytes is not None:
        return options.granule_bytes
    from proxima.memory.kv import region_block_strides
    from proxima.memory.layout import auto_granule_bytes

    sizes, _ = kv_regions(kv_cache_config)
    return auto_granule_bytes(region_block_strides(sizes, kv_cache_config.num_blocks),
                              kv_cache_config.num_blocks)


def _vmm_memory(kv_cache_config, device):
    """The :class:`proxima.memory.kv.KvMemory` of this worker's KV cache: one reserved range
    for the regions of ``kv_cache_config``, mapped by granules (what warm-up writes and the
    initial size; the rest on demand). The allocation hook views vLLM's tensors over it."""
    import torch

    from proxima.memory.kv import KvMemory

    options = _Worker.options or ElasticOptions()
    sizes, _ = kv_regions(kv_cache_config)
    grain = grain_of(options, kv_cache_config)
    index = device.index if device.index is not None else torch.cuda.current_device()
    mapped = None
    if _Worker.vllm_config is not None:
        # Only what warm-up writes and the initial size: the rest is mapped on demand, so
        # an engine whose maximum exceeds what is free now can start.
        from proxima.memory.kv import region_block_strides
        from proxima.memory.layout import granule_blocks

        strides = region_block_strides(sizes, kv_cache_config.num_blocks)
        g = granule_blocks(strides, grain)
        mapped, _ = startup_granules(options, _Worker.vllm_config, kv_cache_config, g,
                                     g * sum(strides))
    # A grow leaves gpu_free_low of the GPU free: the forward's activations come from it.
    total = torch.cuda.get_device_properties(index).total_memory
    memory = KvMemory(sizes, kv_cache_config.num_blocks, granule_bytes=grain, device=index,
                      mapped=mapped, zero_on_map=options.zero_on_map,
                      spare_granules=_Worker.spare_granules,
                      keep_free_bytes=int(float(options.gpu_free_low) * total))
    _Worker.memory = memory
    logger.info("Proxima elastic KV: %d blocks in %d granules of %d blocks (%.1f MiB each, "
                "%d regions), %.2f GiB reserved, %d granules mapped", memory.num_blocks,
                memory.num_granules, memory.granule_blocks, memory.bytes_per_granule / 2**20,
                len(sizes), memory.arena.reserved_bytes / 2**30, memory.mapped_granules)
    return memory
