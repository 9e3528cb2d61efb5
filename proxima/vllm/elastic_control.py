"""The scheduler side of elastic KV memory: the one place that orders policy and compaction.

:class:`ElasticController` is built by the KV connector once the pool places by granule
(:meth:`proxima.vllm.elastic_connector.ProximaElasticConnector.bind_gpu_block_pool`,
policy ``auto`` or ``fixed``) and stepped from its ``build_connector_meta``, at the end of
``Scheduler.schedule`` after the step's allocations. One step, in this order:

1. KV compaction (when on) reads what the step's output pins, then plans and applies its
   moves on the scheduler's structures (:class:`~proxima.vllm.compaction_v1.Compactor`);
2. the step's allocations are counted: the reserve is twice the most blocks one of the last
   64 steps allocated (two steps may be in flight with async scheduling);
3. the grow/shrink policy steps with the GPU's other engines in view
   (:class:`~proxima.memory.sharing.SharedPolicyStep`, policy ``auto``). The policy decides
   and calls nothing above it: a shrink that finds fewer releasable granules than it wants
   stops and returns the shortfall; the controller then asks the compactor to empty that
   many granules (or the ``compactor`` option's callable) and lets the policy release what
   is free now -- in the same step, so what is released and when is what it was when the
   policy called the compactor itself;
4. a :class:`StepHook` from the ``compactor`` option ticks (the tests' forced cycles).

The connector then carries the channel's ops and the compactor's work to the workers.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections import deque
from typing import Callable, Protocol

from proxima.vllm import compaction_v1, elastic_v1
from proxima.errors import UserError
from proxima.memory.policy import GrowShrinkPolicy
from proxima.memory.sharing import SharedPolicyStep

logger = logging.getLogger("vllm.proxima")


def open_gpu_ledger(options, world_size: int = 1):
    """``(ledger, gpu_memory)`` for :class:`~proxima.memory.sharing.SharedPolicyStep`: on a
    GPU, the ledger of the GPU this engine's worker uses (a one-GPU engine: tensor or
    pipeline parallel engines span several and keep none) and NVML's free/total memory of
    it (NVML needs no CUDA context in this, the scheduler's, process); ``(None, None)``
    elsewhere (CPU; the replay sets its stand-in's own). ``options``: the
    :class:`~proxima.vllm.elastic_v1.ElasticOptions`. Any failure is said once and the
    engine runs without (cached blocks then go back after ``cache_hold_s``)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return None, None
        if world_size != 1:
            logger.info("Proxima elastic KV: no GPU ledger for an engine on %d GPUs",
                        world_size)
            return None, None
        from vllm.utils.import_utils import import_pynvml

        from proxima.memory.ledger import Ledger, ledger_path

        nvml = import_pynvml()
        nvml.nvmlInit()                  # kept initialised (NVML counts its inits)
        handle = nvml.nvmlDeviceGetHandleByIndex(
            current_platform.device_id_to_physical_device_id(0))
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid

        def gpu_memory() -> tuple[int, int]:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.free), int(info.total)

        ledger = None
        if options.ledger:
            ledger = Ledger(ledger_path(uuid, options.ledger_dir),
                            model=options.ledger_model or "", port=options.ledger_port or 0,
                            nonkv=options.ledger_nonkv_bytes)
            logger.info("Proxima elastic KV: sharing demand with the GPU's other engines "
                        "through %s", ledger.path)
        return ledger, gpu_memory
    except Exception as exc:            # noqa: BLE001 - the engine serves without it
        logger.warning("Proxima elastic KV: no GPU ledger (%s: %s); cached blocks are "
                       "given back after cache_hold_s only", type(exc).__name__, exc)
        return None, None


class StepHook(Protocol):
    """What the ``compactor`` option's factory may return besides a callable: an object the
    controller drives at every step boundary, after the grow/shrink policy (the tests'
    forced map/unmap cycles: ``tests/support/forced.py``)."""

    def tick(self, step: int, reserve: int, forecast: Callable[[], int]) -> object:
        """``reserve``: blocks the next steps may allocate; ``forecast``: the blocks the
        held requests may still need."""

    def pending(self) -> bool:
        """Work in flight: the engine keeps stepping while True."""

    def stats(self) -> dict:
        """Figures added to the connector's status."""


def load_hook(spec, queue, channel):
    """The ``compactor`` option's object, ``factory(queue, channel, **kwargs)`` (see
    :class:`proxima.vllm.elastic_v1.ElasticOptions`); None when not given."""
    if not spec:
        return None
    kwargs = dict(spec) if isinstance(spec, dict) else {"factory": spec}
    path = kwargs.pop("factory")
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{elastic_v1.CONNECTOR}: compactor {path!r} cannot be loaded "
                        f"({exc}); give module:factory") from None
    try:
        return factory(queue, channel, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{elastic_v1.CONNECTOR}: compactor {path!r}: {exc}") from None


class ElasticController:
    """Orders one scheduler step's elastic work (see the module doc).

    Args:
        options: the connector's :class:`~proxima.vllm.elastic_v1.ElasticOptions`.
        vllm_config, kv_cache_config: the engine's.
        pool: Proxima's block pool; ``queue``: its granule-aware free queue.
        channel: the granule states and the ops to the workers.
        bytes_per_granule: memory of one granule (all layers).
        composed: Proxima's connector sits inside vLLM's ``MultiConnector``.
        clock: the policy's clock (the replay sets a fake one on the connector).
    """

    def __init__(self, options, vllm_config, kv_cache_config, pool, queue, channel,
                 bytes_per_granule: int, composed: bool,
                 clock: Callable[[], float]) -> None:
        self.options = options
        self.pool = pool
        self.queue = queue
        self.channel = channel
        self.policy: GrowShrinkPolicy | None = None
        self.shared: SharedPolicyStep | None = None   # the policy stepped with the ledger
        self.step_hook: StepHook | None = None
        self._last_allocated = 0
        self._step_allocs: deque[int] = deque(maxlen=64)
        # --- KV compaction (issue 14): None when off
        self.compactor = compaction_v1.scheduler_side(
            vllm_config, kv_cache_config, pool, channel, options.compaction, composed)
        # ---
        hook = load_hook(options.compactor, queue, channel)
        #: ``fn(queue, granules_wanted) -> granules emptied``, asked when a shrink finds too
        #: few releasable granules (None: the policy releases what it finds)
        self.empty: Callable[[object, int], int] | None = None
        if options.policy == "auto":
            if callable(hook):
                self.empty = hook
            elif self.compactor is not None:   # KV compaction empties granules on demand
                self.empty = self.compactor.empty_granules
            self.policy = GrowShrinkPolicy(
                queue, channel, bytes_per_granule, options.policy_options(), clock=clock,
                forecast=self.forecast, startup_granules=elastic_v1.startup_target(
                    options, vllm_config, kv_cache_config, channel.granule_blocks))
            self.shared = SharedPolicyStep(
                self.policy, *open_gpu_ledger(options, vllm_config.parallel_config.world_size),
                keep_blocks=options.reserve_blocks)
            if self.compactor is not None:       # auto mode packs only what could be released
                self.compactor.pack_gate = self.policy.could_shrink
        if hasattr(hook, "tick"):
            self.step_hook = hook

    def forecast(self) -> int:
        """Blocks the requests the scheduler holds may still need (prompt + max_tokens,
        minus what is live): the memory to have before the scheduler runs short."""
        expected = self.pool.proxima.expected_blocks
        return max(0, expected - self.queue.live_blocks()) if expected else 0

    def step_reserve(self) -> int:
        """Twice the most blocks one of the last 64 steps allocated (two steps may be in
        flight with async scheduling)."""
        return 2 * max(self._step_allocs, default=0)

    def step(self, scheduler_output, step: int) -> None:
        """One step boundary (``step``: the connector's count), in the module's order."""
        compactor = self.compactor
        if compactor is not None:
            # plan and apply on the scheduler's structures now, before the step's output
            # leaves and before the policy runs (its shrink may want granules emptied)
            compactor.begin_step(self.pool.proxima.kv_manager, scheduler_output)
            compactor.step()
        allocated = self.queue.allocated_total
        self._step_allocs.append(allocated - self._last_allocated)
        self._last_allocated = allocated
        if self.policy is not None:
            reserve = max(self.options.reserve_blocks, self.step_reserve())
            if reserve != self.policy.options.reserve_blocks:    # (a replace validates)
                self.policy.options = dataclasses.replace(self.policy.options,
                                                          reserve_blocks=reserve)
            self.step_policy()
        if self.step_hook is not None:
            self.step_hook.tick(step, self.step_reserve(), self.forecast)

    def step_policy(self) -> None:
        """The policy's step (also between steps, when ``proxima kv`` changes its bounds):
        a shrink short of releasable granules gets them emptied first, then releases."""
        short = self.shared.step(moves=self.empty is not None)
        if short:
            self.empty(self.queue, short)
            self.shared.finish_shrink()
