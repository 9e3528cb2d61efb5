"""What ``--sleep-after`` / ``--sleep-mode`` (proxima/serve/engine_sleep.py, the lifted refusal
in proxima/vllm/elastic_connector.py; docs/results/sleep-mode/NOTES.md) relies on in vLLM's
V1 engine, checked against the installed vLLM with one message naming the symbol:

  vllm.v1.engine.async_llm.AsyncLLM.sleep(level, mode) / wake_up(tags)   the engine client's calls
  vllm.v1.worker.gpu_worker.Worker.initialize_from_config                the connector (Proxima's
      worker side, its allocation hook) is made before the kv_cache memory pool context,
      the KV allocated inside it (Proxima's KV is outside vLLM's pool: mapped by Proxima)
  vllm.v1.worker.gpu_worker.Worker.wake_up                               remakes vLLM's own
      kv_cache-tagged tensors' state (post_kv_cache_wake_up)
"""

from __future__ import annotations

import inspect

import pytest

from .test_vllm_contract import ENGINE, VERSION, broken, params, symbol

from proxima.serve.serve_flags import SLEEP_MODE_RELEASES  # noqa: E402

pytestmark = pytest.mark.skipif(
    ENGINE != "v1" or not VERSION.startswith(SLEEP_MODE_RELEASES),
    reason=f"--sleep-mode is refused on vLLM {VERSION} (read for {SLEEP_MODE_RELEASES} only)")


def test_the_engine_client_sleeps_and_wakes_as_proxima_calls_it():
    sleep = symbol("vllm.v1.engine.async_llm.AsyncLLM.sleep")
    if params(sleep)[:3] != ["self", "level", "mode"]:
        broken("vllm.v1.engine.async_llm.AsyncLLM.sleep", f"its parameters are "
               f"{params(sleep)}; POST /proxima/sleep calls sleep(level=1, mode='wait')")
    wake = symbol("vllm.v1.engine.async_llm.AsyncLLM.wake_up")
    if params(wake)[:2] != ["self", "tags"]:
        broken("vllm.v1.engine.async_llm.AsyncLLM.wake_up", f"its parameters are "
               f"{params(wake)}; POST /proxima/wake_up calls wake_up() (every tag)")
    mode = inspect.signature(sleep).parameters["mode"].annotation
    if "wait" not in str(mode) and "PauseMode" not in str(mode):
        broken("vllm.v1.engine.async_llm.AsyncLLM.sleep", f"mode is {mode}, not a PauseMode "
                                                          f"with 'wait'")


def test_the_connector_is_made_before_the_kv_cache_pool_and_the_kv_inside_it():
    where = "vllm.v1.worker.gpu_worker.Worker.initialize_from_config"
    source = inspect.getsource(symbol(where))
    connector = source.find("ensure_kv_transfer_initialized(")
    pool = source.find('_maybe_get_memory_pool_context(tag="kv_cache")')
    allocate = source.find("initialize_kv_cache(", pool)
    if connector < 0 or pool < 0 or allocate < 0 or not connector < pool < allocate:
        broken(where, "the KV connector must be initialized before the kv_cache memory pool "
                      "context and the KV allocated inside it: the analysis that lifted the "
                      "refusal of sleep mode with elastic KV (sleep-mode NOTES.md, point 2) "
                      "assumed that order")


def test_a_wake_remakes_the_runners_kv_cache_state():
    where = "vllm.v1.worker.gpu_worker.Worker.wake_up"
    if "post_kv_cache_wake_up(" not in inspect.getsource(symbol(where)):
        broken(where, "it no longer calls the runner's post_kv_cache_wake_up: vLLM's "
                      "kv_cache-tagged tensors (block tables) would come back as garbage")
