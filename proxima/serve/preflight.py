"""The self-check lines that need no engine: gpu, cuda, versions.

Each function turns facts (from :mod:`proxima.serve.gpuprobe` or package metadata) into one
:class:`~proxima.serve.report.Check`, so the reasoning is testable with any facts.
"""

from __future__ import annotations

from proxima import __version__ as PROXIMA_VERSION
from proxima.vllm import activation
from proxima.vllm.activation import installed_version
from proxima.serve import gpuprobe
from proxima.serve.report import Check, failed, ok, skipped

# Which vLLM and torch are tested, and what the override allows: the one version policy,
# proxima/vllm/activation.py (the engine adapters ask the same).
INSTALL_HINT = activation.install_hint()
NO_GPU_FIX = "run on a machine with a GPU, or with docker run --gpus all"
# The oldest Linux driver branch that runs each CUDA major release (minor-version compatibility).
MIN_DRIVER_FOR_CUDA_MAJOR = {12: "525.60.13", 13: "580.65.06"}
# vLLM's CUDA kernels need Volta or newer.
MIN_CAPABILITY = (7, 0)


def is_card_stack(vllm: str | None) -> bool:
    """A vLLM of the V0 engine generation (the card stack's, 0.6.3.post1, or an untested
    one under the override): served through vLLM 0.6's own OpenAI app and engine client."""
    return vllm is not None and activation.engine_for(vllm) == "v0"


def _cuda_pair(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    major, _, minor = str(text).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


def _driver_cuda(facts: dict) -> tuple[int, int] | None:
    value = facts.get("nvml", {}).get("cuda_driver")  # 13000 -> (13, 0)
    return (value // 1000, (value % 1000) // 10) if isinstance(value, int) else None


def _arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """True when torch ships code this GPU runs: sm_XY of the same major, or PTX to JIT."""
    if not arch_list:
        return capability >= MIN_CAPABILITY
    cc = capability[0] * 10 + capability[1]
    for arch in arch_list:
        kind, _, num = arch.partition("_")
        digits = "".join(ch for ch in num if ch.isdigit())
        if not digits:
            continue
        value = int(digits)
        if kind == "sm" and value // 10 == capability[0] and value <= cc:
            return True
        if kind == "compute" and value <= cc:
            return True
    return False


def _no_gpu_reasons(facts: dict) -> list[str]:
    why = []
    visible = facts.get("env", {}).get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "void"):
        why.append(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
    if not facts.get("dev_nodes") and "dev_nodes" in facts:
        why.append("no /dev/nvidia* device")
    nvml_error = facts.get("nvml", {}).get("error", "")
    if "LibraryNotFound" in nvml_error:
        why.append("no NVIDIA driver library in this environment")
    elif nvml_error and "not installed" not in nvml_error:
        why.append(f"NVML: {nvml_error}")
    return why


def check_gpu(facts: dict) -> Check:
    if "probe_error" in facts:
        return failed("gpu", facts["probe_error"], "check the GPU with nvidia-smi on the host")
    seen = facts.get("dev_nodes") or facts.get("nvml", {}).get("device_count")
    if "torch_error" in facts:
        if not seen:
            why = _no_gpu_reasons(facts) + [f"torch cannot be imported either: {facts['torch_error']}"]
            return failed("gpu", f"no NVIDIA GPU visible ({'; '.join(why)})", NO_GPU_FIX)
        where = ", ".join(facts.get("dev_nodes") or []) or "NVML"
        return failed("gpu", f"an NVIDIA GPU is visible ({where}) but torch cannot be imported "
                             f"({facts['torch_error']})", INSTALL_HINT)
    if not facts.get("cuda_available"):
        why = ["torch.cuda.is_available() is False"] + _no_gpu_reasons(facts)
        if facts.get("torch_cuda") is None:
            why.append(f"torch {facts.get('torch')} is a CPU-only build")
        if seen:
            why.append(f"the kernel driver is loaded ({facts.get('proc_driver', 'a /dev/nvidia* device exists')})")
        why += [w.splitlines()[0] for w in facts.get("cuda_warnings", [])[:1]]
        return failed("gpu", f"no NVIDIA GPU visible ({'; '.join(why)})", NO_GPU_FIX)
    devices = facts.get("devices", [])
    arch_list = facts.get("arch_list", [])
    for dev in devices:
        cap = tuple(dev["capability"])
        if cap < MIN_CAPABILITY or not _arch_supported(cap, arch_list):
            return failed(
                "gpu", f"GPU {dev['index']} {dev['name']} has compute capability "
                       f"{cap[0]}.{cap[1]}, which torch {facts.get('torch')} does not support "
                       f"(built for {', '.join(arch_list) or 'unknown'})",
                "use a GPU of compute capability 7.5 or newer (Turing, Ampere, Hopper, ...), "
                "or hide this one with CUDA_VISIBLE_DEVICES")
    names = sorted({d["name"] for d in devices})
    first = devices[0]
    return ok("gpu", f"{len(devices)} x {', '.join(names)} (compute capability "
                     f"{first['capability'][0]}.{first['capability'][1]}, "
                     f"{first['total_memory'] / 2**30:.1f} GiB)")


def check_cuda(facts: dict) -> Check:
    if "probe_error" in facts or "torch_error" in facts:
        return skipped("cuda", "no facts (see the gpu line)")
    runtime = _cuda_pair(facts.get("torch_cuda"))
    if runtime is None:
        return failed("cuda", f"torch {facts.get('torch')} is built without CUDA", INSTALL_HINT)
    driver = _driver_cuda(facts)
    driver_version = facts.get("nvml", {}).get("driver", "unknown")
    if driver is not None and driver[0] < runtime[0]:
        need = MIN_DRIVER_FOR_CUDA_MAJOR.get(runtime[0], "a newer one")
        return failed("cuda", f"NVIDIA driver {driver_version} runs CUDA up to "
                              f"{driver[0]}.{driver[1]}, but torch {facts.get('torch')} needs "
                              f"CUDA {runtime[0]}.{runtime[1]}",
                      f"upgrade the NVIDIA driver to {need} or newer")
    if not facts.get("cuda_available"):
        if driver is None:
            return skipped("cuda", "no NVIDIA driver visible (see the gpu line)")
        warning = (facts.get("cuda_warnings") or ["no reason given"])[0].splitlines()[0]
        return failed("cuda", f"the CUDA runtime did not start with driver {driver_version}: "
                              f"{warning}", "check the driver with nvidia-smi; reboot after "
                                            "a driver upgrade")
    if not facts.get("kernel_ok"):
        return failed("cuda", f"a test kernel failed: {facts.get('kernel_error', 'wrong result')}",
                      "check the driver with nvidia-smi; the GPU may be in a bad state (Xid)")
    drv = f"{driver[0]}.{driver[1]}" if driver else "unknown"
    return ok("cuda", f"driver {driver_version} (CUDA {drv}) runs torch's CUDA "
                      f"{runtime[0]}.{runtime[1]}; a test kernel ran")


def check_versions(vllm: str | None = None, torch: str | None = None, environ=None) -> Check:
    """The installed vLLM and torch against the version policy (activation.judge), and what
    that stack supports, feature by feature (the version table's :class:`Support`)."""
    vllm = vllm if vllm is not None else installed_version("vllm")
    torch = torch if torch is not None else installed_version("torch")
    seen = f"vllm {vllm or 'not installed'}, torch {torch or 'not installed'}"
    if vllm is None:
        return failed("versions", seen, INSTALL_HINT)
    try:
        verdict = activation.judge(vllm, torch, environ)
    except activation.ActivationError as exc:
        return failed("versions", f"{seen}; {exc}",
                      f"set {activation.ALLOW_UNTESTED_ENV} to 1 or 0, or unset it")
    engine = activation.ENGINE_NAMES[verdict.engine]
    if verdict.tested:
        try:
            supports = activation.support_line(vllm, environ)
        except activation.ActivationError as exc:
            return failed("versions", f"{seen}; {exc}",
                          f"set {activation.ALLOW_UNPROVEN_ENV} to 1 or 0, or unset it")
        return ok("versions", f"{seen}, proxima {PROXIMA_VERSION} ({verdict.entry.stack}, "
                              f"{engine}); supports: {supports}")
    if verdict.allowed:
        return ok("versions", f"{seen}: UNTESTED (tested: {activation.tested_summary()}), "
                              f"tried with the {engine} adapter, allowed by "
                              f"{activation.ALLOW_UNTESTED_ENV}=1")
    return failed("versions", f"{seen}; tested: {activation.tested_summary()}",
                  f"{INSTALL_HINT}; or set {activation.ALLOW_UNTESTED_ENV}=1 to try this "
                  f"one anyway")


def run_preflight(facts: dict | None = None) -> list[Check]:
    """gpu, cuda, versions: the checks that need no engine. Probes the GPU if not given facts."""
    facts = gpuprobe.probe() if facts is None else facts
    return [check_gpu(facts), check_cuda(facts), check_versions()]
