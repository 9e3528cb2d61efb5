"""The grow/shrink policy's vocabulary (:mod:`proxima.memory.policy`): its options, what it
reads of the pool, and its counters. Pure Python (no torch, no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from proxima.config import ELASTIC_OPTIONS


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class PoolView(Protocol):
    """What the policy reads of the block pool (Proxima's elastic free queue has it)."""

    num_free_blocks: int                      # free + cached blocks of mapped granules

    def live_blocks(self) -> int: ...
    def hot_cached_blocks(self) -> int: ...          # cached blocks young enough to be hit
    def releasable(self) -> list[tuple[int, int]]: ...   # (granule, cached), cheapest first
    def num_releasable(self) -> int: ...                 # len(releasable()), cheaply
    def release(self, granules) -> int: ...              # returns cached blocks evicted


@dataclass(frozen=True)
class PolicyOptions:
    """``min_bytes`` / ``max_bytes``: bounds of the mapped KV memory (max None: the whole
    reserved pool); ``headroom``: free fraction of the live blocks kept mapped;
    ``reserve_blocks``: blocks kept free whatever the load (what one step may allocate);
    ``release_delay_s``: how long free memory must be in excess before it is released;
    ``retry_s``: how long after a failed grow the next is tried, doubled after each
    failure in a row up to ``retry_max_s``; ``forecast``: count what
    the held requests may still need (prompt + max_tokens) as wanted free memory;
    ``band``: the hysteresis, a fraction of the mapped granules (at least one granule):
    a grow maps this much beyond what is wanted, a shrink waits for twice this much in
    excess and keeps this much (0: a granule, the rule before the band);
    ``cache_hold_s``: how long granules holding cached blocks are kept once in excess
    while nobody asks for the memory (see the module's release rule; at most
    ``release_delay_s``: the rule before the ledger); ``gpu_free_low``: the share of the
    GPU's memory below which its free memory is short (other processes may be waiting); a
    worker's map also leaves this much free, for the forward's activations
    (:class:`proxima.memory.kv.KvMemory` ``keep_free_bytes``)."""

    min_bytes: int = 0
    max_bytes: int | None = None
    headroom: float = 0.10
    reserve_blocks: int = 0
    release_delay_s: float = 10.0
    retry_s: float = 1.0
    forecast: bool = True
    retry_max_s: float = 30.0
    band: float = 0.05
    cache_hold_s: float = 60.0
    gpu_free_low: float = 0.05
    idle_release_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("min_bytes", "reserve_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_bytes is not None and (type(self.max_bytes) is not int
                                           or self.max_bytes < self.min_bytes):
            raise ValueError(f"max_bytes must be None or an integer >= min_bytes "
                             f"({self.min_bytes}), got {self.max_bytes!r}")
        for name in ("headroom", "release_delay_s", "retry_s", "band", "retry_max_s",
                     "cache_hold_s", "gpu_free_low"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            ELASTIC_OPTIONS[name](name, value)     # finite, in its bounds (ConfigError)
        if self.idle_release_s is not None:
            if not isinstance(self.idle_release_s, (int, float)) or \
                    isinstance(self.idle_release_s, bool):
                raise ValueError(f"idle_release_s must be a number or None, got "
                                 f"{self.idle_release_s!r}")
            ELASTIC_OPTIONS["idle_release_s"]("idle_release_s", self.idle_release_s)


@dataclass
class PolicyStats:
    grows: int = 0                 # grow decisions (MAP ops sent)
    granules_grown: int = 0        # granules asked for
    failed_grows: int = 0          # grows the GPU could not back (granules)
    failed_grow_attempts: int = 0  # maps that failed (a batch's failed range each)
    shrinks: int = 0               # shrink decisions (UNMAP ops sent)
    granules_released: int = 0
    bytes_returned: int = 0        # released granules x bytes per granule
    evicted_cached: int = 0        # cached blocks evicted by releases
    compactor_calls: int = 0       # shrinks that found too few releasable granules and
                                   # handed the shortfall to the caller (moves)
    yields: int = 0                # steps that gave memory to another engine's demand
    kept_cached: int = 0           # looks at a due release that kept cached granules
    short: bool = False            # the last grow could not be backed
    events: list = field(default_factory=list)   # (time, "grow"/"shrink"/"fail", granules)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "events"}
        return out
