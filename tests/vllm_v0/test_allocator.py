"""Proxima behind V0's block manager, against vLLM's own, on the real vLLM 0.6.3 classes:
in-place growth, prefix-cache hits and LRU eviction, copy-on-write, swap, preemption,
and capacity parity (every decision the scheduler takes from the block manager is the
same, step by step, in a tight pool)."""

from __future__ import annotations

import random

import pytest

from tests.vllm_v0.helpers import (SeqFactory, allocate_running, card_stack_or_skip, decode,
                                   make_manager, runs)

card_stack_or_skip()

from vllm.core.interfaces import AllocStatus  # noqa: E402
from vllm.sequence import Logprob, SequenceStatus  # noqa: E402
from vllm.utils import Device  # noqa: E402


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 31999) for _ in range(n)]


def gpu_of(manager):
    return manager.block_allocator._allocators[Device.GPU]


def buddy_of(manager):
    gpu = gpu_of(manager)
    return getattr(gpu, "_hashless_allocator", gpu)


def finish(manager, group) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        manager.free(seq)


def assert_all_free(manager) -> None:
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks
    assert manager.get_num_free_cpu_blocks() == manager.num_total_cpu_blocks
    naive = buddy_of(manager)
    if hasattr(naive, "buddy"):
        naive.buddy.check()
        assert naive.num_reserved == 0


@pytest.mark.parametrize("caching", [True, False])
def test_prompt_and_decode_grow_in_place(caching):
    manager = make_manager(True, 512, enable_caching=caching)
    factory = SeqFactory()
    rng = random.Random(1)
    groups = []
    for _ in range(6):                      # interleaved: each grows a little per step
        group = factory.group(tokens(rng, rng.randint(20, 90)), max_tokens=100)
        allocate_running(manager, group)
        groups.append(group)
    for _ in range(100):
        for group in groups:
            decode(manager, group.seqs[0])
    for group in groups:
        table = manager.get_block_table(group.seqs[0])
        assert len(table) == -(-group.seqs[0].get_len() // 16)
        assert runs(table) == 1, table
        finish(manager, group)
    assert_all_free(manager)


def test_stock_scatters_the_same_sequences():
    """The baseline the contiguity figures compare with (vLLM's LIFO free list)."""
    manager = make_manager(False, 512)
    factory = SeqFactory()
    rng = random.Random(1)
    groups = [factory.group(tokens(rng, rng.randint(20, 90)), 100) for _ in range(6)]
    for group in groups:
        allocate_running(manager, group)
    for _ in range(100):
        for group in groups:
            decode(manager, group.seqs[0])
    assert all(runs(manager.get_block_table(g.seqs[0])) > 1 for g in groups)


@pytest.mark.parametrize("proxima", [False, True])
def test_prefix_cache_hits_and_reuse(proxima):
    manager = make_manager(proxima, 256)
    factory = SeqFactory()
    rng = random.Random(2)
    prefix = tokens(rng, 64)                                    # 4 full blocks
    first = factory.group(prefix + tokens(rng, 10), 20)
    allocate_running(manager, first)
    first_ids = list(manager.get_block_table(first.seqs[0]))
    decode(manager, first.seqs[0], 20)
    finish(manager, first)                                      # cached, evictable
    assert manager.get_num_free_gpu_blocks() == 256
    second = factory.group(prefix + tokens(rng, 40), 30)
    allocate_running(manager, second)
    table = manager.get_block_table(second.seqs[0])
    assert table[:4] == first_ids[:4]                           # the cached blocks
    assert manager.get_prefix_cache_hit_rate(Device.GPU) == pytest.approx(4 / (4 + 6))
    decode(manager, second.seqs[0], 30)
    if proxima:
        assert runs(manager.get_block_table(second.seqs[0])[4:]) == 1
    finish(manager, second)
    assert_all_free(manager)


def test_lru_eviction_evicts_what_stock_evicts():
    """Pool full of cached blocks: new prompts evict the same contents, in LRU order."""
    rng = random.Random(3)
    prompts = [tokens(rng, 16 * rng.randint(2, 6)) for _ in range(12)]
    late = [tokens(rng, 16 * rng.randint(2, 6)) for _ in range(6)]
    cached = []
    for proxima in (False, True):
        manager = make_manager(proxima, 40, num_cpu_blocks=8)
        factory = SeqFactory()
        for prompt in prompts:
            group = factory.group(prompt, 1)
            assert manager.can_allocate(group) == AllocStatus.OK
            allocate_running(manager, group)
            finish(manager, group)
        for prompt in late + prompts[:3]:
            group = factory.group(prompt, 1)
            allocate_running(manager, group)
            finish(manager, group)
        gpu = gpu_of(manager)
        cached.append((set(gpu._cached_blocks), gpu.get_prefix_cache_hit_rate(),
                       manager.get_num_free_gpu_blocks()))
        assert_all_free(manager)
    assert cached[0] == cached[1]


@pytest.mark.parametrize("caching", [True, False])
def test_copy_on_write_after_fork(caching):
    manager = make_manager(True, 128, enable_caching=caching)
    factory = SeqFactory()
    rng = random.Random(4)
    parent_group = factory.group(tokens(rng, 40), 50)            # last block: 8 of 16
    allocate_running(manager, parent_group)
    parent = parent_group.seqs[0]
    child = parent.fork(1000)
    manager.fork(parent, child)
    shared_last = manager.get_block_table(parent)[-1]
    cows = decode(manager, child)                                # shared: must copy
    assert len(cows) == 1 and cows[0][0] == shared_last
    assert manager.get_block_table(child)[-1] == cows[0][1] != shared_last
    assert decode(manager, parent) == []                         # now its own block
    decode(manager, parent, 40)
    assert runs(manager.get_block_table(parent)) == 1
    for seq in (parent, child):
        seq.status = SequenceStatus.FINISHED_STOPPED
        manager.free(seq)
    assert_all_free(manager)


@pytest.mark.parametrize("caching", [True, False])
def test_swap_out_and_in_leaves_no_block_behind(caching):
    manager = make_manager(True, 64, num_cpu_blocks=32, enable_caching=caching)
    factory = SeqFactory()
    rng = random.Random(5)
    group = factory.group(tokens(rng, 70), 60)
    allocate_running(manager, group)
    decode(manager, group.seqs[0], 30)
    used = len(manager.get_block_table(group.seqs[0]))
    assert manager.can_swap_out(group)
    out = manager.swap_out(group)
    group.seqs[0].status = SequenceStatus.SWAPPED
    assert len(out) == used
    assert manager.get_num_free_gpu_blocks() == 64
    assert manager.get_num_free_cpu_blocks() == 32 - used
    assert manager.can_swap_in(group, 0) == AllocStatus.OK
    mapping = manager.swap_in(group)
    group.seqs[0].status = SequenceStatus.RUNNING
    assert len(mapping) == used
    assert runs(manager.get_block_table(group.seqs[0])) == 1
    decode(manager, group.seqs[0], 20)
    assert runs(manager.get_block_table(group.seqs[0])) == 1
    finish(manager, group)
    assert_all_free(manager)


def test_reserved_room_is_free_capacity():
    """Room reserved behind a run is given up the moment anything else needs it."""
    manager = make_manager(True, 64, enable_caching=False)
    factory = SeqFactory()
    rng = random.Random(6)
    big = factory.group(tokens(rng, 20), max_tokens=600)         # expects 39 blocks
    allocate_running(manager, big)
    assert buddy_of(manager).num_reserved > 30
    assert manager.get_num_free_gpu_blocks() == 62
    others = []
    while True:
        group = factory.group(tokens(rng, 16 * 4), 1)
        if manager.can_allocate(group) != AllocStatus.OK:
            break
        allocate_running(manager, group)
        others.append(group)
    assert len(others) == 15                     # as many as stock: 60 of 62 free blocks
    assert buddy_of(manager).num_reserved <= manager.get_num_free_gpu_blocks() == 2
    for group in others + [big]:
        finish(manager, group)
    assert_all_free(manager)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capacity_parity_in_a_tight_pool(caching, seed):
    """The same random admissions, decodes, preemptions, swaps and finishes against
    vLLM's manager and Proxima's: every answer the scheduler relies on is the same."""
    rng = random.Random(seed)
    managers = [make_manager(p, 48, num_cpu_blocks=24, enable_caching=caching)
                for p in (False, True)]
    factories = [SeqFactory(), SeqFactory()]
    prefixes = [tokens(rng, 48) for _ in range(3)]
    running: list[list] = []
    swapped: list[list] = []
    finished = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.2:
            prompt = rng.choice(prefixes)[:rng.randint(0, 48)] + tokens(rng, rng.randint(1, 40))
            pair = [f.group(prompt, rng.randint(1, 120)) for f in factories]
            status = [m.can_allocate(g) for m, g in zip(managers, pair)]
            assert status[0] == status[1]
            if status[0] == AllocStatus.OK:
                for m, g in zip(managers, pair):
                    allocate_running(m, g)
                running.append(pair)
        elif op < 0.8 and running:
            pair = rng.choice(running)
            for g in pair:                                   # the model's new token
                g.seqs[0].append_token_id(7, {7: Logprob(0.0)})
            ok = [m.can_append_slots(g, 0) for m, g in zip(managers, pair)]
            assert ok[0] == ok[1]
            if ok[0]:                                        # its slot, next schedule
                cows = [m.append_slots(g.seqs[0], 0) for m, g in zip(managers, pair)]
                assert len(cows[0]) == len(cows[1])
            else:                                            # preempt by recompute
                running.remove(pair)
                for m, g in zip(managers, pair):
                    g.seqs[0].status = SequenceStatus.WAITING
                    m.free(g.seqs[0])
        elif op < 0.87 and running:
            pair = running.pop(rng.randrange(len(running)))
            ok = [m.can_swap_out(g) for m, g in zip(managers, pair)]
            assert ok[0] == ok[1]
            if ok[0]:
                for m, g in zip(managers, pair):
                    m.swap_out(g)
                    g.seqs[0].status = SequenceStatus.SWAPPED
                swapped.append(pair)
            else:
                running.append(pair)
        elif op < 0.92 and swapped:
            pair = swapped[0]
            status = [m.can_swap_in(g, 0) for m, g in zip(managers, pair)]
            assert status[0] == status[1]
            if status[0] == AllocStatus.OK:
                swapped.pop(0)
                for m, g in zip(managers, pair):
                    m.swap_in(g)
                    g.seqs[0].status = SequenceStatus.RUNNING
                running.append(pair)
        elif running:
            pair = running.pop(rng.randrange(len(running)))
            for m, g in zip(managers, pair):
                finish(m, g)
            finished += 1
        assert managers[0].get_num_free_gpu_blocks() == managers[1].get_num_free_gpu_blocks()
        assert managers[0].get_num_free_cpu_blocks() == managers[1].get_num_free_cpu_blocks()
    assert finished > 50
    for pair in running + swapped:
        for m, g in zip(managers, pair):
            finish(m, g)
    for m in managers:
        assert_all_free(m)
