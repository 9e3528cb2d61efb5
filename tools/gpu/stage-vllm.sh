#!/usr/bin/env bash
# stage-vllm.sh - stage what tools/gpu/run.sh needs on an offline GPU host (torch 2.11 +
# triton 3.6 already there, no network): a slim vLLM 0.26.0 split into independent volumes,
# Proxima's wheel (its vllm.general_plugins entry point) and the wheels `proxima serve` and
# vLLM's OpenAI server need, all in the git-ignored .stage/. Every device call carries at most
# 64 MiB, the working tree included: the volumes are cut to fit beside the tree, and the
# script fails if a call's carry would not fit.
#
# Run on a CPU machine with pip access to PyPI. Nothing is installed here. Usage:
#
#   bash tools/gpu/stage-vllm.sh [--out .stage] [--wheel PATH] [--cache DIR]
#                                [--chunk-mib N] [--with-moe] [--with-fa2]
#                                [--xz-level 6] [--vllm-only]
#
#   --out DIR      ignored folder (relative to the repo root) that receives the
#                  volumes: DIR/c1/, DIR/c2/, ...        (default .stage; run.sh
#                  reads it from $STAGE)
#   --wheel PATH   use this vllm-0.26.0 wheel instead of downloading it
#   --cache DIR    download/work folder outside the repo (default /tmp/vllm-stage)
#   --chunk-mib N  max size of one volume (default: 60, less where the working tree
#                  leaves less of the 64 MiB a device call carries)
#   --with-moe     keep vllm/_moe_C_stable_libtorch.abi3.so (MoE models; +~40 MB)
#   --with-fa2     keep FlashAttention-2 (_vllm_fa2_C, not used on Hopper; +~75 MB)
#   --vllm-only    stage the vLLM volumes only (no DIR/plugin, DIR/serve-extra)
#
# Output: DIR/cK/vllm-bundle-K.tar.xz plus DIR/cK/MANIFEST.json in every volume folder,
# DIR/plugin/ (Proxima's wheel), DIR/serve-extra/ (the wheels in serve-deps-cp312.txt), and
# the device calls to make, with what each carries, printed at the end.
set -euo pipefail

VLLM_VERSION=0.26.0
OUT=.stage
WHEEL=""
CACHE=/tmp/vllm-stage
CHUNK_MIB=""
VLLM_ONLY=0
LIMIT_MIB=64              # what one device call carries, the working tree included
WITH_MOE=0
WITH_FA2=0
XZ_LEVEL=6
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2;;
    --wheel) WHEEL=$2; shift 2;;
    --cache) CACHE=$2; shift 2;;
    --chunk-mib) CHUNK_MIB=$2; shift 2;;
    --with-moe) WITH_MOE=1; shift;;
    --with-fa2) WITH_FA2=1; shift;;
    --xz-level) XZ_LEVEL=$2; shift 2;;
    --vllm-only) VLLM_ONLY=1; shift;;
    -h|--help) sed -n 2,28p "$0"; exit 0;;
    *) echo "stage-vllm.sh: unknown argument '$1' (see --help)" >&2; exit 2;;
  esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)   # the checkout this kit belongs to
cd "$ROOT"
DEPS_FILE="$HERE/vllm-${VLLM_VERSION}-deps-cp312.txt"
SERVE_DEPS_FILE="$HERE/serve-deps-cp312.txt"
OUT_ABS="$ROOT/$OUT"
PY=${PYTHON:-python3}
MIB=$((1024 * 1024))

# what travels with every device call: tracked and untracked-not-ignored files
tree_bytes() {
  # a tracked file missing from the checkout (e.g. docs/results moved aside) weighs nothing:
  # stat says so (xargs rc 123), and the others still count
  (git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true) \
    | awk '{s += $1} END {print s + 0}'
}
TREE=$(tree_bytes)
if [ -z "$CHUNK_MIB" ]; then
  # a volume must fit beside the tree, with 1 MiB to spare; at most 60 MiB
  CHUNK_MIB=$(( (LIMIT_MIB * MIB - TREE) / MIB - 1 ))
  [ "$CHUNK_MIB" -gt 60 ] && CHUNK_MIB=60
  if [ "$CHUNK_MIB" -lt 20 ]; then
    echo "ERROR: the working tree is $((TREE / MIB)) MiB, leaving under 20 MiB of a device call's" \
         "$LIMIT_MIB MiB for a volume; ignore or remove large untracked files first" >&2
    exit 1
  fi
fi

# ---- sanity: the output folder must be ignored by git (it must never be committed)
mkdir -p "$OUT_ABS"
if ! git -C "$ROOT" check-ignore -q "$OUT/c1"; then
  echo "ERROR: $OUT is not ignored by git, so it would travel with every device call;" \
       "add '/$OUT/' to .git/info/exclude (or .gitignore)" >&2
  exit 1
fi
"$PY" -m pip --version >/dev/null || { echo "ERROR: $PY has no pip" >&2; exit 1; }

PLATFORMS=()
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
            --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
PIPX=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

mkdir -p "$CACHE/dl" "$CACHE/deps"
# ---- 1. the vLLM wheel
if [ -z "$WHEEL" ]; then
  WHEEL=$(ls "$CACHE"/dl/vllm-${VLLM_VERSION}-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHEEL" ]; then
    echo "== downloading vllm==${VLLM_VERSION} (~300 MB)"
    "$PY" -m pip download -q "${PIPX[@]}" -d "$CACHE/dl" "vllm==${VLLM_VERSION}"
    WHEEL=$(ls "$CACHE"/dl/vllm-${VLLM_VERSION}-*.whl | head -1)
  fi
fi
echo "== vllm wheel: $WHEEL"

# ---- 2. the missing dependencies (exact pins, no transitive resolution)
echo "== downloading dependency wheels listed in $(basename "$DEPS_FILE")"
grep -vE '^\s*(#|$)' "$DEPS_FILE" > "$CACHE/deps.txt"
"$PY" -m pip download -q "${PIPX[@]}" -d "$CACHE/deps" -r "$CACHE/deps.txt"

# ---- 3. the slim site tree
SITE="$CACHE/site"
rm -rf "$SITE"; mkdir -p "$SITE"
echo "== unpacking vllm into $SITE"
"$PY" - "$WHEEL" "$SITE" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF
find "$SITE/vllm" -name '*.so' -exec chmod 755 {} +
rm -f "$SITE/vllm/vllm-rs"                                 # Rust API-server frontend
rm -rf "$SITE/vllm/third_party/deep_gemm"                  # FP8 GEMM JIT (headers + .so)
rm -rf "$SITE/vllm/third_party/fmha_sm100"                 # Blackwell-only attention
rm -f "$SITE"/vllm-${VLLM_VERSION}.dist-info/RECORD        # stale after slimming
[ "$WITH_FA2" = 1 ] || rm -f "$SITE/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
[ "$WITH_MOE" = 1 ] || rm -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so"

echo "== installing dependency wheels into $SITE (for CPython 3.12, not for this machine)"
"$PY" -m pip install -q --no-compile --target "$SITE" "${PIPX[@]}" "$CACHE"/deps/*.whl 2>&1 \
  | grep -v "Running pip as the 'root' user" || true
rm -rf "$SITE/bin"                                         # console scripts, wrong shebang
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh "$SITE"

# ---- 4. pack into independent tar.xz volumes and write the manifest
rm -rf "$OUT_ABS"/c[0-9]*
"$PY" - "$SITE" "$OUT_ABS" "$CHUNK_MIB" "$XZ_LEVEL" "$VLLM_VERSION" "$WITH_MOE" "$WITH_FA2" <<'EOF'
import hashlib, json, lzma, os, shutil, subprocess, sys, tarfile, time
site, out, chunk_mib, level, version, with_moe, with_fa2 = sys.argv[1:8]
limit = int(float(chunk_mib) * 1024 * 1024)
level = int(level)
have_xz = shutil.which("xz") is not None

files = []
for dp, dns, fns in os.walk(site):
    dns.sort()
    for f in sorted(fns):
        p = os.path.join(dp, f)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        files.append((os.path.relpath(p, site), os.path.getsize(p)))

def xz_size(path):
    # upper-bound estimate: fast preset compresses worse than the final one
    if have_xz:
        r = subprocess.run(["xz", "-T0", "-1", "-c", path], stdout=subprocess.PIPE, check=True)
        return len(r.stdout)
    with open(path, "rb") as fh:
        return len(lzma.compress(fh.read(), preset=1))

BIG = 4 * 1024 * 1024
small = [(r, s) for r, s in files if s < BIG]
big = sorted(((r, s, xz_size(os.path.join(site, r))) for r, s in files if s >= BIG),
             key=lambda t: -t[2])

def pack(target):
    vols = [{"files": [r for r, _ in small], "est": int(sum(s for _, s in small) * 0.35)}]
    for r, s, est in big:
        for v in vols:
            if v["est"] + est <= target:
                v["files"].append(r); v["est"] += est; break
        else:
            vols.append({"files": [r], "est": est})
    return vols

def write_volume(i, names):
    d = os.path.join(out, f"c{i}"); os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"vllm-bundle-{i}.tar.xz")
    if have_xz:
        with open(path, "wb") as fo:
            xz = subprocess.Popen(["xz", "-T0", f"-{level}", "-c"], stdin=subprocess.PIPE, stdout=fo)
            with tarfile.open(fileobj=xz.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for n in names:
                    tf.add(os.path.join(site, n), arcname=n, recursive=False)
            xz.stdin.close()
            if xz.wait() != 0:
                raise SystemExit("xz failed")
    else:
        with tarfile.open(path, "w:xz", preset=level, format=tarfile.PAX_FORMAT) as tf:
            for n in names:
                tf.add(os.path.join(site, n), arcname=n, recursive=False)
    return path

target = limit
for attempt in range(6):
    for d in os.listdir(out):
        if d.startswith("c") and d[1:].isdigit():
            shutil.rmtree(os.path.join(out, d))
    vols = pack(target)
    # the volume with the most files (Python code, dependencies) goes first so
    # that the first transfer can already check the pure-Python imports
    vols.sort(key=lambda v: -len(v["files"]))
    paths = [write_volume(i + 1, v["files"]) for i, v in enumerate(vols)]
    sizes = [os.path.getsize(p) for p in paths]
    if max(sizes) <= limit:
        break
    alone = [(v["files"][0], n) for v, n in zip(vols, sizes) if n > limit and len(v["files"]) == 1]
    if alone:   # one file over the limit by itself: no repacking makes it fit
        name, n = alone[0]
        raise SystemExit(f"ERROR: {name} alone compresses to {n / 2**20:.1f} MiB, more than "
                         f"the {limit / 2**20:.1f} MiB a volume may have (--chunk-mib, or what "
                         "the working tree leaves of a device call's 64 MiB): make the tree "
                         "smaller (move docs/results/ out of it, for the staging and for the "
                         "device call that carries this volume), then stage again")
    target = int(target * 0.85)
    print(f"   a volume came out at {max(sizes)} bytes > {limit}; repacking with target {target}")
else:
    raise SystemExit("could not pack volumes under the limit")

def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

manifest = {
    "bundle": f"vllm-{version}-slim",
    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "python": "cp312", "with_moe": with_moe == "1", "with_fa2": with_fa2 == "1",
    "volumes": [],
}
for i, (p, v) in enumerate(zip(paths, vols), 1):
    exts = sorted(n for n in v["files"] if n.startswith("vllm/") and n.endswith(".so"))
    manifest["volumes"].append({
        "index": i, "dir": f"c{i}", "file": os.path.basename(p),
        "bytes": os.path.getsize(p), "sha256": sha256(p),
        "n_files": len(v["files"]), "vllm_extensions": exts,
    })
for i in range(1, len(paths) + 1):
    with open(os.path.join(out, f"c{i}", "MANIFEST.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
for v in manifest["volumes"]:
    print(f"   c{v['index']}: {v['file']} {v['bytes']/2**20:.1f} MiB, {v['n_files']} files, "
          f"extensions: {', '.join(os.path.basename(e) for e in v['vllm_extensions']) or '-'}")
EOF

N=$(ls -d "$OUT_ABS"/c[0-9]* | wc -l)

# ---- 5. Proxima's wheel and the serve wheels (installed by run.sh c1 into the same site)
if [ "$VLLM_ONLY" = 0 ]; then
  rm -rf "$OUT_ABS/plugin" "$OUT_ABS/serve-extra"
  mkdir -p "$OUT_ABS/plugin" "$OUT_ABS/serve-extra"
  echo "== Proxima's wheel (its vllm.general_plugins entry point; the code travels with the tree)"
  "$PY" -m pip wheel -q --no-deps -w "$OUT_ABS/plugin" "$ROOT"
  echo "== the wheels in $(basename "$SERVE_DEPS_FILE") (proxima serve, vLLM's OpenAI server)"
  grep -vE '^\s*(#|$)' "$SERVE_DEPS_FILE" > "$CACHE/serve-deps.txt"
  "$PY" -m pip download -q "${PIPX[@]}" -d "$OUT_ABS/serve-extra" -r "$CACHE/serve-deps.txt"
fi

# ---- 6. what each device call carries must fit, beside the tree, in LIMIT_MIB
dir_bytes() { find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
TREE=$(tree_bytes)
fail=0
for i in $(seq 1 "$N"); do
  carry=("$OUT/c$i")
  if [ "$i" = 1 ] && [ "$VLLM_ONLY" = 0 ]; then carry+=("$OUT/plugin" "$OUT/serve-extra"); fi
  total=$(( TREE + $(dir_bytes "${carry[@]}") ))
  CARRY[$i]="${carry[*]}"
  SIZE[$i]="$(mib "$total") MiB with the tree's $(mib "$TREE")"
  if [ "$total" -gt $(( LIMIT_MIB * MIB )) ]; then
    echo "ERROR: device call $i would carry $(mib "$total") MiB (${carry[*]} and the tree)," \
         "over the $LIMIT_MIB MiB a call carries; stage again with a smaller --chunk-mib" >&2
    fail=1
  fi
done
[ "$fail" = 0 ] || exit 1

echo
echo "== $N volume(s) under $OUT/ (total $(du -ch "$OUT_ABS"/c*/vllm-bundle-*.tar.xz | tail -1 | cut -f1))"
echo
echo "Device calls, back to back (what was extracted there lasts only while the host stays up;"
echo "each call carries the folders named, at most $LIMIT_MIB MiB with the tree):"
for i in $(seq 1 "$N"); do
  pre=""; [ "$OUT" = .stage ] || pre="STAGE=$OUT "
  if [ "$i" -lt "$N" ]; then cmd="${pre}bash tools/gpu/run.sh c$i      (its installer says 2: volumes to come)"
  else cmd="${pre}bash tools/gpu/run.sh c$i BUDGET_S LANE..."; fi
  echo "  call $i: carry ${CARRY[$i]// /, } (${SIZE[$i]})"
  echo "          $cmd"
done
echo "Later calls on the same host carry nothing: bash tools/gpu/run.sh run BUDGET_S LANE..."
