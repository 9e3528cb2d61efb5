"""Facts about the GPU, gathered in a child process: ``python -m proxima.serve.gpuprobe``.

Why a child: touching CUDA in a process makes CUDA unusable in the processes it later forks
(gunicorn forks the worker, vLLM forks the engine core). The child initialises CUDA, runs one
small kernel, prints one JSON line and exits, leaving the caller's process CUDA-free.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

PROBE_TIMEOUT_S = 120


def _nvml_facts() -> dict:
    """Driver facts from NVML, which answers even when the CUDA runtime cannot start."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml  # type: ignore[no-redef]
        except ImportError:
            return {"error": "pynvml is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda_driver = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        count = pynvml.nvmlDeviceGetCount()
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver,
                "cuda_driver": int(cuda_driver), "device_count": int(count)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def gather() -> dict:
    """Run in the child: every fact, never an exception."""
    facts: dict = {"env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
                           if k in os.environ}}
    # What the kernel shows, needing no library at all (an image may lack torch and NVML).
    facts["dev_nodes"] = sorted(glob.glob("/dev/nvidia[0-9]*"))
    try:
        facts["proc_driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        pass
    facts["nvml"] = _nvml_facts()
    try:
        import torch
    except Exception as exc:
        facts["torch_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts["cuda_available"] = bool(torch.cuda.is_available())
    # torch explains a failed CUDA start ("driver too old", "no device") only in a warning.
    facts["cuda_warnings"] = [str(w.message) for w in caught]
    if not facts["cuda_available"]:
        return facts
    facts["arch_list"] = torch.cuda.get_arch_list()
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        device = {"index": i, "name": props.name, "capability": [props.major, props.minor],
                  "total_memory": int(props.total_memory)}
        try:    # the ledger's key (NVML's spelling) and what is free now, for the sizing
            device["uuid"] = "GPU-" + str(props.uuid).removeprefix("GPU-")
            device["free_memory"] = int(torch.cuda.mem_get_info(i)[0])
        except Exception:       # noqa: BLE001 - older torch: the sizing does without
            pass
        devices.append(device)
    facts["devices"] = devices
    try:
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        facts["kernel_ok"] = bool(float((x * 2).sum().item()) == 2.0 * 1023 * 1024 / 2)
    except Exception as exc:
        facts["kernel_ok"] = False
        facts["kernel_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def probe(timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Run :func:`gather` in a child process and return its facts."""
    try:
        done = subprocess.run([sys.executable, "-m", "proxima.serve.gpuprobe"],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"the GPU probe did not finish within {timeout:.0f} s "
                               "(a hung driver?)"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"probe_error": f"the GPU probe exited with code {done.returncode}: {tail[0]}"}


if __name__ == "__main__":
    print(json.dumps(gather()), flush=True)
