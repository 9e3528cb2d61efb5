"""Proxima behind vLLM 0.6.x's V0 block manager (the card stack: torch 2.4, CUDA 12.1).

The tested version is vLLM **0.6.3.post1**: the last PyPI release built against torch 2.4.0
and CUDA 12.1 (0.6.4 moved to torch 2.5.1 / CUDA 12.4), and the first whose only block
manager is ``SelfAttnBlockSpaceManager`` over the ``BlockAllocator`` interface of
``vllm/core/block/``. nixos-24.11's vLLM 0.6.2 still defaults to ``block_manager_v1``,
which has no such interface, so the Nix flake pins 0.6.3.post1 too.

Where Proxima sits (the data flow of docs/architecture.md, V0 edition)::

    Scheduler -> ProximaBlockSpaceManager (knows the sequence: sets the room hint)
              -> BlockTable (passes the sequence's last block as ``prev_block``)
              -> CpuGpuBlockAllocator -> GPU: ProximaNaiveBlockAllocator or
                                              ProximaPrefixCachingBlockAllocator
                                              (proxima.vllm.vllm_v0_allocators)
                                         CPU (swap space): vLLM's own allocator
              -> proxima.allocator.RunAllocator (block ids only)

V0 already hands every allocation the sequence's previous block (``prev_block``), so
growing in place needs no new plumbing: ``after=prev_block.block_id``. What V0 does not
pass down is how long the sequence will get; the block manager knows it (prompt length +
``max_tokens``) and gives it to the GPU allocator (``room_hint``, ``room_source``), so a
new run is placed where it can keep growing.

Semantics kept from vLLM (the scheduler cannot tell the difference):

* the free count is stock's (truly free + evictable cached blocks), so every admission,
  preemption and swap decision is the same; an allocation never fails while stock's would
  succeed;
* ref counts, copy-on-write (``cow_block_if_not_appendable``), forks, swap in/out, the
  null block of sliding windows: vLLM's own code, only the block ids differ;
* prefix caching: cached blocks stay reusable after free and are evicted in the
  evictor's LRU order, only when no truly free block is left (reserved room counts as
  free, see :class:`~proxima.vllm.vllm_v0_allocators.ProximaNaiveBlockAllocator`),
  exactly as many as stock evicts. One difference in *when*, never *which*: a prompt's
  cache hits are all taken before its misses are placed (stock interleaves them, so a
  miss can evict a block that a later block of the same prompt would have hit); the
  misses then get their ids at once, so the blocks evicted for them, often one old
  sequence's run, are reused as a run.
  Decode growth that needs eviction takes the one evicted id: in a pool full of cached
  blocks (the ``pressure`` replay) contiguity is therefore no better than stock's; an
  eviction-ahead variant was measured and lost prefix hits (docs/card-stack.md).

Activation: ``PROXIMA_ALLOCATOR=1`` makes the package's ``vllm.general_plugins`` entry
point (``proxima.vllm.plugin:register``) call :func:`activate` in every vLLM process.
It replaces one attribute, ``vllm.core.block_manager.SelfAttnBlockSpaceManager`` (the
scheduler looks it up there when it is built), and :func:`deactivate` puts it back.

This module (the block manager and the activation) and
:mod:`proxima.vllm.vllm_v0_allocators` (the GPU allocators) import vLLM's V0 block
modules; import them only under vLLM 0.6.x.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Optional

from proxima.vllm import activation, patches
from proxima.vllm import status as _status
from proxima.vllm.activation import ActivationError
from proxima.vllm.contiguity import ids_per_run
from proxima.vllm.vllm_v0_allocators import IMPORT_ERROR as _ALLOCATORS_IMPORT_ERROR
from proxima.vllm.vllm_v0_allocators import ProximaCpuGpuBlockAllocator

LOG_LINE = activation.LOG_LINE
ENGINE = "vllm-v0"

# Under vLLM's own "vllm" logger, so the line shows in `vllm serve`'s output with vLLM's
# format (vLLM configures only that logger; it does not propagate to the root).
logger = logging.getLogger("vllm.proxima")

try:
    import vllm
    import vllm.core.block_manager as _block_manager
    from vllm.core.block.prefix_caching_block import (ComputedBlocksTracker,
                                                      LastAccessBlocksTracker)
    from vllm.core.block_manager import SelfAttnBlockSpaceManager
    from vllm.sequence import Sequence, SequenceGroup, SequenceStatus
    _IMPORT_ERROR: Optional[BaseException] = _ALLOCATORS_IMPORT_ERROR
except ImportError as exc:  # another vLLM generation: activate() explains, nothing else runs
    _IMPORT_ERROR = exc
    SelfAttnBlockSpaceManager = object  # type: ignore


# ------------------------------------------------------------------------ block manager


class ProximaBlockSpaceManager(SelfAttnBlockSpaceManager):
    """vLLM 0.6.3's ``SelfAttnBlockSpaceManager`` with Proxima's GPU allocator.

    It knows each sequence's expected length (prompt + ``max_tokens``) and gives the GPU
    allocator the room the sequence still needs: as ``room_hint`` around allocate and
    swap in, and through ``room_source`` (asked only when ids are handed out) for the
    decode appends, so new runs are placed with room to grow. Everything else is vLLM's.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, sliding_window: Optional[int] = None,
                 enable_caching: bool = False) -> None:
        # SelfAttnBlockSpaceManager.__init__ of vLLM 0.6.3.post1, building Proxima's
        # allocator instead of stock's (tests/vllm_v0 checks the attributes match).
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.sliding_window = sliding_window
        self.max_block_sliding_window = None
        if sliding_window is not None:
            self.max_block_sliding_window = sliding_window // block_size + 2
        self.watermark = watermark
        assert watermark >= 0.0
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_allocator = ProximaCpuGpuBlockAllocator.create(
            allocator_type="prefix_caching" if enable_caching else "naive",
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            block_size=block_size)
        self.block_tables = {}
        self.cross_block_tables = {}
        self._computed_blocks_tracker = ComputedBlocksTracker(self.block_allocator)
        self._last_access_blocks_tracker = LastAccessBlocksTracker(self.block_allocator)

        from vllm.utils import Device
        self.gpu_allocator = self.block_allocator._allocators[Device.GPU]
        self._expected_blocks: dict[int, int] = {}     # seq_id -> blocks at max_tokens
        self._decoding: Optional[Sequence] = None      # the sequence append_slots serves
        self.gpu_allocator.room_source = self._decode_room
        self._status = _status.StatusWriter()
        logger.info("%s: %d GPU blocks, block size %d (vLLM %s, V0 block manager, "
                    "prefix caching %s)", LOG_LINE, num_gpu_blocks, block_size,
                    vllm.__version__, "on" if enable_caching else "off")
        self._maybe_write_status(force=True, check=True)

    # -- room hints

    def _expect(self, seq_group: SequenceGroup, seqs) -> None:
        params = seq_group.sampling_params
        max_tokens = getattr(params, "max_tokens", None) or 0
        size = self.block_size
        for seq in seqs:
            self._expected_blocks[seq.seq_id] = -(-(seq.get_prompt_len() + max_tokens) // size)

    def _room(self, seq: Sequence) -> Optional[int]:
        """Blocks ``seq`` still expects to need beyond those in its table."""
        expected = self._expected_blocks.get(seq.seq_id)
        table = self.block_tables.get(seq.seq_id)
        have = len(table.blocks) if table is not None else 0
        return expected - have if expected and expected > have else None

    def _decode_room(self) -> Optional[int]:
        seq = self._decoding
        return None if seq is None else self._room(seq)

    # -- BlockSpaceManager

    def allocate(self, seq_group: SequenceGroup) -> None:
        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        self._expect(seq_group, waiting)
        self.gpu_allocator.room_hint = self._room(waiting[0])
        try:
            super().allocate(seq_group)
        finally:
            self.gpu_allocator.room_hint = None
        self._maybe_write_status()

    def append_slots(self, seq: Sequence, num_lookahead_slots: int):
        # The hot path (every running sequence, every step): only note the sequence; its
        # room is worked out if, and only if, the allocator hands out ids.
        self._decoding = seq
        return SelfAttnBlockSpaceManager.append_slots(self, seq, num_lookahead_slots)

    def swap_in(self, seq_group: SequenceGroup):
        # Sequences of one group are swapped in one after the other; the hint is the
        # first's, and each later one places its own first block (fine: hints only steer).
        seqs = seq_group.get_seqs(status=SequenceStatus.SWAPPED)
        if seqs:
            self.gpu_allocator.room_hint = self._room(seqs[0])
        try:
            return super().swap_in(seq_group)
        finally:
            self.gpu_allocator.room_hint = None

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        super().fork(parent_seq, child_seq)
        if parent_seq.seq_id in self._expected_blocks:
            self._expected_blocks[child_seq.seq_id] = self._expected_blocks[parent_seq.seq_id]

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        if self._decoding is seq:
            self._decoding = None
        if seq.is_finished():
            self._expected_blocks.pop(seq.seq_id, None)

    # -- statistics

    def proxima_stats(self) -> dict:
        """The allocator's statistics plus the running sequences' contiguity."""
        per_seq = [v for v in (ids_per_run(t.physical_block_ids)
                               for t in self.block_tables.values()) if v is not None]
        evictor = getattr(self.gpu_allocator, "evictor", None)
        return {
            "active": True, "engine": ENGINE, "vllm_version": vllm.__version__,
            "num_blocks": self.num_total_gpu_blocks, "block_size": self.block_size,
            "allocator": self.gpu_allocator.buddy.stats(),
            "num_evictable": evictor.num_blocks if evictor is not None else 0,
            "running_blocks_per_run": per_seq,
        }

    def _maybe_write_status(self, force: bool = False, check: bool = False) -> None:
        """Write the status file (if PROXIMA_STATS_FILE is set); at most once a second.
        Every snapshot carries the last verdict on the buddy allocator's invariants
        (``invariants_ok``), checked on the live pool now when ``check`` and otherwise at
        most once a minute, as the V1 adapter does; the self-check of ``proxima serve``
        and ``proxima_invariants_ok`` read it."""
        self._status.publish(self.proxima_stats, self.gpu_allocator.buddy, force=force,
                             check=check)


# ------------------------------------------------------------------------- activation

PATCHES = "v0"          # the name of this adapter's patch set (proxima.vllm.patches)
MANAGER = "SelfAttnBlockSpaceManager"   # the attribute of vllm.core.block_manager replaced


def _require_block_manager() -> None:
    """The V0 block manager's presence (after the version gate): ActivationError if not."""
    if _IMPORT_ERROR is not None:
        raise ActivationError(
            f"this vLLM has no V0 block manager that Proxima knows "
            f"(vllm.core.block_manager.SelfAttnBlockSpaceManager, vLLM 0.6.3+ V0): "
            f"{_IMPORT_ERROR}")


def _patches() -> list:
    _require_block_manager()
    return [patches.Patch(_block_manager, MANAGER, ProximaBlockSpaceManager)]


def is_active() -> bool:
    """Whether Proxima's block manager is installed in vLLM."""
    return patches.is_applied(PATCHES)


def stock_manager_class() -> type:
    """vLLM's own block manager class, whether or not Proxima's is installed."""
    return patches.original(_block_manager, MANAGER)


def activate() -> None:
    """Put Proxima behind vLLM 0.6.x's block manager (idempotent).

    Installs :class:`ProximaBlockSpaceManager` as
    ``vllm.core.block_manager.SelfAttnBlockSpaceManager``; schedulers built afterwards use
    it (each logs ``Using Proxima contiguous allocator: N GPU blocks, block size B ...``
    once). An untested vLLM without ``PROXIMA_ALLOW_UNTESTED_VLLM=1``, or a vLLM without
    the V0 block manager, raises :class:`proxima.vllm.activation.ActivationError` and
    changes nothing. Whether Proxima is wanted at all (``PROXIMA_ALLOCATOR``) is the
    caller's question: the plugin asks it. The same contract as the V1 adapter's."""
    if patches.is_applied(PATCHES):
        return
    patches.apply(patches.PatchSet(PATCHES, "v0", _patches))
    logger.info("Proxima: vLLM %s V0 block manager replaced", vllm.__version__)


def deactivate() -> None:
    """Put vLLM's own block manager back (schedulers built earlier keep theirs)."""
    patches.restore(PATCHES)


@contextmanager
def block_manager_class(proxima: bool) -> Iterator[type]:
    """For building one scheduler with (or without) Proxima whatever the global state:
    within the block, ``vllm.core.block_manager.SelfAttnBlockSpaceManager`` is Proxima's
    class or vLLM's; afterwards it is what it was. Proxima's is subject to the same checks
    as :func:`activate`."""
    if proxima or _IMPORT_ERROR is not None:
        patches.gate("v0")
        _require_block_manager()
    cls = ProximaBlockSpaceManager if proxima else stock_manager_class()
    with patches.swapped(_block_manager, MANAGER, cls):
        yield cls
