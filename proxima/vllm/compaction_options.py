"""KV compaction's settings and where it may run: :class:`CompactionOptions` (the
``"compaction"`` dict of the elastic connector's ``kv_connector_extra_config`` over
``PROXIMA_COMPACTION``), the defaults, and the refusals of an engine compaction cannot run
in (another KV connector beside Proxima's, pipeline parallelism, speculative decoding),
checked the same way on the scheduler (:func:`proxima.vllm.compaction_v1.scheduler_side`)
and on each worker (:func:`worker_side`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from proxima.vllm import activation
from proxima.errors import UserError

DEFAULT_BUDGET_BYTES = 256 << 20     # per step that moves: <= ~0.15 ms of copies on an H200
DEFAULT_INTERVAL = 1                 # auto mode plans every that many steps
DEFAULT_MAX_PHASES = 8               # mover launches per step
DEFAULT_CLAIM_BLOCKS = 16            # ids a run keeps free ahead of itself for its growth


def scratch_first(num_blocks: int, granule_blocks: int) -> int:
    """The first scratch block id: the pool rounded up to whole granules."""
    return -(-num_blocks // granule_blocks) * granule_blocks


@dataclass(frozen=True)
class CompactionOptions:
    """KV compaction's settings: the ``"compaction"`` dict of the elastic connector's
    ``kv_connector_extra_config`` (same on the scheduler and the workers), over
    ``PROXIMA_COMPACTION`` for the mode.

    ``mode``: ``"1"`` (on: the policy); ``budget_mib``: block bytes
    copied per step at most; ``max_phases``: mover launches per step at most;
    ``interval``: auto mode plans every that many steps; ``scratch_granules``: granules
    of scratch blocks past the pool (the spares of exchanges, see the planner; 0: only
    vLLM's null block); ``claim_blocks``: ids a new run keeps free ahead of itself."""

    mode: activation.CompactionMode
    budget_mib: int = DEFAULT_BUDGET_BYTES >> 20
    max_phases: int = DEFAULT_MAX_PHASES
    interval: int = DEFAULT_INTERVAL
    scratch_granules: int = 1
    claim_blocks: int = DEFAULT_CLAIM_BLOCKS

    @classmethod
    def resolve(cls, extra: dict | None = None, environ=None) -> "CompactionOptions | None":
        """The settings in force (None: compaction is off); a bad value is one
        :class:`proxima.errors.UserError` naming it."""
        extra = dict(extra or {})
        names = {f for f in cls.__dataclass_fields__ if f != "mode"} | {"mode"}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise UserError(f"compaction: unknown option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(names))}")
        value = extra.pop("mode", None)
        if value is None:
            mode = activation.compaction(environ)
        else:
            try:
                mode = activation.compaction_mode(str(value))
            except ValueError:
                raise UserError(f"compaction: mode must be 1 (on) or 0 (off), got "
                                f"{value!r}") from None
        if mode is None:
            return None
        for name, v in extra.items():
            low = 0 if name == "scratch_granules" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise UserError(f"compaction: {name} must be an integer >= {low}, got {v!r}")
        return cls(mode, **extra)


def composed_in_multiconnector(depth: int = 8) -> bool:
    """Whether vLLM's ``MultiConnector`` is constructing the caller: it hands each child a
    copy of the config holding only the child's own ``kv_transfer_config``, so the config
    cannot say; the constructing frame can (looked up a few frames, once per engine)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return False
        if type(frame.f_locals.get("self")).__name__ == "MultiConnector":
            return True
    return False


def refusal(vllm_config, composed: bool) -> str | None:
    """Why this engine cannot compact (None: it can): see the module doc."""
    ktc = vllm_config.kv_transfer_config
    if composed or (ktc is not None and ktc.kv_connector == "MultiConnector"):
        return ("another KV connector is configured beside Proxima's (it may track block "
                "ids that compaction changes)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return (f"pipeline parallelism (pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size}) keeps several steps in flight on "
                "different stages")
    if vllm_config.speculative_config is not None:
        return "speculative decoding is configured (its drafter's KV is not covered)"
    return None


def options_for(vllm_config, extra, composed: bool) -> "CompactionOptions | None":
    """The settings in force for this engine (None: off); UserError when compaction is
    asked for where it cannot run (:func:`refusal`)."""
    options = CompactionOptions.resolve(extra)
    if options is None:
        return None
    why = refusal(vllm_config, composed)
    if why:
        raise UserError(f"{activation.COMPACTION_ENV}: KV compaction cannot run here: {why}; "
                        f"unset {activation.COMPACTION_ENV}")
    return options


def worker_side(vllm_config, extra, composed: bool = False) -> "CompactionOptions | None":
    """The settings when this worker applies compaction's work (None: off; checked here)."""
    return options_for(vllm_config, extra, composed)
