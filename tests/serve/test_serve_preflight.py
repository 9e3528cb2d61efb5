"""The gpu / cuda / versions lines, from facts as the GPU probe reports them."""

from __future__ import annotations

from proxima.serve import gpuprobe, preflight

H200 = {
    "env": {}, "nvml": {"driver": "580.159.04", "cuda_driver": 13000, "device_count": 1},
    "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_available": True, "cuda_warnings": [],
    "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
    "devices": [{"index": 0, "name": "NVIDIA H200", "capability": [9, 0],
                 "total_memory": 150_000_000_000}],
    "kernel_ok": True,
}


def test_h200_passes_gpu_and_cuda():
    gpu, cuda = preflight.check_gpu(H200), preflight.check_cuda(H200)
    assert gpu.line() == "gpu: ok: 1 x NVIDIA H200 (compute capability 9.0, 139.7 GiB)"
    assert cuda.status == "ok" and "driver 580.159.04 (CUDA 13.0)" in cuda.detail


def test_driver_older_than_torch_cuda_fails_with_the_driver_to_install():
    facts = dict(H200, nvml={"driver": "550.54.15", "cuda_driver": 12040},
                 cuda_available=False, kernel_ok=False,
                 cuda_warnings=["CUDA initialization: The NVIDIA driver on your system is too old "
                                "(found version 12040)."])
    cuda = preflight.check_cuda(facts)
    assert cuda.failed
    assert "runs CUDA up to 12.4, but torch 2.11.0+cu130 needs CUDA 13.0" in cuda.detail
    assert cuda.fix == "upgrade the NVIDIA driver to 580.65.06 or newer"
    assert "driver on your system is too old" in preflight.check_gpu(facts).detail


def test_same_major_older_minor_driver_is_compatible():
    facts = dict(H200, nvml={"driver": "580.65.06", "cuda_driver": 13000}, torch_cuda="13.1")
    assert preflight.check_cuda(facts).status == "ok"


def test_gpu_too_old_for_this_torch_build():
    facts = dict(H200, devices=[{"index": 0, "name": "Tesla P100", "capability": [6, 0],
                                 "total_memory": 16 * 2**30}])
    gpu = preflight.check_gpu(facts)
    assert gpu.failed and "compute capability 6.0" in gpu.detail and "sm_75" in gpu.detail


def test_newer_gpu_runs_through_ptx():
    facts = dict(H200, devices=[{"index": 0, "name": "future", "capability": [13, 0],
                                 "total_memory": 2**30}])
    assert preflight.check_gpu(facts).status == "ok"  # compute_120 PTX is JIT-compiled


def test_hidden_gpus_are_named():
    facts = {"env": {"CUDA_VISIBLE_DEVICES": ""}, "nvml": {"driver": "580.1", "cuda_driver": 13000},
             "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_available": False,
             "cuda_warnings": []}
    gpu = preflight.check_gpu(facts)
    assert "no NVIDIA GPU visible" in gpu.detail and "CUDA_VISIBLE_DEVICES=''" in gpu.detail


def test_failed_kernel_is_reported():
    facts = dict(H200, kernel_ok=False, kernel_error="RuntimeError: CUDA error: uncorrectable ECC")
    cuda = preflight.check_cuda(facts)
    assert cuda.failed and "uncorrectable ECC" in cuda.detail


def test_probe_timeout_or_crash_is_a_failed_gpu_line():
    gpu = preflight.check_gpu({"probe_error": "the GPU probe did not finish within 120 s"})
    assert gpu.failed and "did not finish" in gpu.detail
    assert preflight.check_cuda({"probe_error": "x"}).status == "skipped"


def test_versions_line():
    tested = preflight.check_versions("0.26.0", "2.11.0+cu130", environ={})
    assert tested.status == "ok" and tested.detail.endswith(
        "(the tested stack, V1 engine); supports: allocator proven on GPU; elastic KV scheduler "
        "side proven on GPU; elastic KV worker side proven on GPU; compaction proven on GPU")
    line = preflight.check_versions("0.25.1", "2.10.0", environ={}).line()
    assert line.startswith("versions: failed: vllm 0.25.1, torch 2.10.0; tested: vllm 0.33.0 "
                           "with torch 2.14.0 (V1 engine, the newest tested stack); vllm 0.26.0 "
                           "with torch 2.11.0 (V1 engine, the tested stack); vllm 0.6.3.post1 "
                           "with torch 2.4.0 or 2.5.1 (V0 engine, the card stack) — ")
    assert "./dev" in line and "PROXIMA_ALLOW_UNTESTED_VLLM=1" in line


def test_card_stack_versions():
    for torch in ("2.4.0", "2.4.0+cu121", "2.5.1"):
        line = preflight.check_versions("0.6.3.post1", torch, environ={})
        assert line.status == "ok" and line.detail.endswith(
            "(the card stack, V0 engine); supports: allocator CPU-only; elastic KV scheduler "
            "side refused; elastic KV worker side refused; compaction refused"), line
    assert preflight.check_versions("0.6.3.post1", "2.11.0", environ={}).failed
    assert preflight.check_versions("0.26.0", "2.4.0", environ={}).failed


def test_the_newest_stack_says_its_worker_side_is_refused_unless_overridden():
    line = preflight.check_versions("0.33.0", "2.14.0", environ={})
    assert line.status == "ok" and line.detail.endswith(
        "(the newest tested stack, V1 engine); supports: allocator CPU-only; elastic KV "
        "scheduler side CPU-only; elastic KV worker side CPU-only (refused in an engine unless "
        "PROXIMA_ALLOW_UNPROVEN_ELASTIC=1); compaction CPU-only")
    allowed = preflight.check_versions(
        "0.33.0", "2.14.0", environ={"PROXIMA_ALLOW_UNPROVEN_ELASTIC": "1"})
    assert "CPU-only (allowed by PROXIMA_ALLOW_UNPROVEN_ELASTIC=1)" in allowed.detail
    bad = preflight.check_versions("0.33.0", "2.14.0",
                                   environ={"PROXIMA_ALLOW_UNPROVEN_ELASTIC": "on"})
    assert bad.failed and "PROXIMA_ALLOW_UNPROVEN_ELASTIC must be 1" in bad.detail


def test_untested_vllm_needs_the_explicit_override():
    """The engine's policy (activation.judge): any untested vLLM or torch, V0 or V1, needs
    PROXIMA_ALLOW_UNTESTED_VLLM=1, and with it passes as UNTESTED."""
    allowed = {"PROXIMA_ALLOW_UNTESTED_VLLM": "1"}
    for vllm, torch, engine in (("0.25.1", "2.10.0", "V1"), ("0.6.2", "2.4.0", "V0"),
                                ("0.6.3.post1", "2.11.0", "V0")):
        assert preflight.check_versions(vllm, torch, environ={}).failed
        line = preflight.check_versions(vllm, torch, environ=allowed)
        assert line.status == "ok" and "UNTESTED" in line.detail, line
        assert f"tried with the {engine} engine adapter" in line.detail
    bad = preflight.check_versions("0.25.1", "2.10.0",
                                   environ={"PROXIMA_ALLOW_UNTESTED_VLLM": "yes"})
    assert bad.failed and "PROXIMA_ALLOW_UNTESTED_VLLM must be 1" in bad.detail


def test_image_without_torch_or_gpu_says_no_gpu():
    """The slim image has neither torch nor a GPU: the line must name the missing GPU."""
    facts = {"env": {}, "dev_nodes": [], "nvml": {"error": "pynvml is not installed"},
             "torch_error": "ModuleNotFoundError: No module named 'torch'"}
    gpu = preflight.check_gpu(facts)
    assert gpu.detail.startswith("no NVIDIA GPU visible (no /dev/nvidia* device; torch cannot")
    assert gpu.fix == preflight.NO_GPU_FIX
    facts["dev_nodes"] = ["/dev/nvidia0"]
    gpu = preflight.check_gpu(facts)
    assert gpu.detail.startswith("an NVIDIA GPU is visible (/dev/nvidia0) but torch cannot")


def test_real_probe_on_this_machine_reports_no_gpu():
    """This test machine has no GPU: the real probe (a child process importing torch) says so."""
    facts = gpuprobe.probe()
    if facts.get("cuda_available"):
        import pytest
        pytest.skip("this machine has a GPU")
    gpu = preflight.check_gpu(facts)
    assert gpu.failed
    assert gpu.detail.startswith("no NVIDIA GPU visible (torch.cuda.is_available() is False")
    assert gpu.fix == "run on a machine with a GPU, or with docker run --gpus all"
