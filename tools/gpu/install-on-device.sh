#!/usr/bin/env bash
# install-on-device.sh - run ON THE GPU HOST, from the repo root, in each device call that
# brings one volume folder made by tools/gpu/stage-vllm.sh (tools/gpu/run.sh calls it).
#
#   bash tools/gpu/install-on-device.sh [STAGE_DIR] [SITE_DIR]
#        STAGE_DIR  default .stage      (holds c1/, c2/, ... as carried)
#        SITE_DIR   default /tmp/site   (or $VLLM_SITE)
#
# Idempotent.  Each run extracts every carried volume that is not yet in
# SITE_DIR (sha256-checked against MANIFEST.json; volumes from earlier calls
# stay on a warm machine), then:
#   - all volumes in:   full check (import vllm + its CUDA extensions, FA3
#                       availability, versions, GPU name); exit 0 if good, 1 if not
#   - some still missing: a pre-check of the pure-Python imports with stubs for
#                       the missing extension modules; exit 2
# Afterwards:  export PYTHONPATH=SITE_DIR VLLM_USE_FLASHINFER_SAMPLER=0
set -uo pipefail
STAGE=${1:-.stage}
SITE=${2:-${VLLM_SITE:-/tmp/site}}
PY=${PYTHON:-python3}

"$PY" - "$STAGE" "$SITE" <<'EOF'
import glob, hashlib, json, os, shutil, subprocess, sys, tarfile, time
stage, site = sys.argv[1], sys.argv[2]
meta = os.path.join(site, ".vllm-bundle")

mans = []
for p in glob.glob(os.path.join(stage, "c*", "MANIFEST.json")):
    with open(p) as fh:
        mans.append(json.load(fh))
installed_man = None
if os.path.exists(os.path.join(meta, "MANIFEST.json")):
    with open(os.path.join(meta, "MANIFEST.json")) as fh:
        installed_man = json.load(fh)
if not mans and installed_man is None:
    sys.exit(f"install-on-device: no {stage}/c*/MANIFEST.json here and nothing installed in {site}")
man = max(mans, key=lambda m: m["created"]) if mans else installed_man
if installed_man is not None and installed_man["created"] != man["created"]:
    print(f"install-on-device: {site} holds bundle {installed_man['created']}, "
          f"carried bundle is {man['created']}: starting over")
    shutil.rmtree(site)
os.makedirs(meta, exist_ok=True)
with open(os.path.join(meta, "MANIFEST.json"), "w") as fh:
    json.dump(man, fh, indent=1)

def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

missing = []
for v in man["volumes"]:
    done = os.path.join(meta, v["sha256"] + ".done")
    if os.path.exists(done):
        print(f"  c{v['index']}: already installed")
        continue
    src = os.path.join(stage, v["dir"], v["file"])
    if not os.path.exists(src):
        print(f"  c{v['index']}: not here (bring {stage}/{v['dir']} in a run)")
        missing.append(v)
        continue
    if sha256(src) != v["sha256"]:
        sys.exit(f"install-on-device: {src} is corrupt (sha256 mismatch)")
    t = time.time()
    with tarfile.open(src, "r:xz") as tf:
        tf.extractall(site, filter="data")
    open(done, "w").close()
    print(f"  c{v['index']}: extracted {v['n_files']} files in {time.time() - t:.1f} s")

env = dict(os.environ, PYTHONPATH=site + (os.pathsep + os.environ["PYTHONPATH"]
                                          if os.environ.get("PYTHONPATH") else ""),
           VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")

if missing:
    stubs = [e[:-len(".abi3.so")].replace("/", ".") for v in missing for e in v["vllm_extensions"]]
    print(f"install-on-device: {len(missing)} of {len(man['volumes'])} volume(s) still to come; "
          f"pre-checking pure-Python imports with stubs for {stubs}")
    code = r'''
import sys, types, importlib, importlib.metadata as md
for s in STUBS:
    sys.modules[s] = types.ModuleType(s)
bad = 0
for m in ["pydantic", "zmq", "msgspec", "cbor2", "pybase64", "cachetools", "fastapi",
          "openai", "openai_harmony", "xgrammar", "llguidance", "partial_json_parser",
          "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
          "vllm.model_executor.models.llama"]:
    try:
        importlib.import_module(m); print("   ok  ", m)
    except ModuleNotFoundError as e:
        real = e.name and not e.name.startswith("vllm")
        bad += bool(real)
        print("   MISSING" if real else "   (stub)", m, "->", e)
    except Exception as e:
        print("   (stub?)", m, "->", type(e).__name__, str(e)[:200])
for d in ["torch", "transformers", "typing_extensions", "numpy", "triton", "pydantic", "setuptools"]:
    try: print("   ", d, md.version(d))
    except Exception: print("   ", d, "absent")
sys.exit(3 if bad else 0)
'''.replace("STUBS", repr(stubs))
    r = subprocess.run([sys.executable, "-c", code], env=env)
    print("install-on-device: pre-check", "found missing modules" if r.returncode else "passed")
    sys.exit(2)

code = r'''
import time; t = time.time()
import torch, vllm
import vllm._C_stable_libtorch
from vllm import LLM, SamplingParams
from vllm.vllm_flash_attn import flash_attn_interface as fa
from vllm.platforms import current_platform
print("   vllm", vllm.__version__, "from", vllm.__file__)
print("   torch", torch.__version__, "cuda", torch.version.cuda, "| GPU:", torch.cuda.get_device_name(0),
      "cc", torch.cuda.get_device_capability(0))
print("   platform", type(current_platform).__name__,
      "| FA3:", fa.is_fa_version_supported(3), fa.fa_version_unsupported_reason(3) or "",
      "| FA2:", fa.FA2_AVAILABLE)
print(f"   imports took {time.time() - t:.1f} s")
'''
r = subprocess.run([sys.executable, "-c", code], env=env)
if r.returncode:
    sys.exit("install-on-device: vLLM check FAILED")
print(f"install-on-device: OK. Now: export PYTHONPATH={site} VLLM_USE_FLASHINFER_SAMPLER=0")
EOF
