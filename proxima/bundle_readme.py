"""The README.md of an air-gapped bundle: what the serving machine needs (driver, container
runtime or Python) and every step, offline, written from the bundle's manifest.
Imports only the standard library."""

from __future__ import annotations

from proxima.bundle_install import SUMS


# The oldest NVIDIA Linux driver of each CUDA release (CUDA's release notes, table 3).
MIN_DRIVER = {"12.1": "530.30.02", "12.4": "550.54.14", "12.8": "570.26", "13.0": "580.65.06"}


def readme(manifest: dict, slim_only: bool) -> str:
    images = manifest["images"]
    wh = manifest["wheelhouse"]
    model = manifest["model"]
    model_arg = f" /{model}" if model else ""
    serving = [i for i in images if i["serves"]] or images
    tag = next((i["tags"][0] for i in serving if i["tags"]), "IMAGE")
    drivers = sorted({f"driver >= {MIN_DRIVER[i['cuda']]} (CUDA {i['cuda']}, image {i['file']})"
                      for i in images if i.get("cuda") in MIN_DRIVER})
    driver_line = "; ".join(drivers) if drivers else \
        "the driver that the image's CUDA release needs (CUDA 12.1: >= 530.30.02)"
    needs = wh["needs"]
    py_need = (f"CPython {needs['python']}" if needs["python"] else
               f"Python >= {needs['python_min']}" if needs["python_min"] else "Python >= 3.10")
    plat_need = ", ".join(filter(None, [needs["machine"],
                                        needs["glibc"] and f"glibc >= {needs['glibc']}"]))
    spec = f"proxima[{','.join(wh['extras'])}]" if wh["extras"] else "proxima"
    if images:
        load = "\n".join(f"    docker load -i image/{i['file']}" for i in images)
        container = f"""{load}
    docker run --gpus all -v "$PWD/models:/models" -p 8000:8000 {tag}{model_arg}

With Podman: `podman load -i image/<file>`, then `podman run --device nvidia.com/gpu=all ...`
(CDI; `nvidia-ctk cdi generate` once). The entrypoint is `proxima serve`: the self-check
runs first, and `GET /health` on port 8000 answers 200 once it passed (the image's health
check asks the same). It sets PROXIMA_ALLOCATOR=1, HF_HUB_OFFLINE=1 and
TRANSFORMERS_OFFLINE=1, so nothing is fetched from a model hub.
"""
        if slim_only:
            container += """
**This bundle's only image is the slim CI image (no vLLM): it runs `proxima --version` and
`proxima selfcheck`, but it cannot serve.** Write the bundle again with the Nix image
(`nix build .#proxima-image`) or the Dockerfile's (`docker save proxima:<version>-vllm0.26.0`).
"""
    else:
        container = "No image archive in this bundle.\n"
    if wh["serves"]:
        python_use = f"    venv/bin/proxima serve{model_arg or ' /models/<name>'} --port 8000\n"
        python_note = (f"The wheelhouse holds vLLM and the serving supervisor ({spec}); the\n"
                       "machine needs the NVIDIA driver above, no container toolkit.")
    else:
        python_use = "    venv/bin/proxima --version\n"
        python_note = (f"The wheelhouse holds {spec} without vLLM: this Python install cannot "
                       "serve (nor replay,\nwhich drives vLLM's scheduler). Serve from the image, "
                       "or write the bundle with\n`--extra vllm-0-26 --extra serve` (the tested stack) "
                       "or `--extra vllm-cu121 --extra serve` (the card stack).")
    nix = manifest.get("nix")
    nix_text = (f"\n## Nix\n\nThe closure of `{nix}`:\n\n    nix-store --import < nix/closure.nar\n"
                f"    $(cat nix/store-path)/bin/proxima serve\n") if nix else ""
    return f"""# Proxima {manifest['proxima']}: air-gapped bundle

Everything here installs and serves without network.

## What the serving machine needs

- Linux with an NVIDIA GPU and its driver: {driver_line};
- for the image: Docker or Podman, and the NVIDIA Container Toolkit (it mounts the host's
  driver libraries into the container; `docker run --gpus all` needs it);
- for the Python install instead: {py_need}{', ' + plat_need if plat_need else ''}
  (what the wheelhouse's wheels were built for; `install.py` checks it).

## 1. Check the copy

    sha256sum -c {SUMS}

## 2. Serve from the container image

{container}
## Or: install the Python package (no container)

    python3 install.py venv
{python_use}
`install.py` checks every file against {SUMS} and this machine against the wheelhouse, then
runs `venv/bin/pip install --no-index --find-links wheelhouse '{spec}=={manifest['proxima']}'`.
{python_note}
The wheelhouse: {', '.join(wh['files'])}.
{nix_text}
## Model

{model or 'None bundled (see models/README.md).'}
"""
