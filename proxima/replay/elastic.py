"""Elastic KV memory in the CPU replay: the real connector and policy, a stand-in worker.

``proxima replay --elastic`` builds the scheduler with Proxima's KV connector
(:mod:`proxima.engines.elastic_connector`) exactly as an engine would: its scheduler side
makes the pool granule-aware and runs the grow/shrink policy at every step boundary. There
is no GPU: :class:`ReplayWorker` answers each step's ops as the workers would (maps succeed
while the simulated GPU has room: ``gpu_bytes``), so every decision -- what is mapped when,
what is released, which cached blocks that evicts -- is the real code's. The policy's
clock is the step count times ``step_seconds``.

With ``policy="fixed"`` the pool places by granule with the whole pool mapped: the
placement alone, whose reclaimable fraction the proof measures.

The KV cache is shaped like Llama-3.1-8B's (32 layers, 8 KV heads of 128, bf16: a 64 KiB
page per layer and block, 2 MiB per block over all layers), so ``granule_blocks`` block
ids are ``granule_blocks * 64 KiB`` of each layer (32 = 2 MiB, the H200's granularity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxima.memory.ops import MAP, UNMAP, Report

LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 32, 8, 128, 2


def page_bytes(block_size: int) -> int:
    """Bytes of one block of one layer (K and V) of the Llama-3.1-8B shape."""
    return block_size * KV_HEADS * HEAD_SIZE * 2 * DTYPE_BYTES


@dataclass
class ElasticReplay:
    """What ``--elastic`` (or the placement proof) runs. Sizes are bytes of the 8B shape."""

    policy: str = "auto"
    eviction: str = "auto"
    min_bytes: int = 0
    max_bytes: int | None = None
    headroom: float = 0.10
    release_delay_s: float = 10.0
    step_seconds: float = 0.025
    gpu_bytes: int | None = None          # the simulated GPU's room for KV (None: the pool)
    extra: dict = field(default_factory=dict)

    def connector_extra(self, granule_blocks: int, block_size: int) -> dict:
        out = {"policy": self.policy, "eviction": self.eviction, "min_bytes": self.min_bytes,
               "max_bytes": self.max_bytes, "headroom": self.headroom,
               "release_delay_s": self.release_delay_s, "idle_sleep_s": 0.0,
               "granule_bytes": granule_blocks * page_bytes(block_size)}
        out.update(self.extra)
        return out

    def block_bytes(self, block_size: int) -> int:
        return LAYERS * page_bytes(block_size)


def kv_cache_groups(block_size: int):
    """One full-attention group of 32 layers shaped like Llama-3.1-8B's KV cache."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    return [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)]


def kv_transfer_config(spec: ElasticReplay, granule_blocks: int, block_size: int,
                       compaction: dict | None = None):
    """The elastic connector's config for the replay; ``compaction``: its KV compaction
    settings (:class:`proxima.engines.compaction_v1.CompactionOptions`), None: off."""
    from vllm.config import KVTransferConfig

    from proxima.engines import elastic_v1

    extra = spec.connector_extra(granule_blocks, block_size)
    extra["compaction"] = compaction or {"mode": "0"}
    return KVTransferConfig(**elastic_v1.connector_config(extra))


class ReplayWorker:
    """The workers' side of the channel without memory: applies each step's ops to a
    count of mapped granules and answers with the report a worker would send. A map
    beyond ``capacity`` granules fails (another process holds the memory)."""

    def __init__(self, channel, capacity: int | None) -> None:
        self.channel = channel
        self.capacity = capacity
        self.mapped = set(g for g in range(channel.num_granules) if channel.state[g] != 1)
        self.applied: list = []

    def __call__(self, meta):
        batch = getattr(meta, "batch", None)
        if batch is not None:
            failed = []
            for op in batch.ops:
                span = range(op.first, op.first + op.count)
                if op.code == UNMAP:
                    self.mapped.difference_update(span)
                elif op.code == MAP:
                    for g in span:
                        if g in self.mapped:
                            continue
                        if self.capacity is not None and len(self.mapped) >= self.capacity:
                            failed.append((g, op.first + op.count - g))
                            break
                        self.mapped.add(g)
            self.applied.append((batch.seq, tuple(failed)))
        if not self.applied:
            return None
        from proxima.engines.elastic_connector import ElasticWorkerMetadata

        report = Report(tuple(self.applied), len(self.mapped), self.channel.granule_blocks)
        self.applied = []
        return ElasticWorkerMetadata(report)


class ElasticRun:
    """One replay's elastic side: the connector found in the scheduler, its fake clock,
    the stand-in worker, and what it reports."""

    def __init__(self, spec: ElasticReplay, scheduler, granule_blocks: int) -> None:
        from proxima.engines.elastic_v1 import find_connector

        self.spec = spec
        self.connector = find_connector(scheduler.connector)
        if self.connector is None or self.connector.queue is None:
            raise RuntimeError("the replay scheduler was built without Proxima's elastic "
                               "connector or pool")
        self.queue = self.connector.queue
        self.step = 0
        self.connector.clock = lambda: self.step * spec.step_seconds
        self.bytes_per_granule = self.connector.bytes_per_granule
        capacity = None if spec.gpu_bytes is None else spec.gpu_bytes // self.bytes_per_granule
        self.worker = ReplayWorker(self.connector.channel, capacity)
        self._ledger_dir = None
        if self.connector.shared is not None:
            self._share(spec)

    def _share(self, spec: ElasticReplay) -> None:
        """The GPU ledger and the driver's free memory, stood in for: a ledger file of its
        own in a temporary directory (this engine alone in it), and a GPU of fixed size
        (``gpu_bytes``, else the pool) whose free memory is what this engine leaves."""
        import tempfile

        from proxima.memory.ledger import Ledger, ledger_path

        self._ledger_dir = tempfile.TemporaryDirectory(prefix="proxima-replay-ledger-")
        shared = self.connector.shared
        shared.ledger = Ledger(ledger_path("replay", self._ledger_dir.name))
        B = self.bytes_per_granule
        total = spec.gpu_bytes if spec.gpu_bytes is not None \
            else self.connector.channel.num_granules * B
        worker = self.worker
        shared.gpu_memory = lambda: (max(0, total - len(worker.mapped) * B), total)
        shared.post()

    def before_step(self, step: int) -> None:
        self.step = step

    def worker_output(self, scheduler_output):
        """The KVConnectorOutput of one step (what the workers' answer carries)."""
        from vllm.v1.outputs import KVConnectorOutput

        return KVConnectorOutput(
            kv_connector_worker_meta=self.worker(scheduler_output.kv_connector_metadata))

    def mapped_granules(self) -> int:
        return self.queue.granules.num_mapped

    def unmapped_blocks(self) -> int:
        return self.queue.held_blocks()

    def report(self) -> dict:
        status = self.connector.status()
        status.pop("events", None)
        if status.get("ledger"):
            status["ledger"] = "stand-in"      # a temporary file: its name is noise
        return {"elastic": status, "bytes_per_granule": self.bytes_per_granule}
