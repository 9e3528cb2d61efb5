"""Where vLLM's V1 code differs between the tested releases (0.26.0, 0.33.0): one place each.

Each function below is named for what changed and finds the installed vLLM's way by feature
(which module exists), never by its version string, so a release in between resolves to
whichever side it already has. Everything else Proxima touches is the same in both releases:
``FreeKVCacheBlockQueue``'s methods (``popleft``, ``popleft_n``, ``remove``, ``append``,
``append_n``, ``prepend_n``, ``get_all_free_blocks``, ``iter_blocks_after``),
``SingleTypeKVCacheManager.allocate_new_blocks(request_id, num_tokens,
num_tokens_main_model)`` and ``_partial_hit_reqs``, ``KVCacheManager.free`` /
``new_step_starts``, ``Scheduler.add_request``, ``AsyncScheduler``, and the replay driver's
``Request`` / ``ModelRunnerOutput`` / ``SchedulerConfig`` arguments.

Differences that need no code here (the adapter already copes; each is covered by a test in
tests/vllm on the release that has it):

* ``BlockPool.__init__`` gained ``num_hash_lookahead_tokens=`` and ``medium=`` (0.33): the
  Proxima pool passes every argument through to stock's constructor and reads only what it
  built (``num_gpu_blocks``, ``hash_block_size``, ``blocks``, ``null_block``).
* ``KVCacheBlock.pool`` (0.33): ``BlockPool.free_blocks`` hands a block that belongs to
  another pool back to that pool. The blocks of a Proxima pool are built by stock's
  constructor with ``pool=self``, so they stay in its queue.
* ``BlockPool.unpin_blocks`` (0.33, HiSparse): released blocks go to the tail of the free
  queue (``append_n``) whether or not they carry a hash, as last-resort eviction candidates.
  In Proxima's queue that is the LRU tier: handed out only when the buddy is empty, least
  recently released first, exactly as stock.
"""

from __future__ import annotations

import importlib
import importlib.util


def _first_module(*names: str):
    """The first of ``names`` that the installed vLLM has (an import error inside an
    existing module is raised, not skipped)."""
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:     # a parent package is missing
            found = False
        if found:
            return importlib.import_module(name)
    raise ImportError(f"none of {', '.join(names)} is in the installed vLLM")


def serve_cli_args():
    """The module with ``make_arg_parser`` and ``validate_parsed_serve_args`` (``vllm
    serve``'s options): ``vllm.entrypoints.openai.cli_args`` up to 0.26 (and on the card
    stack), ``vllm.entrypoints.common.cli_args`` in 0.33."""
    return _first_module("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args")


def cli_env_setup() -> None:
    """Run ``vllm serve``'s process set-up (spawn, not fork, for engine processes): it lives
    in ``vllm.entrypoints.serve.utils.api_utils`` in 0.26, ``vllm.entrypoints.common.startup``
    in 0.33."""
    _first_module("vllm.entrypoints.common.startup",
                  "vllm.entrypoints.serve.utils.api_utils").cli_env_setup()


def api_server_app():
    """``(build_app, init_app_state)`` of vLLM's OpenAI server, same signatures in both: in
    ``vllm.entrypoints.openai.api_server`` in 0.26; 0.33 moved them under
    ``vllm.entrypoints.launchers`` and left a shim there that warns when imported."""
    try:
        app = _first_module("vllm.entrypoints.launchers.app")
        state = _first_module("vllm.entrypoints.launchers.api_server.app_state")
    except ImportError:
        app = state = importlib.import_module("vllm.entrypoints.openai.api_server")
    return app.build_app, state.init_app_state



def kv_cache_tensors(num_blocks: int, page_bytes: int, layer_names: list[str]) -> list:
    """``KVCacheConfig.kv_cache_tensors`` for one region of ``num_blocks`` pages per layer:
    0.26 says it as one ``KVCacheTensor(size, shared_by=[layer])`` per layer; 0.33 as one
    backing allocation, ``KVCacheTensor(size, layers, layer_stride, block_stride)``
    (layer-outermost: each layer's pages contiguous)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor

    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    region = num_blocks * page_bytes
    if "shared_by" in fields:
        return [KVCacheTensor(size=region, shared_by=[name]) for name in layer_names]
    return [KVCacheTensor(size=region * len(layer_names), layers=list(layer_names),
                          layer_stride=region, block_stride=page_bytes)]
