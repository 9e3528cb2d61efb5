"""KV compaction's worker side inside vLLM 0.26's (and 0.33's) V2 model runner (the scheduler side,
which plans the moves, is :mod:`proxima.vllm.compaction_v1`).

Why a hook (:func:`install_worker_hook`): vLLM 0.26's V2 runner keeps per-request block
tables on the GPU (``vllm/v1/worker/gpu/block_table.py``: one ``[max_num_reqs,
max_blocks]`` int32 table per KV-cache group, written through staged writes) and changes
them only from the scheduler output, in ``GPUModelRunner.update_requests`` (appended ids
of running requests) and ``add_requests`` (full ids of new and resumed requests). It has
no supported way to rewrite a running request's ids: the resumed-request path re-creates
the request's whole state (sampler, token buffers) from the scheduler's copy, which under
async scheduling lags the GPU by a token. So the hook wraps ``update_requests``: after
vLLM's own per-step block work (appends, KV zeroing, copy-on-write copies), it applies the
step's :class:`CompactionWork` from the connector metadata -- the copies with the Triton
mover (:class:`proxima.kernels.KVBlockMover`, every layer, on the forward's stream) and the
moved ids written into the persistent block tables -- before ``apply_staged_writes`` and
``prepare_attn`` read them. The step's forward then reads and writes the new ids. The
blocks a plan must not touch (pinned) are those vLLM itself writes or names in this step
before that point: new blocks (their ids are in the output), copy-on-write endpoints,
the blocks of requests (re)added this step, partial-hit blocks awaiting their copy.
With async scheduling the next step may already be scheduled on the new ids; its work
runs after this step's on the same stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from proxima.vllm import activation, patches


@dataclass(frozen=True)
class CompactionWork:
    """What one step's workers do: the copies (phases of runs ``(src, dst, n)``) and the
    block-table changes ``(req_id, group, positions, new ids)``."""

    seq: int
    phases: tuple[tuple[tuple[int, int, int], ...], ...]
    tables: tuple[tuple[str, int, tuple[int, ...], tuple[int, ...]], ...]
    blocks: int


PATCHES = "compaction-worker"   # this module's patch set (proxima.vllm.patches)
_worker_times: list[tuple[int, float]] = []     # (seq, GPU ms), for the connector's report


def install_worker_hook(cls=None) -> None:
    """Wrap the V2 runner's ``update_requests`` (``cls``: ``GPUModelRunner``; idempotent):
    see the module doc."""
    if cls is None:
        import vllm.v1.worker.gpu.model_runner as model_runner

        cls = model_runner.GPUModelRunner
    if any(a.patch.target is cls for a in patches.applied(PATCHES)):
        return
    patches.apply(patches.PatchSet(PATCHES, "v1", lambda: [
        patches.Patch(cls, "update_requests", _wrap_update_requests(cls.update_requests))]))


def _wrap_update_requests(original):
    def update_requests(self, scheduler_output) -> None:
        original(self, scheduler_output)
        meta = scheduler_output.kv_connector_metadata
        work = getattr(meta, "compaction", None)
        if work is not None:
            apply_on_worker(self, work)
        elif any(getattr(m, "compaction", None) is not None
                 for m in getattr(meta, "metadata", ()) or ()):
            raise RuntimeError("KV compaction's work arrived inside another connector's "
                               "metadata: compaction does not run beside other connectors")

    update_requests.__wrapped__ = original
    update_requests.__doc__ = original.__doc__
    return update_requests


def uninstall_worker_hook() -> None:
    patches.restore(PATCHES)


class _WorkerState:
    """Per model runner: the mover over its KV tensors and the pending timings."""

    def __init__(self, runner) -> None:
        from proxima.kernels import KVBlockMover

        from proxima.vllm.vllm_v1_compat import kernel_blocks_per_block

        bpk = kernel_blocks_per_block(runner)
        if len(bpk) != 1:
            raise RuntimeError(f"{activation.COMPACTION_ENV}: KV-cache groups with different "
                               f"kernel block sizes ({sorted(bpk)}) are not supported")
        self.bpk = bpk.pop()
        self.mover = KVBlockMover(runner.kv_caches)
        self.pending: deque = deque()
        from proxima.vllm import elastic_v1

        memory = elastic_v1.kv_memory()
        spare = memory.spare_blocks if memory is not None else range(0)
        self.limit = spare.stop if len(spare) else self.mover.num_blocks


def worker_segments(work: CompactionWork, bpk: int, row_of) -> tuple[list, list]:
    """The step's work as flat int lists for one upload (pure Python): per phase, its
    single-block sources then destinations (kernel blocks: ``bpk`` per vLLM block); per
    KV-cache group, the block-table rows, columns and new ids. Returns ``(segments,
    index)``: ``index`` is ``[("move", phase number, count) | ("table", group, count)]``
    (a table entry covers three segments: rows, columns, values). ``row_of``: request id
    -> its table row (None: not held here)."""
    segments: list = []
    index: list = []
    for p, phase in enumerate(work.phases):
        src: list[int] = []
        dst: list[int] = []
        for s, d, n in phase:
            src.extend(range(s * bpk, (s + n) * bpk))
            dst.extend(range(d * bpk, (d + n) * bpk))
        if src:
            segments.append(src + dst)
            index.append(("move", p, len(src)))
    rows: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for req_id, group, cols, ids in work.tables:
        row = row_of(req_id)
        if row is None:
            raise RuntimeError(f"compaction moved blocks of request {req_id}, which this "
                               "worker does not hold: its block table cannot be updated")
        r, c, v = rows.setdefault(group, ([], [], []))
        for col, new in zip(cols, ids):
            r.extend((row,) * bpk)
            c.extend(range(col * bpk, (col + 1) * bpk))
            v.extend(range(new * bpk, (new + 1) * bpk))
    for group, (r, c, v) in rows.items():
        segments += [r, c, v]
        index.append(("table", group, len(r)))
    return segments, index


def apply_on_worker(runner, work: CompactionWork) -> None:
    """Copy the moved blocks (every layer, current stream) and write their new ids into the
    runner's persistent block tables, before the step's forward reads either.

    Nothing here waits for the GPU: the moves and the table writes of the whole step go up
    in one pinned, non-blocking host-to-device copy (16-byte aligned segments, so the
    kernel never compiles again for a new slice), then one mover launch per phase and one
    indexed write per KV-cache group, all queued on the current stream; the CUDA events
    that time it are read only once they have completed (a later step)."""
    import torch

    from proxima.kernels.mover import pack_int64

    state = runner.__dict__.get("_proxima_compaction")
    if state is None:
        state = runner._proxima_compaction = _WorkerState(runner)
    cuda = state.mover.device.type == "cuda"
    limit = state.limit
    for phase in work.phases:
        for s, d, n in phase:
            if s < 0 or d < 0 or max(s, d) + n > limit:
                raise RuntimeError(f"compaction: move ({s}, {d}, {n}) lies outside this "
                                   f"worker's KV blocks and scratch (0..{limit - 1}): the "
                                   "scheduler and the workers disagree on the settings")
    segments, index = worker_segments(work, state.bpk, runner.req_states.req_id_to_index.get)
    if not segments:
        _collect_times(state)
        return
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    flat, offsets = pack_int64(segments)
    host = torch.tensor(flat, dtype=torch.int64)
    dev = state.mover.device
    data = host.pin_memory().to(dev, non_blocking=True) if cuda else host.to(dev)
    seg = iter(offsets)
    for kind, which, count in index:
        if kind == "move":
            at = next(seg)
            state.mover.apply_pairs(data[at:at + 2 * count], count)
        else:
            r, c, v = next(seg), next(seg), next(seg)
            table = runner.block_tables.block_tables[which].gpu
            vals = data[v:v + count]
            table[data[r:r + count], data[c:c + count]] = vals.to(table.dtype)
    if cuda:
        end.record()
        state.pending.append((work.seq, start, end))
    _collect_times(state)


def _collect_times(state: _WorkerState) -> None:
    """Read the CUDA events of earlier steps that have completed (``query`` never waits)."""
    while state.pending and state.pending[0][2].query():
        seq, s, e = state.pending.popleft()
        _worker_times.append((seq, s.elapsed_time(e)))


def take_worker_times() -> tuple[tuple[int, float], ...]:
    """The GPU times measured since the last call (the connector's worker report)."""
    out = tuple(_worker_times)
    _worker_times.clear()
    return out
