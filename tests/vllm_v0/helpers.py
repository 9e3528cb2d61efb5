"""Helpers for the card-stack tests (vLLM 0.6.x, V0 engine, on CPU).

Every test module here starts with ``card_stack_or_skip()``: in the tested-stack venv
(vLLM 0.26) the whole directory is reported as skipped, with the reason, and nothing
of vLLM is imported.
"""

from __future__ import annotations

from importlib import metadata

import pytest

RUN_HINT = "run them with: PROXIMA_STACK=card ./dev test tests/vllm_v0"


def installed_vllm() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def card_stack_or_skip() -> None:
    from proxima.vllm.activation import engine_for

    version = installed_vllm()
    if version is None or engine_for(version) != "v0":
        pytest.skip(f"card-stack tests need a vLLM of the V0 engine (0.6.3.post1), found "
                    f"{version or 'no vLLM'}; {RUN_HINT}", allow_module_level=True)


class SeqFactory:
    """Builds V0 sequence groups the way LLMEngine does (ids from one counter)."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.next_id = 0

    def group(self, prompt, max_tokens: int = 64, request_id: str | None = None):
        from vllm.inputs import token_inputs
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Sequence, SequenceGroup
        seq = Sequence(self.next_id, token_inputs(list(prompt)), self.block_size)
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        return SequenceGroup(request_id or f"r{seq.seq_id}", [seq], arrival_time=0.0,
                             sampling_params=params)


def make_manager(proxima: bool, num_gpu_blocks: int, num_cpu_blocks: int = 64,
                 block_size: int = 16, enable_caching: bool = True):
    """A V0 block manager (Proxima's or vLLM's), as the Scheduler builds it."""
    from proxima.vllm import vllm_v0
    cls = vllm_v0.ProximaBlockSpaceManager if proxima else vllm_v0.stock_manager_class()
    return cls(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
               num_cpu_blocks=num_cpu_blocks, watermark=0.01, sliding_window=None,
               enable_caching=enable_caching)


def allocate_running(manager, seq_group) -> None:
    """What Scheduler._allocate_and_set_running does."""
    from vllm.sequence import SequenceStatus
    manager.allocate(seq_group)
    for seq in seq_group.get_seqs(status=SequenceStatus.WAITING):
        seq.status = SequenceStatus.RUNNING


def decode(manager, seq, n: int = 1, token: int = 7) -> list:
    """Generate ``n`` tokens one step at a time: the output processor appends the token,
    the next schedule gives it a slot. Returns the copy-on-writes vLLM reports."""
    cows = []
    for _ in range(n):
        seq.append_token_id(token, {token: _logprob()})
        cows += manager.append_slots(seq, num_lookahead_slots=0)
    return cows


def _logprob():
    from vllm.sequence import Logprob
    return Logprob(0.0)


def runs(block_ids) -> int:
    from proxima.allocator import count_runs
    return count_runs(block_ids)
