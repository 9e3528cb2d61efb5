"""proxima.memory on a real GPU: CUDA virtual memory through the driver, torch views, Triton
and CUDA graphs over it, out-of-memory as a result. Needs torch and triton, not vLLM.

Run on the H200 (about a minute, most of it torch/Triton start-up):

    PROXIMA_EXPECT_GPU=1 python -m pytest -m gpu tests/gpu/test_memory_gpu.py -v -s

With ``PROXIMA_EXPECT_GPU=1`` a missing GPU fails the tests instead of skipping them.
Timings (map 2 GiB, unmap 1 GiB) are printed and written to ``$PROXIMA_GPU_OUT/
vmm_timings.json`` when that variable names a folder; nothing asserts on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
EXPECT_GPU = os.environ.get("PROXIMA_EXPECT_GPU") == "1"


@pytest.fixture(scope="module", autouse=True)
def torch_on_gpu():
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        if EXPECT_GPU:
            pytest.fail("PROXIMA_EXPECT_GPU=1 but no CUDA GPU is usable here "
                        f"(torch {'missing' if torch is None else torch.__version__})")
        pytest.skip("needs an NVIDIA GPU")
    torch.zeros(1, device="cuda")          # torch's context first, as in a vLLM worker
    return torch


def arena(units, unit_bytes=2 * MiB, regions=1):
    from proxima.memory.arena import VmmArena

    return VmmArena([unit_bytes] * regions, units, device=0)


def test_the_driver_reports_its_granularity_and_reserves():
    from proxima.memory.driver import CudaDriver

    driver = CudaDriver(0)
    driver.use_device()
    gran = driver.granularity()
    print(f"\nVMM allocation granularity: {gran} bytes")
    assert gran > 0 and gran & (gran - 1) == 0
    ptr = driver.reserve(64 * gran, gran)
    assert ptr % gran == 0
    driver.free_addresses(ptr, 64 * gran)


def test_a_tensor_over_mapped_memory_reads_back_what_was_written(torch_on_gpu):
    torch = torch_on_gpu
    with arena(8) as a:
        assert a.map(0, 8).ok
        raw = a.region_tensor(0)
        assert raw.data_ptr() == a.base and raw.numel() == 16 * MiB and raw.is_cuda
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(raw)) == 0             # zero-filled on map
        x = raw.view(torch.float32).view(8, -1)
        x.copy_(torch.arange(8, device="cuda", dtype=torch.float32)[:, None].expand_as(x))
        assert torch.equal(x[:, 0].cpu(), torch.arange(8, dtype=torch.float32))
        assert float(x.sum()) == sum(range(8)) * x.shape[1]


def test_triton_and_a_cuda_graph_replay_after_other_granules_were_unmapped(torch_on_gpu):
    torch = torch_on_gpu
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(ptr + offs, tl.load(ptr + offs, mask=mask) + 1.0, mask=mask)

    with arena(8) as a:
        assert a.map(0, 8).ok
        x = a.region_tensor(0).view(torch.float32).view(8, -1)     # one row per granule
        n = x.shape[1]
        first, sixth = x[0], x[5]

        def work():
            add_one[(triton.cdiv(n, 1024),)](first, n, BLOCK=1024)
            add_one[(triton.cdiv(n, 1024),)](sixth, n, BLOCK=1024)
            sixth.mul_(2.0)                                        # a torch kernel too

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            work()                                                 # compiles; runs once
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        torch.cuda.synchronize()
        assert float(first[0]) == 1.0 and float(sixth[0]) == 2.0
        assert a.unmap(1, 5) == 4 and a.unmap(6, 8) == 2           # all but granules 0, 5
        expected = 2.0
        for _ in range(3):
            graph.replay()
            expected = (expected + 1.0) * 2.0
        torch.cuda.synchronize()
        assert torch.all(first == 4.0) and torch.all(sixth == expected)
        # grow again: fresh zeroed pages, usable by torch and by the same Triton kernel
        assert a.map(1, 5).ok
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(x[1:5])) == 0
        x[1:5].fill_(3.0)
        add_one[(triton.cdiv(n, 1024),)](x[3], n, BLOCK=1024)
        torch.cuda.synchronize()
        assert torch.all(x[3] == 4.0) and torch.all(x[1] == 3.0)
        graph.replay()                                             # still fine after remap
        torch.cuda.synchronize()
        assert torch.all(first == 5.0) and torch.all(sixth == (expected + 1.0) * 2.0)
        del graph


def test_remapping_gives_fresh_usable_pages(torch_on_gpu):
    torch = torch_on_gpu
    with arena(4) as a:
        a.map(0, 4)
        x = a.region_tensor(0).view(torch.int32).view(4, -1)
        x.fill_(7)
        torch.cuda.synchronize()
        a.unmap(2, 4)
        assert a.map(2, 4).ok
        torch.cuda.synchronize()
        assert torch.all(x[:2] == 7) and int(torch.count_nonzero(x[2:])) == 0
        x[2:].fill_(9)
        assert torch.all(x[2:] == 9)


def test_kv_memory_keeps_every_other_block_through_unmap_and_remap(torch_on_gpu):
    torch = torch_on_gpu
    from proxima.memory.kv import KvMemory
    from proxima.memory.ops import Op

    page, blocks = 64 * 1024, 4096                      # Llama-3.1-8B pages: 32 per granule
    mem = KvMemory([page * blocks] * 4, blocks, device=0)
    try:
        assert mem.granule_blocks == 32 and mem.num_granules == 128
        tensors = mem.tensors()
        ptrs = [t.data_ptr() for t in tensors]
        pages = [t.view(torch.int32).view(blocks, -1) for t in tensors]
        for r, p in enumerate(pages):
            p.copy_((torch.arange(blocks, device="cuda", dtype=torch.int32)[:, None] * 4 + r)
                    .expand_as(p))
        assert mem.apply([Op.unmap(10, 20)]) == []
        assert mem.mapped_granules == 108
        for r, p in enumerate(pages):                   # blocks outside 320..959 untouched
            ids = torch.cat([torch.arange(0, 320), torch.arange(960, blocks)]).cuda()
            assert torch.equal(p[ids, 0], ids.to(torch.int32) * 4 + r)
        stream = torch.cuda.current_stream().cuda_stream
        assert mem.apply([Op.map(10, 20)], stream=stream) == []
        torch.cuda.synchronize()
        assert all(int(torch.count_nonzero(p[320:960])) == 0 for p in pages)
        assert [t.data_ptr() for t in mem.tensors()] == ptrs   # the addresses never moved
        pages[2][500].fill_(5)
        assert int(pages[2][500, 3]) == 5
    finally:
        mem.close()


def test_a_grow_beyond_the_gpu_stops_where_keep_free_bytes_stay_free(torch_on_gpu):
    """The fix for the H100's out-of-memory forward (2026-12-05, ``49f68ab``) on the real
    driver: a pool reserved larger than the GPU's free memory, a grow asked for all of it.
    The map stops where ``keep_free_bytes`` (4 GiB) would no longer be free, reports the
    rest as not mapped (no exception), and torch can still allocate most of what was kept
    (a forward's activations)."""
    torch = torch_on_gpu
    from proxima.memory.kv import KvMemory
    from proxima.memory.ops import Op

    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    keep, granule, page = 4 << 30, 32 * MiB, 64 * 1024
    blocks = (free0 + (8 << 30)) // granule * (granule // page)   # 8 GiB more than is free
    mem = KvMemory([page * blocks], blocks, granule_bytes=granule, device=0, mapped=1,
                   keep_free_bytes=keep)
    try:
        grow = mem.num_granules - 1
        failed = mem.apply([Op.map(1, grow)])
        free1, _ = torch.cuda.mem_get_info()
        mapped = mem.mapped_granules
        print(f"\nfree {free0 / 2**30:.2f} GiB; mapped {mapped} of {mem.num_granules} "
              f"granules of {granule // MiB} MiB; {free1 / 2**30:.2f} GiB left free")
        assert failed and failed[0][0] == mapped and sum(n for _, n in failed) == \
            mem.num_granules - mapped
        assert mem.stats["map_failures"] == mem.num_granules - mapped
        assert keep <= free1 < keep + 2 * granule + 512 * MiB      # kept, and not much more
        x = torch.empty(keep - 512 * MiB, dtype=torch.uint8, device="cuda")   # activations
        x.fill_(1)
        torch.cuda.synchronize()
        del x
        torch.cuda.empty_cache()
    finally:
        mem.close()


def test_maps_and_unmaps_on_the_mapping_thread_while_kernels_run(torch_on_gpu):
    """proxima.memory.background on the real driver: a grow is mapped while the forward's
    stream is busy, reported only when usable (zero-filled); a copy out of a granule queued
    on the forward's stream runs before the thread unmaps that granule."""
    torch = torch_on_gpu
    from proxima.memory.background import BackgroundOps
    from proxima.memory.kv import KvMemory
    from proxima.memory.ops import Op

    page, blocks = 64 * 1024, 4096                       # 32 blocks a granule, 4 regions
    mem = KvMemory([page * blocks] * 4, blocks, device=0, mapped=8)
    bg = BackgroundOps(mem)
    try:
        pages = [t.view(torch.int32).view(blocks, -1) for t in mem.tensors()]
        busy = torch.randn(8192, 8192, device="cuda")
        for _ in range(20):                              # the forward's stream is busy
            busy = busy @ busy / 8192
        t0 = time.perf_counter()
        bg.submit(0, (Op.map(8, 100),))
        submit_ms = (time.perf_counter() - t0) * 1e3
        assert bg.drain(30)
        done_ms = (time.perf_counter() - t0) * 1e3
        assert bg.poll() == [(0, ())] and mem.mapped_granules == 108
        assert all(int(torch.count_nonzero(p[256:3456])) == 0 for p in pages)
        for r, p in enumerate(pages):
            p[256:3456].copy_((torch.arange(256, 3456, device="cuda", dtype=torch.int32)
                               [:, None] * 4 + r).expand_as(p[256:3456]))

        # copy granule 100's blocks into granule 9 on the forward's stream, then unmap
        # 100..107 on the thread (it waits for the device first)
        for p in pages:
            p[288:320].copy_(p[3200:3232])
        bg.submit(1, (Op.unmap(100, 8),))
        assert bg.drain(30) and bg.poll() == [(1, ())] and mem.mapped_granules == 100
        for r, p in enumerate(pages):
            assert torch.equal(p[288:320, 0], torch.arange(3200, 3232, device="cuda",
                                                           dtype=torch.int32) * 4 + r)
        print(f"\nbackground map of 100 granules x 4 regions: submit {submit_ms:.2f} ms, "
              f"done after {done_ms:.1f} ms (behind busy kernels)")
    finally:
        bg.close()
        mem.close()


HOG = r"""
import sys, torch
free, _ = torch.cuda.mem_get_info()
keep = int(sys.argv[1])
hog = torch.empty(max(free - keep, 0), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
extra = []
for line in sys.stdin:
    try:
        extra.append(torch.empty(int(line), dtype=torch.uint8, device="cuda"))
        print("took", flush=True)
    except torch.OutOfMemoryError:
        print("oom", flush=True)
"""


def test_out_of_memory_on_map_is_a_result_and_freed_memory_serves_another_process(
        torch_on_gpu):
    """Another process holds all but 512 MiB: mapping 2 GiB stops short without raising;
    what was mapped works; memory we unmap can be taken by that process; once it exits
    all of it maps."""
    torch = torch_on_gpu
    torch.cuda.empty_cache()
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(512 * MiB)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        with arena(1024) as a:
            result = a.map(0, 1024)
            assert not result.ok and 32 < result.mapped < 1024
            assert result.failed == range(result.mapped, 1024)
            print(f"\nmapped {result.mapped} of 1024 granules before the GPU ran out")
            assert a.map(result.mapped, 1024).failed is not None   # still full: same answer
            kept = result.mapped - 16
            a.unmap(kept, result.mapped)            # 32 MiB of room for torch's own work
            x = a.region_tensor(0, kept * 2 * MiB)
            x.fill_(1)
            # Check it in 4 MiB slices: a whole-tensor sum would upcast to int64 and need
            # 8x the tensor in scratch memory, which the full GPU does not have.
            step = 4 * MiB
            assert all(int(x[i:i + step].sum(dtype=torch.int32)) == min(step, x.numel() - i)
                       for i in range(0, x.numel(), step))
            # give it all back: the other process can take (half of) it
            a.unmap(0, kept)
            hog.stdin.write(f"{kept * MiB}\n")
            hog.stdin.flush()
            assert hog.stdout.readline().strip() == "took"
            hog.stdin.close()
            hog.wait(timeout=60)
            assert a.map(0, 1024).ok and a.mapped_units == 1024
    finally:
        if hog.poll() is None:
            hog.kill()
            hog.wait(timeout=30)


def test_timings_map_2_gib_unmap_1_gib(torch_on_gpu):
    torch = torch_on_gpu
    from proxima.memory.driver import CudaDriver

    driver = CudaDriver(0)
    free0, _ = torch.cuda.mem_get_info()
    with arena(1024) as a:                               # 2 GiB of 2 MiB granules
        t0 = time.perf_counter()
        assert a.map(0, 1024).ok
        driver.synchronize()                            # includes the zero-fill
        map_s = time.perf_counter() - t0
        free1, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        assert a.unmap(0, 512) == 512
        unmap_s = time.perf_counter() - t0
        free2, _ = torch.cuda.mem_get_info()
    figures = {"map_2GiB_ms": round(map_s * 1e3, 2), "unmap_1GiB_ms": round(unmap_s * 1e3, 2),
               "free_drop_on_map_MiB": (free0 - free1) / MiB,
               "free_back_on_unmap_MiB": (free2 - free1) / MiB,
               "gpu": torch.cuda.get_device_name(0)}
    print("\nVMM timings:", json.dumps(figures))
    out = os.environ.get("PROXIMA_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "vmm_timings.json").write_text(json.dumps(figures, indent=1) + "\n")
    assert free0 - free1 >= 2000 * MiB and free2 - free1 >= 1000 * MiB   # really given back
