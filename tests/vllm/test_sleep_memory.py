"""GPU and host memory around vLLM's sleep, set up while a model that sleeps starts
(proxima/vllm/sleep_memory.py): the weights copied to host memory once, at start-up, and
released without a copy by every sleep; torch's GPU cache kept across the sleep.

CuMemAllocator needs CUDA, so its own ``sleep`` and ``wake_up`` are compiled here from vLLM's
source with the driver calls replaced (:class:`Driver`: "device" memory is host memory, a
release poisons it, cudaMemcpy is a memmove), and run over vLLM's own AllocationData: what
is checked is what vLLM's code does with what Proxima hands it. On a GPU,
tests/gpu/test_serve_multi_gpu.py checks the sleeps' times and the greedy outputs."""

from __future__ import annotations

import ast
import ctypes
import gc
import importlib.util
import logging
import types
from pathlib import Path

import pytest

from proxima.vllm import sleep_memory

torch = pytest.importorskip("torch")
AllocationData = pytest.importorskip("vllm.device_allocator").AllocationData

POISON = 0xAB


class Driver:
    """What vLLM's sleep and wake call of the CUDA driver, on host memory: an allocation's
    "device" bytes are a CPU tensor's, its pointer that tensor's address."""

    def __init__(self):
        self.memory: dict[int, torch.Tensor] = {}
        self.copies: list[tuple[str, int]] = []     # ("to host" | "to device", bytes)
        self.fail_release_of: int | None = None

    def allocate(self, size: int, fill: int) -> int:
        tensor = torch.full((size,), fill, dtype=torch.uint8)
        self.memory[tensor.data_ptr()] = tensor
        return tensor.data_ptr()

    def cudaMemcpy(self, dst: int, src: int, size: int) -> None:
        self.copies.append(("to device" if dst in self.memory else "to host", size))
        ctypes.memmove(dst, src, size)

    def unmap_and_release(self, handle) -> None:
        if handle[2] == self.fail_release_of:
            raise RuntimeError("cuMemUnmap failed")
        self.memory[handle[2]].fill_(POISON)        # what was there is gone

    def create_and_map(self, handle) -> None:
        pass                                        # mapped again: its bytes are undefined


def cumem_method(name: str) -> ast.FunctionDef:
    """CuMemAllocator's method ``name`` as vLLM's source has it (its module loads libcuda,
    so it is read, not imported)."""
    source = Path(importlib.util.find_spec("vllm.device_allocator.cumem").origin).read_text()
    cls = next(n for n in ast.parse(source).body
               if isinstance(n, ast.ClassDef) and n.name == "CuMemAllocator")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def vllms_sleep_and_wake(driver: Driver):
    """CuMemAllocator's ``sleep`` and ``wake_up``, compiled from vLLM's source (its module
    loads libcuda, so it is read, not imported) over ``driver``."""
    methods = [cumem_method("sleep"), cumem_method("wake_up")]
    import vllm.device_allocator
    from vllm.platforms import current_platform

    namespace = {"torch": torch, "gc": gc, "PIN_MEMORY": False, "libcudart": driver,
                 "unmap_and_release": driver.unmap_and_release,
                 "create_and_map": driver.create_and_map, "logger": logging.getLogger("vllm"),
                 "CuMemAllocator": types.SimpleNamespace(default_tag="default"),
                 "current_platform": current_platform,      # vLLM 0.33's wake asks it
                 "DEFERRABLE_TAGS": getattr(vllm.device_allocator, "DEFERRABLE_TAGS", ())}
    exec(compile(ast.Module(body=methods, type_ignores=[]), "cumem.py", "exec"), namespace)
    return namespace["sleep"], namespace["wake_up"]


class Allocator:
    """A CuMemAllocator's state (pointer -> vLLM's AllocationData) with vLLM's sleep and
    wake over a :class:`Driver`: two weights allocations, one of KV cache."""

    default_tag = "default"

    def __init__(self):
        self.driver = Driver()
        self.pointer_to_data = {}
        for tag, size, fill in (("weights", 4096, 1), ("kv_cache", 8192, 2),
                                ("weights", 1024, 3)):
            ptr = self.driver.allocate(size, fill)
            self.pointer_to_data[ptr] = AllocationData(handle=(0, size, ptr, len(
                self.pointer_to_data)), tag=tag)
        sleep, wake_up = vllms_sleep_and_wake(self.driver)
        self.sleep = types.MethodType(sleep, self)
        self.wake_up = types.MethodType(wake_up, self)

    def contents(self, tag: str) -> list[set[int]]:
        return [set(self.driver.memory[ptr].tolist())
                for ptr, data in self.pointer_to_data.items() if data.tag == tag]

    def keep_weights(self) -> dict:
        kept = sleep_memory.copy_weights(self.pointer_to_data, lambda size: torch.empty(
            size, dtype=torch.uint8), self.driver.cudaMemcpy)
        sleep_memory.wrap(self, kept)            # as set_up_sleep wraps vLLM's allocator
        return kept


@pytest.fixture(autouse=True)
def emptied(monkeypatch) -> list[str]:
    """torch's GPU cache emptied (``torch.cuda``'s or ``torch.accelerator``'s empty_cache):
    what vLLM's sleep and wake did, in order."""
    calls: list[str] = []
    for name in ("cuda", "accelerator"):
        module = getattr(torch, name, None)
        if module is not None and hasattr(module, "empty_cache"):
            monkeypatch.setattr(module, "empty_cache", lambda name=name: calls.append(name))
    return calls


def test_vllms_own_sleep_copies_the_weights_at_every_sleep(emptied):
    """What Proxima answers: vLLM's level-1 sleep copies the weights to the host every time,
    and empties torch's GPU cache."""
    pool = Allocator()
    for _ in range(2):
        pool.sleep(offload_tags=("weights",))
        assert pool.contents("weights") == [{POISON}, {POISON}]
        pool.wake_up()
        assert pool.contents("weights") == [{1}, {3}]
    assert [c for c in pool.driver.copies if c[0] == "to host"] == [("to host", 4096),
                                                                    ("to host", 1024)] * 2
    assert emptied                              # at least at each sleep's end


def test_wrapped_neither_sleep_nor_wake_empties_torchs_cache(emptied):
    pool = Allocator()
    pool.keep_weights()
    pool.sleep(offload_tags=("weights",))
    pool.wake_up()
    assert emptied == []
    torch.cuda.empty_cache()
    assert emptied == ["cuda"]                  # torch's own again after them


def test_the_weights_copied_at_start_up_are_released_without_a_copy_and_come_back():
    pool = Allocator()
    kept = pool.keep_weights()
    assert pool.driver.copies == [("to host", 4096), ("to host", 1024)]   # weights only
    assert sorted(host.numel() for host in kept.values()) == [1024, 4096]
    pool.driver.copies.clear()
    for cycle in range(3):
        pool.sleep(offload_tags=("weights",))
        assert pool.contents("weights") == [{POISON}, {POISON}], cycle   # released
        assert pool.contents("kv_cache") == [{POISON}]
        pool.wake_up(tags=["weights"])
        assert pool.contents("weights") == [{1}, {3}], cycle     # the start-up copy, back
        pool.wake_up(tags=["kv_cache"])
        assert all(data.cpu_backup_tensor is None for data in pool.pointer_to_data.values())
    assert [c[0] for c in pool.driver.copies] == ["to device"] * 6    # no sleep copied
    assert {data.tag for data in pool.pointer_to_data.values()} == {"weights", "kv_cache"}


def test_a_sleep_that_offloads_no_weights_is_vllms_own():
    """Level 2 (``offload_tags=()``): everything discarded, nothing comes back (vLLM reloads
    the weights itself); the tags are as they were."""
    pool = Allocator()
    pool.keep_weights()
    pool.driver.copies.clear()
    pool.sleep(offload_tags=())
    pool.wake_up()
    assert pool.driver.copies == []
    assert pool.contents("weights") == [{POISON}, {POISON}]
    # the default (None) offloads vLLM's "default" tag only: the weights are not kept either
    pool.sleep()
    pool.wake_up()
    assert pool.driver.copies == []


def test_a_sleep_that_fails_half_way_leaves_the_released_weights_their_copy(emptied):
    pool = Allocator()
    pool.keep_weights()
    second = [ptr for ptr, d in pool.pointer_to_data.items() if d.tag == "weights"][1]
    pool.driver.fail_release_of = second
    with pytest.raises(RuntimeError, match="cuMemUnmap failed"):
        pool.sleep(offload_tags=("weights",))
    torch.cuda.empty_cache()
    assert emptied == ["cuda"]                  # torch's own again, the sleep failed or not
    first, failed = (pool.pointer_to_data[p] for p in pool.pointer_to_data
                     if pool.pointer_to_data[p].tag == "weights")
    assert first.cpu_backup_tensor is not None     # released: its wake copies back
    assert failed.tag == "weights"
    pool.driver.fail_release_of = None
    pool.wake_up()
    assert pool.contents("weights")[0] == {1}


def test_a_second_sleep_while_asleep_keeps_the_weights_copy():
    """vLLM 0.33 skips an allocation asleep already (0.26 has no such check: its sleep is
    called once a wake): the copy stays, the wake brings it back."""
    pool = Allocator()
    pool.keep_weights()
    pool.sleep(offload_tags=("weights",))
    if "if data.is_asleep" not in ast.unparse(cumem_method("sleep")):
        pytest.skip("this vLLM's sleep does not skip allocations asleep already")
    pool.sleep(offload_tags=("weights",))
    pool.wake_up()
    assert pool.contents("weights") == [{1}, {3}]


def test_wrapped_once():
    pool = Allocator()
    pool.keep_weights()
    assert sleep_memory.keeping_cache(pool.sleep) is pool.sleep
    assert sleep_memory.keeping_cache(pool.wake_up) is pool.wake_up


def test_nothing_is_copied_or_wrapped_where_vllms_sleep_allocator_is_absent():
    """Without CUDA vLLM has no sleep-mode allocator: set_up_sleep raises (the connector
    logs it: vLLM's sleep as it is) and copies nothing."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_serve_multi_gpu.py checks the sleeps")
    for keep in (True, False):
        with pytest.raises(RuntimeError, match="[Ss]leep mode allocator is not available"):
            sleep_memory.set_up_sleep(keep_weights=keep)


def test_weights_stay_unless_lora_or_vllms_dev_mode(monkeypatch):
    from vllm.config import DeviceConfig, LoRAConfig, VllmConfig

    def config():
        return VllmConfig(device_config=DeviceConfig(device="cpu"))

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert sleep_memory.weights_stay(config()) is True
    with_lora = config()
    with_lora.lora_config = LoRAConfig()    # its checks against a model need a model's config
    assert sleep_memory.weights_stay(with_lora) is False
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert sleep_memory.weights_stay(config()) is False


def test_vllms_sleep_empties_torchs_cache_as_keeping_cache_expects():
    """The vLLM difference keeping_cache answers: CuMemAllocator's sleep ends by
    emptying torch's GPU cache (looked up on torch.cuda, or on 0.33 torch.accelerator, at
    call time)."""
    body = ast.unparse(cumem_method("sleep"))
    assert "torch.cuda.empty_cache()" in body or "torch.accelerator.empty_cache()" in body
