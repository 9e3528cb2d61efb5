"""proxima.serve.sizing: the elastic engine's sizes with no sizing flag, and the fit of
several models on one GPU (pure arithmetic: any GPU, any other engines)."""

import pytest

from proxima.config import GiB, MiB
from proxima.errors import UserError
from proxima.serve import sizing
from proxima.serve.sizing import DEFAULT_KV_MIN, Other, check_fit, plan

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
T = 80 * GiB


def test_parameter_count_matches_the_published_counts():
    assert sizing.parameter_count(LLAMA_8B) == 8_030_261_248          # exactly Meta's
    # Qwen2.5-0.5B: 494,032,768 published, of which 27,648 are the q/k/v biases left out
    assert sizing.parameter_count(QWEN_05B) == 494_032_768 - 24 * (896 + 2 * 128)
    # "Model loading took 14.96 GiB" for dummy Llama-3.1-8B on the H200 (run logs)
    assert sizing.weights_estimate(LLAMA_8B) / GiB == pytest.approx(14.96, abs=0.01)


def test_bytes_per_parameter_follows_dtype_and_quantization():
    assert sizing.bytes_per_parameter(LLAMA_8B) == 2
    assert sizing.bytes_per_parameter({**LLAMA_8B, "torch_dtype": "float32"}) == 2  # auto
    assert sizing.bytes_per_parameter(LLAMA_8B, dtype="float32") == 4
    assert sizing.bytes_per_parameter({**LLAMA_8B, "quantization_config": {"bits": 4}}) == 0.5
    assert sizing.bytes_per_parameter(LLAMA_8B, quantization="fp8") == 1


def test_a_config_without_a_needed_field_names_it():
    with pytest.raises(ValueError, match="hidden_size"):
        sizing.parameter_count({"num_hidden_layers": 2})


def test_one_engine_alone_may_map_what_the_gpu_holds_beside_its_weights():
    s = plan(T, 18 * GiB)
    assert s.kv_min == DEFAULT_KV_MIN
    assert s.kv_max == T - 18 * GiB == s.reservation
    assert s.utilization == 0.24                   # (18 GiB + 0.5 GiB) / 80 GiB = 0.231, up
    assert "--kv-max 62.00 GiB" in s.line() and "\n" not in s.line()


def test_several_engines_each_keep_the_others_minimums_and_weights():
    a = plan(T, 18 * GiB)
    b = plan(T, 4 * GiB, [Other(nonkv=18 * GiB, min=a.kv_min)])
    c = plan(T, 2 * GiB, [Other(nonkv=18 * GiB, min=a.kv_min),
                          Other(nonkv=4 * GiB, min=b.kv_min)])
    assert b.kv_max == T - 4 * GiB - 18 * GiB - DEFAULT_KV_MIN
    assert c.kv_max == T - 2 * GiB - 22 * GiB - 2 * DEFAULT_KV_MIN
    # whatever the others map, each can always hold its non-KV memory and its minimum
    assert c.nonkv + c.kv_min + 22 * GiB + 2 * DEFAULT_KV_MIN <= T
    assert c.reservation == T - 2 * GiB                   # virtual: the most it could map alone
    assert c.others == 2 and "2 other engine(s)" in c.line()


def test_overrides_are_kept():
    s = plan(T, 18 * GiB, kv_min=2 * GiB, kv_max=20 * GiB, reservation=40 * GiB,
             utilization=0.3)
    assert (s.kv_min, s.kv_max, s.reservation, s.utilization) == (2 * GiB, 20 * GiB,
                                                                   40 * GiB, 0.3)
    # a given reservation bounds the default maximum
    assert plan(T, 18 * GiB, reservation=10 * GiB).kv_max == 10 * GiB
    with pytest.raises(UserError, match="--kv-max .* below --kv-min"):
        plan(T, 18 * GiB, kv_min=4 * GiB, kv_max=2 * GiB)
    # a given pool below the default minimum (the embedded demo's 256 MiB) bounds both
    demo = plan(T, 2 * GiB, reservation=256 * MiB, utilization=0.1)
    assert (demo.kv_min, demo.kv_max, demo.reservation) == (256 * MiB, 256 * MiB, 256 * MiB)
    with pytest.raises(UserError, match="--kv-min 1.00 GiB is above the KV pool of 0.25 GiB"):
        plan(T, 2 * GiB, reservation=256 * MiB, kv_min=GiB)


def test_a_second_engine_started_while_one_holds_memory_asks_it_to_give_back():
    holder = Other(nonkv=18 * GiB, min=DEFAULT_KV_MIN, mapped=58 * GiB)   # it took nearly all
    free = T - 18 * GiB - 58 * GiB                                         # 4 GiB free
    s = plan(T, 6 * GiB, [holder], gpu_free=free)
    assert s.ask_bytes == 6 * GiB + DEFAULT_KV_MIN - free                 # asked through the ledger
    assert s.kv_max == T - 6 * GiB - 18 * GiB - DEFAULT_KV_MIN
    # memory another process holds (not an engine's above its minimum) is not there to be
    # asked for: refused at once
    at_min = Other(nonkv=18 * GiB, min=8 * GiB, mapped=8 * GiB)
    with pytest.raises(UserError, match="has 4.00 GiB free; the other Proxima engines could "
                                        "give back 0.00 GiB"):
        plan(T, 6 * GiB, [at_min], gpu_free=free)


def test_a_model_that_cannot_fit_beside_the_others_is_one_line_with_the_sums():
    with pytest.raises(UserError) as err:
        plan(T, 50 * GiB, [Other(nonkv=30 * GiB, min=GiB)])
    line = str(err.value)
    assert "\n" not in line and "= 81.50 GiB > the GPU's 80.00 GiB" in line
    assert "does not fit" in line and "1 other engine(s) 31.00 GiB" in line
    with pytest.raises(UserError, match="does not fit"):
        plan(T, 10 * GiB, kv_min=71 * GiB)


def test_several_models_must_fit_at_their_minimums():
    models = [("chat", 18 * GiB, 2 * GiB), ("small", 3 * GiB, 512 * MiB)]
    assert check_fit(models, T) == 18 * GiB + 2 * GiB + 3 * GiB + 512 * MiB
    with pytest.raises(UserError) as err:
        check_fit(models + [("big", 60 * GiB, 0)], T, source="--gpu-memory-bytes")
    line = str(err.value)
    assert "chat 20.00 GiB + small 3.50 GiB + big 60.00 GiB = 83.50 GiB > " \
           "--gpu-memory-bytes's 80.00 GiB" in line
    with pytest.raises(UserError, match="engine.s. already on it"):
        check_fit(models, T, [Other(nonkv=60 * GiB, min=0)])


def test_what_the_sequences_could_ever_use_bounds_the_maximum_and_the_reservation():
    assert sizing.kv_bytes_per_token(LLAMA_8B) == 128 * 1024      # 32 layers x 2 x 8 x 128 x 2
    tiny = 256 * 2048 * 4096                 # 256 sequences of 2048 tokens of 4 KiB
    s = plan(T, 3 * GiB, usable=tiny)
    assert s.kv_max == s.reservation == tiny
    assert plan(T, 3 * GiB, usable=tiny, kv_max=4 * tiny).reservation == 4 * tiny


# ------------------------------------------------------------------ applied to serve's options
import argparse  # noqa: E402
import os  # noqa: E402
import json  # noqa: E402

from proxima.memory.ledger import Ledger, ledger_path, live_records  # noqa: E402
from proxima.serve import autosize  # noqa: E402


def model_dir(tmp_path, config=LLAMA_8B, name="llama"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return str(path)


def vllm_options(model, **given):
    base = dict(model=model, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9,
                max_model_len=None, max_num_seqs=None, served_model_name=None, port=8000,
                uds=None, dtype="auto", quantization=None, kv_cache_dtype="auto",
                tensor_parallel_size=1, pipeline_parallel_size=1)
    return argparse.Namespace(**{**base, **given})


def gpu(total=T, free=None, uuid="GPU-test"):
    return {"devices": [{"index": 0, "total_memory": total, "uuid": uuid,
                         **({"free_memory": free} if free is not None else {})}]}


def test_serve_with_no_sizing_flag_gets_every_size_and_the_ledger_fields(tmp_path):
    vargs = vllm_options(model_dir(tmp_path), max_model_len=4096, max_num_seqs=64)
    elastic = {}
    s = autosize.apply(vargs, [vargs.model], elastic, gpu())
    nonkv = sizing.nonkv_estimate(sizing.weights_estimate(LLAMA_8B))
    usable = 128 * 1024 * 4096 * 64                          # 32 GiB: 64 sequences of 4096
    assert (s.nonkv, s.kv_max, s.reservation) == (nonkv, usable, usable)
    assert vargs.kv_cache_memory_bytes == usable
    assert vargs.gpu_memory_utilization == s.utilization < 0.25
    assert elastic == {"min_bytes": DEFAULT_KV_MIN, "max_bytes": usable,
                       "ledger_model": vargs.model, "ledger_port": 8000,
                       "ledger_nonkv_bytes": nonkv}


def test_given_sizes_are_kept_and_the_rest_computed(tmp_path):
    vargs = vllm_options(model_dir(tmp_path), kv_cache_memory_bytes=20 * GiB,
                         served_model_name=["chat"])
    elastic = {"min_bytes": "2GiB"}
    argv = [vargs.model, "--kv-cache-memory-bytes", "20GiB", "--kv-min", "2GiB"]
    s = autosize.apply(vargs, argv, elastic, gpu())
    assert vargs.kv_cache_memory_bytes == 20 * GiB and s.reservation == 20 * GiB
    assert elastic["min_bytes"] == "2GiB" and elastic["max_bytes"] == 20 * GiB
    assert vargs.gpu_memory_utilization == s.utilization   # vLLM's 0.9 check no longer needed
    assert elastic["ledger_model"] == "chat"


def test_the_second_engine_counts_the_first_from_the_gpus_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("PROXIMA_LEDGER_DIR", str(tmp_path))
    first = Ledger(ledger_path("GPU-test"), model="chat", port=8101, nonkv=20 * GiB)
    first.post(6 * GiB, 4 * GiB, maximum=40 * GiB)         # this process stands for it
    try:
        vargs = vllm_options(model_dir(tmp_path, QWEN_05B, "qwen"), max_model_len=32768,
                             max_num_seqs=1024)
        elastic = {}
        s = autosize.apply(vargs, [vargs.model], elastic, gpu())
        assert s.others == 1 and s.others_claim == 24 * GiB
        assert s.kv_max == T - s.nonkv - 24 * GiB          # the first's min and weights kept
        assert "--kv-max" in s.line() and "now (it follows what the others leave)" in s.line()
        # ... now: the fixed maximum is the pool's, and what the first engine holds bounds
        # it at run time from the ledger (so it may grow once the first stops or sleeps)
        assert elastic["max_bytes"] == s.reservation == T - s.nonkv > s.kv_max
        given = {"max_bytes": "30GiB"}
        s = autosize.apply(vllm_options(vargs.model, max_model_len=32768, max_num_seqs=1024),
                           [vargs.model, "--kv-max", "30GiB"], given, gpu())
        assert given["max_bytes"] == "30GiB" and "follows" not in s.line()
    finally:
        first.close()
    assert live_records(ledger_path("GPU-test")) == ()


def test_gpu_memory_bytes_plans_for_a_gpu_of_that_size(tmp_path):
    vargs = vllm_options(model_dir(tmp_path))
    with pytest.raises(UserError, match="does not fit .* the GPU's 10.00 GiB"):
        autosize.apply(vargs, [vargs.model], {}, {}, gpu_bytes=10 * GiB)
    assert autosize.take_gpu_bytes(["m", "--gpu-memory-bytes=80GiB", "--x"]) == (["m", "--x"],
                                                                                  80 * GiB)
    with pytest.raises(UserError, match="--gpu-memory-bytes: 'lots' is not a size"):
        autosize.take_gpu_bytes(["--gpu-memory-bytes", "lots"])


def test_a_starting_engine_asks_the_others_through_the_ledger_and_takes_its_record_away(
        tmp_path):
    frees = iter([4 * GiB, 4 * GiB, 5 * GiB, 7 * GiB])     # the GPU's free memory, polled
    seen = []

    def look(_):
        seen.append([(r.name, r.unmet) for r in live_records(path)])

    path = ledger_path("GPU-test", tmp_path)
    autosize.ask_others("GPU-test", 3 * GiB, lambda: next(frees), ledger_dir=str(tmp_path),
                        sleep=look)
    assert seen[0] == [("starting", 3 * GiB)]               # the others read this demand
    assert live_records(path) == ()                          # and it is gone once met
    frees = iter([4 * GiB] * 10)
    with pytest.raises(UserError, match="gave back 0.00 GiB of the 3.00 GiB"):
        autosize.ask_others("GPU-test", 3 * GiB, lambda: next(frees),
                            ledger_dir=str(tmp_path), timeout=1.0, sleep=lambda s: None)
    assert live_records(path) == ()


SIZED_BY_VLLMS_PARSER = """
import json, os, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()     # vLLM's parser needs a platform
from proxima.serve import autosize, vllm_args
argv = [sys.argv[1], "--max-model-len", "8192", "--port", "8123", "--served-model-name", "chat"]
vargs = vllm_args.parse(argv)
elastic = {}
facts = {"devices": [{"total_memory": 80 << 30, "uuid": "GPU-parser"}]}
s = autosize.apply(vargs, argv, elastic, facts)
print(json.dumps([vargs.kv_cache_memory_bytes, vargs.gpu_memory_utilization, elastic]))
"""


def test_the_options_of_vllms_own_parser_are_sized(tmp_path):
    """vLLM's real parser (under its CPU platform, in a child: the platform is global): the
    attributes the sizing reads and sets are vLLM's."""
    import subprocess
    import sys

    model = model_dir(tmp_path)
    done = subprocess.run([sys.executable, "-c", SIZED_BY_VLLMS_PARSER, model],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PROXIMA_ALLOCATOR": "1", "PROXIMA_ELASTIC": "1",
                               "PROXIMA_LEDGER_DIR": str(tmp_path),
                               # the sizing is the subject; on 0.33 the elastic worker side
                               # is refused without the override (never run on a GPU)
                               "PROXIMA_ALLOW_UNPROVEN_ELASTIC": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    reserved, util, elastic = json.loads(done.stdout.strip().splitlines()[-1])
    nonkv = sizing.nonkv_estimate(sizing.weights_estimate(LLAMA_8B))
    assert reserved == T - nonkv and util == 0.23      # 1024 sequences of 8192 use more
    assert elastic == {"min_bytes": DEFAULT_KV_MIN, "max_bytes": T - nonkv,
                       "ledger_model": "chat", "ledger_port": 8123,
                       "ledger_nonkv_bytes": nonkv}


CHAIN_OF_THE_SEVERAL_MODELS_SERVE = """
import json, os, sys
from types import SimpleNamespace
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()     # vLLM's parser needs a platform
from proxima.serve import autosize, multi, multi_config, serve_flags, vllm_args
from proxima.serve.cli import size_elastic
from proxima.serve.serve_flags import take_elastic_options
from proxima.vllm import activation, elastic_v1

plan = multi_config.parse_command_line(
    ["--enforce-eager", *[a for m in sys.argv[1:] for a in ("--model", m)]])
facts = {"devices": [{"total_memory": 80 << 30, "uuid": "GPU-chain"}]}


def engine(n, port):
    # the model's single-model proxima serve, its argv as the several-models serve builds it,
    # read in proxima.serve.cli.run's order: the plugin activates when vLLM's parser is built,
    # the sizing comes after
    command = multi.engine_command(plan.models[n], port, plan)
    argv = command[command.index("serve") + 1:]
    argv, _ = serve_flags.take_compaction(argv)
    argv, gpu_bytes = autosize.take_gpu_bytes(argv)
    argv, elastic = take_elastic_options(argv)
    if elastic:
        os.environ[activation.ELASTIC_OPTIONS_ENV] = json.dumps(elastic)
    vargs = vllm_args.parse(argv)
    sized = size_elastic(vargs, argv, elastic, facts, gpu_bytes)
    config = vllm_args.engine_config(vargs)
    extra = config.kv_transfer_config.kv_connector_extra_config
    return elastic, sized, elastic_v1.ElasticOptions.from_extra(extra)


class Nvml:                                      # NVML's part of open_gpu_ledger, stood in
    def nvmlInit(self): pass
    def nvmlDeviceGetHandleByIndex(self, index): return index
    def nvmlDeviceGetUUID(self, handle): return b"GPU-chain"
    def nvmlDeviceGetMemoryInfo(self, handle): return SimpleNamespace(free=1, total=80 << 30)


import vllm.utils.import_utils as import_utils
from proxima.vllm.elastic_control import open_gpu_ledger

elastic, first, options = engine(0, 8301)
platforms._current_platform.is_cuda = lambda: True
platforms._current_platform.device_id_to_physical_device_id = lambda index: index
import_utils.import_pynvml = lambda: Nvml()
ledger, _ = open_gpu_ledger(options)
ledger.post(1 << 30, 1 << 30, maximum=62 << 30)  # what the big engine posted: 1 granule
_, second, _ = engine(1, 8302)
print(json.dumps([elastic, options.max_bytes, options.ledger_nonkv_bytes, first.nonkv,
                  second.others, second.others_claim, second.kv_max, second.nonkv]))
"""


def test_the_engines_of_the_several_models_serve_count_each_others_weights(tmp_path):
    """The three-model H100 run (docs/results/h100-2026-12-05-s23): `proxima serve --models
    FILE` started big (dummy Llama-3.1-8B) then mid; mid counted big as 1.00 GiB (its
    minimum) instead of ~17.71 + 1.00 GiB: the sizing's elastic options (the ledger's
    nonkv, --kv-max) were written to PROXIMA_ELASTIC_OPTIONS after the plugin had read the
    variable, so the connector never got them. Here the real chain on CPU: multi's engine
    command, the serve's option handling, vLLM's parser and engine config, the connector's
    options, the GPU ledger (NVML stood in), the second engine's sizing."""
    import subprocess
    import sys

    from .conftest import card_stack

    if card_stack():
        pytest.skip("elastic KV memory needs vLLM's V1 engine")

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tok = "--tokenizer proxima/models/tiny-llama --load-format dummy --max-model-len 8192"
    env = {k: v for k, v in os.environ.items() if k != "PROXIMA_ELASTIC_OPTIONS"}
    done = subprocess.run(
        [sys.executable, "-c", CHAIN_OF_THE_SEVERAL_MODELS_SERVE,
         f"big=tools/gpu/dummy-llama {tok}", f"mid=tools/gpu/dummy-llama-3b {tok}"],
        capture_output=True, text=True, timeout=300, cwd=repo,
        env={**env, "PROXIMA_ALLOCATOR": "1", "PROXIMA_ELASTIC": "1",
             "PROXIMA_LEDGER_DIR": str(tmp_path), "PROXIMA_ALLOW_UNPROVEN_ELASTIC": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    elastic, max_bytes, ledger_nonkv, nonkv, others, claim, kv_max, mid_nonkv = json.loads(
        done.stdout.strip().splitlines()[-1])
    assert ledger_nonkv == nonkv == elastic["ledger_nonkv_bytes"] > 17 * GiB
    assert max_bytes == elastic["max_bytes"]            # the sizing's --kv-max is applied
    assert others == 1 and claim == nonkv + GiB         # big's weights and minimum kept
    assert kv_max == 80 * GiB - mid_nonkv - nonkv - GiB
