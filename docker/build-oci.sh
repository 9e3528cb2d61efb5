#!/usr/bin/env bash
# Build Proxima's OCI image from this checkout without a Docker engine.
#
#   docker/build-oci.sh [--out DIR] [--tag TAG] [--src DIR]
#
# Writes DIR/oci (an OCI image layout, for podman/skopeo/umoci/containerd) and
# DIR/proxima-oci.tar (a docker-archive: `docker load -i DIR/proxima-oci.tar`). DIR defaults to
# ./out/oci-image; --src takes Proxima's sources (pyproject.toml, proxima/) from DIR instead
# of this checkout. Prints the manifest digest on its last line.
#
# What is in it (two layers, no shell, no package manager):
#   1. base: Debian bookworm's python3.11 and the shared libraries it needs, unpacked from the
#      Debian archive's .deb files (dpkg-deb -x: no maintainer scripts run, nothing else
#      installed), the CA certificates of Debian's ca-certificates joined into
#      /etc/ssl/certs/ca-certificates.crt (what its update-ca-certificates would write), and
#      the user proxima (uid/gid 1000). Cached under ~/.cache/proxima/oci/ keyed on the exact
#      package versions.
#   2. app:  the proxima wheel built from this checkout, /usr/local/bin/proxima and the health
#      check /usr/local/bin/proxima-healthcheck (docker/healthcheck.py: GET /health).
# The configuration is the appliance's (docker/image-config.env): entrypoint `proxima serve`,
# PROXIMA_ALLOCATOR=1, HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, port 8000, volume /models;
# it runs as 1000:1000 and declares the health check (Docker's Healthcheck in the image config,
# which docker load reads). No C compiler: the image has no torch and no Triton to compile with.
#
# This image carries Proxima without vLLM: it is the appliance's skeleton, small enough to be
# built and run (`proxima --version`, `proxima selfcheck`) on a CPU-only CI machine. The images
# that serve are the Nix one (flake.nix, CUDA 12.1) and docker/Dockerfile (vLLM 0.26.0).
#
# Reproducible: file times, owners and tar order are fixed and the image's `created` is
# SOURCE_DATE_EPOCH (default 1), so the same checkout and Debian package versions give the same
# manifest digest (tests/docker/test_oci_image.py checks this).
#
# Needs: apt-get (for `apt-get download`; run apt-get update once), dpkg-deb, python3 with pip
# and venv, umoci, skopeo. No root needed, no Docker engine, no registry but Debian's and PyPI's
# (PyPI only once, for the pinned setuptools of the cached build venv).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$here/out/oci-image"
src="$here"
tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --src) src=$(cd "$2" && pwd); shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "build-oci.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

for tool in apt-get apt-cache dpkg-deb umoci skopeo python3 tar sha256sum; do
  command -v "$tool" >/dev/null || {
    echo "build-oci.sh: '$tool' is missing; on Debian: apt-get install -y umoci skopeo" >&2
    exit 1
  }
done

export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1}
export TZ=UTC LC_ALL=C
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
version=$(python3 -c 'import re,sys; print(re.search(r"^version = \"([^\"]+)\"", open(sys.argv[1]).read(), re.M)[1])' "$src/pyproject.toml")
tag=${tag:-$version}
cache=${PROXIMA_CACHE:-$HOME/.cache/proxima}/oci
mkdir -p "$cache/debs" "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/proxima-oci.XXXXXX")
trap 'rm -rf "$work"' EXIT

# A layer tarball whose bytes depend only on the files' contents, names and modes.
make_layer() {  # make_layer ROOTFS TARBALL
  find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
      --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      -C "$1" -cf "$2" .
}

# ---- base layer: python3.11 from Debian ---------------------------------------------------
# The interpreter, its standard library, and the libraries its stdlib extension modules link
# (ssl, hashlib, zlib, bz2, lzma, ctypes, uuid, sqlite3, pyexpat, crypt).
base_packages="libc6 gcc-12-base libgcc-s1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5
  libuuid1 libcrypt1 libsqlite3-0 media-types libpython3.11-minimal libpython3.11-stdlib
  python3.11-minimal ca-certificates"
pins=""
for p in $base_packages; do
  v=$(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')
  [ -n "$v" ] && [ "$v" != "(none)" ] || {
    echo "build-oci.sh: no Debian package '$p' (run apt-get update first)" >&2; exit 1; }
  pins="$pins $p=$v"
done
base_key=$( { echo "base-recipe-3"; echo "$pins" | tr ' ' '\n' | sort; } | sha256sum | cut -c1-16)
base_tar="$cache/base-$base_key.tar"
if [ ! -f "$base_tar" ]; then
  echo "build-oci.sh: building the base layer ($base_key) from Debian packages" >&2
  (cd "$cache/debs" && apt-get download $pins >/dev/null 2>"$work/apt.log") || {
    cat "$work/apt.log" >&2; exit 1; }
  root="$work/base"
  mkdir -p "$root"
  for p in $pins; do
    name=${p%%=*}; ver=${p#*=}
    deb=$(ls "$cache/debs/${name}_${ver/:/%3a}_"*.deb)
    dpkg-deb -x "$deb" "$root"
  done
  # Documentation, manuals and translations are not needed to run.
  rm -rf "$root"/usr/share/{doc,man,info,lintian,locale} "$root"/usr/lib/python3.11/test
  mkdir -p "$root"/{tmp,models,etc,usr/local/bin,usr/local/lib/python3.11/dist-packages}
  chmod 1777 "$root/tmp"
  ln -sf python3.11 "$root/usr/bin/python3"
  # getpass.getuser() (torch, triton) needs a passwd entry for the running user, proxima.
  printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nproxima:x:1000:1000:proxima:/tmp:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nproxima:x:1000:\nnogroup:x:65534:\n' > "$root/etc/group"
  # update-ca-certificates (a maintainer script, not run by dpkg-deb -x) joins every
  # certificate under /usr/share/ca-certificates into this bundle; so does this, in name order.
  mkdir -p "$root/etc/ssl/certs"
  find "$root/usr/share/ca-certificates" -name '*.crt' | LC_ALL=C sort | xargs cat \
    > "$root/etc/ssl/certs/ca-certificates.crt"
  [ -s "$root/etc/ssl/certs/ca-certificates.crt" ] || {
    echo "build-oci.sh: no certificates in the ca-certificates package" >&2; exit 1; }
  rm -rf "$root/usr/sbin" "$root/etc/ca-certificates.conf"
  mkdir -p "$root/usr/share/proxima"
  echo "$pins" | tr ' ' '\n' | sed '/^$/d' | sort > "$root/usr/share/proxima/debian-packages.txt"
  make_layer "$root" "$base_tar.part"
  mv "$base_tar.part" "$base_tar"
fi

# ---- app layer: proxima from this checkout ------------------------------------------------
echo "build-oci.sh: building the proxima wheel" >&2
# Build from a copy so that build/ and *.egg-info never land in the checkout.
mkdir -p "$work/src"
(cd "$src" && tar --exclude=.git --exclude=out --exclude=build --exclude='*.egg-info' \
   --exclude=__pycache__ -cf - pyproject.toml proxima $(ls README.md LICENSE 2>/dev/null)) \
  | tar -xf - -C "$work/src"
[ -f "$work/src/README.md" ] || echo "# proxima" > "$work/src/README.md"
# A pinned setuptools in a cached venv: the wheel's bytes must not depend on the host's. It must
# meet pyproject.toml's build-system (setuptools >= 77: the SPDX license string).
buildenv="$cache/buildenv-setuptools-80.9.0"
if [ ! -f "$buildenv/.complete" ]; then
  rm -rf "$buildenv"
  python3 -m venv "$buildenv"
  "$buildenv/bin/python" -m pip install -q setuptools==80.9.0 >&2
  touch "$buildenv/.complete"
fi
"$buildenv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheel" "$work/src" >&2
app="$work/app"
site="$app/usr/local/lib/python3.11/dist-packages"
mkdir -p "$site" "$app/usr/local/bin"
python3 -m pip install -q --no-deps --no-compile --no-index --target "$site" "$work"/wheel/*.whl >&2
# pip records the build machine's paths here; the image needs neither.
rm -rf "$site/bin" "$site"/*.dist-info/direct_url.json "$site"/*.dist-info/RECORD "$site"/*.dist-info/INSTALLER
cat > "$app/usr/local/bin/proxima" <<'EOF'
#!/usr/bin/python3.11
import sys

from proxima.cli import main

sys.exit(main())
EOF
chmod 0755 "$app/usr/local/bin/proxima"
{ echo '#!/usr/bin/python3.11'; cat "$here/docker/healthcheck.py"; } > "$app/usr/local/bin/proxima-healthcheck"
chmod 0755 "$app/usr/local/bin/proxima-healthcheck"
make_layer "$app" "$work/app.tar"

# ---- the image ----------------------------------------------------------------------------
oci="$out/oci"
rm -rf "$oci"
umoci init --layout "$oci"
umoci new --image "$oci:$tag"
umoci raw add-layer --image "$oci:$tag" --history.created "$created" \
  --history.created_by "debian bookworm python3.11 (docker/build-oci.sh base layer)" "$base_tar"
umoci raw add-layer --image "$oci:$tag" --history.created "$created" \
  --history.created_by "proxima $version wheel (docker/build-oci.sh app layer)" "$work/app.tar"

# The appliance's configuration, shared with docker/Dockerfile: docker/image-config.env.
config_args=()
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  config_args+=(--config.env "$line")
done < "$here/docker/image-config.env"
umoci config --image "$oci:$tag" --no-history --created "$created" \
  --author "Proxima" --architecture amd64 --os linux \
  --config.entrypoint /usr/local/bin/proxima --config.entrypoint serve --config.user 1000:1000 \
  --config.exposedports 8000/tcp --config.volume /models --config.workingdir /models \
  "${config_args[@]}" \
  --config.env "PATH=/usr/local/bin:/usr/bin" \
  --config.env "HOME=/tmp" \
  --config.env "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
  --config.label "org.opencontainers.image.title=proxima" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.description=Proxima without vLLM on Debian python3.11 (daemonless build)" \
  --config.label "ai.proxima.stack=slim"
# Docker's health check: not part of the OCI image config, so umoci has no option for it. It is
# added to the config blob (Docker reads config.Healthcheck on docker load; skopeo copies the
# blob as it is) and the manifest and index are re-pointed at the new blob.
python3 - "$oci" <<'PYEOF'
import hashlib, json, sys
from pathlib import Path
layout = Path(sys.argv[1])
blobs = layout / "blobs" / "sha256"
def put(data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)
def get(digest: str) -> dict:
    return json.loads((blobs / digest.split(":", 1)[1]).read_text())
index = json.loads((layout / "index.json").read_text())
(entry,) = index["manifests"]
manifest = get(entry["digest"])
config = get(manifest["config"]["digest"])
second = 1_000_000_000
config["config"]["Healthcheck"] = {
    "Test": ["CMD", "/usr/bin/python3.11", "/usr/local/bin/proxima-healthcheck"],
    "Interval": 30 * second, "Timeout": 10 * second, "StartPeriod": 1200 * second,
    "Retries": 3}
manifest["config"]["digest"], manifest["config"]["size"] = put(json.dumps(config).encode())
entry["digest"], entry["size"] = put(json.dumps(manifest).encode())
(layout / "index.json").write_text(json.dumps(index))
PYEOF
umoci gc --layout "$oci"

rm -f "$out/proxima-oci.tar"
skopeo copy --quiet "oci:$oci:$tag" "docker-archive:$out/proxima-oci.tar:proxima:$tag-slim" >&2
digest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$oci/index.json")
echo "build-oci.sh: $oci:$tag and $out/proxima-oci.tar (proxima:$tag-slim)" >&2
echo "$digest"
