"""Elastic KV with tensor parallelism (issue 38), on CPU: two workers.

vLLM's ``mp`` executor runs one worker per GPU, each in a process of its own; every step's
SchedulerOutput reaches each of them as a pickled copy, and their KV connector outputs come
back pickled and are merged by vLLM's own ``KVOutputAggregator`` (the connector's
``ElasticWorkerMetadata.aggregate``). The scheduler's channel waits for ``world_size``
confirmations of a map before its blocks can be handed out. Here each worker is the
connector's real worker side on its own stand-in driver (tests/memory/fake_driver.py), so
each has its own memory, and each checks that every block a step reads is mapped *on it*.
"""

from __future__ import annotations

import pytest

from proxima.memory.channel import MAPPED
from tests.vllm.test_elastic_connector import (  # noqa: F401  (_restore: autouse fixture)
    GRANULE, PAGE, ProcessWorker, SlowDriver, _restore, auto_run)

TP = 2
GRANULE_BYTES = 2 * PAGE * GRANULE      # one granule over both layers' regions (4 MiB)


class Workers:
    """``TP`` workers behind vLLM's ``mp`` executor: each gets its own copy of the step
    (:class:`~tests.vllm.test_elastic_connector.ProcessWorker`), their answers are merged by
    vLLM's ``KVOutputAggregator``. ``capacities``: each worker's GPU memory (None: plenty);
    ``background``: which workers map on their mapping thread. After each step it records
    what the scheduler counts as mapped and what each worker has mapped."""

    def __init__(self, scheduler, capacities=None, background=()) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.ranks = [ProcessWorker(scheduler, background=rank in background)
                      for rank in range(TP)]
        for worker, capacity in zip(self.ranks, capacities or ()):
            if capacity is not None:      # from now on (start-up's maps are done)
                worker.driver.capacity = capacity
        self.aggregator = KVOutputAggregator(expected_finished_count=TP)
        self.channel = scheduler.connector.channel
        self.steps: list[tuple[set, list[set]]] = []

    @property
    def driver(self):                     # auto_run's `capacity_after` (unused here)
        return self.ranks[0].driver

    def mapped(self, worker) -> set[int]:
        arena = worker.memory.arena
        return {g for g in range(self.channel.num_granules) if arena.is_mapped(g)}

    def __call__(self, out):
        from vllm.v1.outputs import ModelRunnerOutput

        # a map never confirmed by every worker stalls the engine: fail, do not hang
        assert len(self.steps) < 5_000, "the engine never went idle"
        allocatable = {g for g in range(self.channel.num_granules)
                       if self.channel.state[g] == MAPPED}
        outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                     kv_connector_output=worker(out))
                   for worker in self.ranks]
        self.steps.append((allocatable, [self.mapped(w) for w in self.ranks]))
        return self.aggregator.aggregate(outputs).kv_connector_output

    @property
    def checked(self) -> int:
        return sum(w.checked for w in self.ranks)


def tp_run(monkeypatch, depth, **kw):
    """:func:`~tests.vllm.test_elastic_connector.auto_run` (the auto policy over specs(), 32
    granules) with an engine whose ``parallel_config.world_size`` is ``TP`` and
    :class:`Workers`; ``kw``: :class:`Workers`' arguments."""
    import vllm.config

    real = vllm.config.VllmConfig

    def tensor_parallel(**config):        # what `-tp 2` gives the scheduler's config
        return real(parallel_config=vllm.config.ParallelConfig(
            tensor_parallel_size=TP, distributed_executor_backend="mp"), **config)

    monkeypatch.setattr(vllm.config, "VllmConfig", tensor_parallel)
    return auto_run(32, depth, worker_class=lambda scheduler, background: Workers(
        scheduler, **kw))


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_two_workers_map_in_step_and_the_schedule_is_the_one_workers(monkeypatch, depth):
    one = auto_run(32, depth, worker_class=ProcessWorker)
    scheduler, conn, workers, log, mapped = tp_run(monkeypatch, depth)
    assert scheduler.vllm_config.parallel_config.world_size == conn.channel.workers == TP
    assert log == one[3]                                  # every step's schedule, every block
    assert mapped == one[4]                               # mapped granules, step by step
    assert conn.policy.stats.as_dict() == one[1].policy.stats.as_dict()
    assert conn.policy.stats.grows >= 1 and conn.policy.stats.shrinks >= 1
    for worker in workers.ranks:                          # the same ops reached each worker
        assert worker.ops == one[2].ops and worker.ops
        assert worker.checked == one[2].checked > 0       # every block it read was mapped
    for allocatable, (first, second) in workers.steps:
        assert first == second                            # in step, every step
        assert allocatable <= first                       # nothing handed out unbacked
    assert conn.channel.count(MAPPED) == 1
    assert [w.memory.mapped_granules for w in workers.ranks] == [1, 1]
    conn.queue.check()


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_batch_is_allocatable_only_once_both_workers_confirmed(monkeypatch, depth):
    """Worker 1 maps on its mapping thread, on a slow driver: its confirmations come steps
    after worker 0's. The granules stay unallocatable until the slower one confirmed."""
    import tests.vllm.test_elastic_connector as connector_tests

    monkeypatch.setattr(connector_tests, "FakeDriver", SlowDriver)
    scheduler, conn, workers, log, mapped = tp_run(monkeypatch, depth, background={1})
    assert len({r for step in log for r in step[4]}) == 48          # no request lost
    assert conn.policy.stats.grows >= 1 and conn.policy.stats.failed_grows == 0
    # steps where worker 0 had a granule mapped that worker 1 had not (yet): the scheduler
    # did not count it as allocatable
    behind = [(a, ranks) for a, ranks in workers.steps if ranks[0] - ranks[1]]
    assert behind, "the slow worker never fell behind: the test shows nothing"
    for allocatable, (first, second) in workers.steps:
        assert allocatable <= first & second
    assert workers.checked > 0
    background = workers.ranks[1].conn._background
    assert background.drain(5)
    assert (workers.mapped(workers.ranks[0]) == workers.mapped(workers.ranks[1])
            == {g for g in range(conn.channel.num_granules) if conn.channel.state[g] == MAPPED})
    workers.ranks[1].conn.shutdown()
    conn.queue.check()


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_map_failing_on_one_worker_leaves_both_at_the_same_size(monkeypatch, depth):
    """Once start-up's extra granules are given back, worker 1's GPU has room for 2
    granules, worker 0's plenty: a grow past that maps on worker 0 and fails on worker 1.
    The channel fails the batch and sends an unmap, so worker 0 gives its copy back; no
    block of those granules is handed out."""
    scheduler, conn, workers, log, mapped = tp_run(monkeypatch, depth,
                                                   capacities=[None, 2 * GRANULE_BYTES])
    assert len({r for step in log for r in step[4]}) == 48          # the engine kept serving
    assert conn.channel.stats["map_failures"] >= 1
    assert conn.policy.stats.failed_grows >= 1
    first, second = workers.ranks
    # worker 0 mapped what worker 1 could not, and unmapped it again when told
    assert first.memory.stats["map_failures"] == 0 < second.memory.stats["map_failures"]
    assert first.memory.stats["granules_unmapped"] > second.memory.stats["granules_unmapped"]
    assert max(mapped) <= 2 and max(mapped[3:]) == 2     # grew to worker 1's room, no more
    for allocatable, ranks in workers.steps:
        assert allocatable <= ranks[0] & ranks[1]        # never a failed granule
    # a failed map leaves worker 0 ahead only until the reconciling unmap reaches it: the
    # report is read after the step (``depth`` steps later with async scheduling), the unmap
    # goes out with the next step scheduled
    apart = 0
    for _, (ahead, behind) in workers.steps:
        assert behind <= ahead
        apart = apart + 1 if ahead != behind else 0
        assert apart <= depth
    last = workers.steps[-1][1]
    assert last[0] == last[1]
    assert first.memory.mapped_granules == second.memory.mapped_granules \
        == conn.channel.count(MAPPED) == 1
    assert first.checked > 0 and second.checked > 0
    conn.queue.check()


# ----------------------------------------------------------------------------- compaction

@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_both_workers_apply_the_same_moves_and_hold_the_same_kv(monkeypatch, depth):
    """KV compaction's mover hook on two workers (tests/vllm/test_compaction.py's runner
    stand-in, each with its own KV tensors and block tables, each step a copy of its own):
    each applies every move, each reads back what was written at every slot, and both end
    with the same KV and the same tables as a single worker."""
    import torch

    from tests.vllm import test_compaction as compaction_tests

    monkeypatch.delenv("PROXIMA_COMPACTION", raising=False)

    class Runners(compaction_tests.ProcessModelRunner):
        """Rank 0 (this object) and rank 1, each executing its own copy of every step."""

        def __init__(self, scheduler, total_blocks):
            super().__init__(scheduler, total_blocks)
            self.other = compaction_tests.ProcessModelRunner(scheduler, total_blocks)

        def execute(self, out):
            super().execute(out)
            self.other.execute(out)

    _, one, log_one = compaction_tests.run(300, depth, runner_class=compaction_tests
                                           .ProcessModelRunner, mode="every:3")
    _, ranks, log = compaction_tests.run(300, depth, runner_class=Runners, mode="every:3")
    assert log == log_one                                    # no decision changed
    for runner in (ranks, ranks.other):
        assert runner.moves == one.moves > 0                 # every move reached each worker
        assert runner.checked == one.checked > 10_000        # and every slot read back right
        assert runner.req_states.req_id_to_index.keys() == \
            ranks.req_states.req_id_to_index.keys()
    for mine, theirs in zip(ranks.kv_caches, ranks.other.kv_caches):
        assert torch.equal(mine.nan_to_num(-1.0), theirs.nan_to_num(-1.0))
    assert torch.equal(ranks.block_tables.block_tables[0].gpu,
                       ranks.other.block_tables.block_tables[0].gpu)
