#!/usr/bin/env bash
# CI checks of the appliance (flake, images, air-gapped bundle) on a machine with no GPU, no
# Docker engine and no network beyond the package registries:
#   - every .nix file parses; `nix flake check --no-build` against tests/nix/stub-nixpkgs, which
#     makes the checks nixpkgs' build would (postPatch substitutions, pypa/build's
#     [build-system] check, setuptools' SPDX license limit, pythonRuntimeDepsCheckHook, vLLM's
#     FetchContent sources and CUDA flags), with assertions on the image config, the CUDA 12.1
#     pin, the GPU check's place, and mutations that must fail (tests/nix/);
#   - the pinned sdists match their hashes, the patches apply, and the stub's record of each
#     sdist is what the sdist says (tests/nix/test_sources.py);
#   - the Nix build's license rewrite, run with nixos-24.11's setuptools 75.1.0 + pypa/build;
#   - nix/gpu-check.py fails loudly without a GPU (tests/nix/test_gpu_check.py);
#   - the daemonless OCI build (docker/build-oci.sh), its reproducibility, and under runc its
#     entrypoint, user (uid 1000), health check and CA bundle (tests/docker/);
#   - `proxima bundle`: bad input, the README's steps as written, install.py (tests/test_bundle.py).
#
#   bash nix/ci-checks.sh [extra pytest args]
#   bash nix/ci-checks.sh --install-only      (only install the tools; used by .ci/run)
#
# Installs what is missing (as root): Debian's nix-bin, umoci, skopeo, runc, patch. Their .deb
# files are kept in ~/.cache/proxima/apt; the image's Debian base layer, the build venvs, the
# pinned sources and the nixos-24.11 setuptools venv in ~/.cache/proxima/{oci,sources,
# nixos-24.11-build-venv} (PROXIMA_CACHE overrides ~/.cache/proxima).
# Measured on two shared cores, tools installed: warm caches 1 min 36 s, cold 2 min 39 s.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PROXIMA_CACHE:-$HOME/.cache/proxima}

missing=()
for pair in nix:nix-bin nix-instantiate:nix-bin umoci:umoci skopeo:skopeo runc:runc patch:patch; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ] || ! ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    # docker/build-oci.sh resolves the image's Debian packages from the apt lists.
    ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get update -qq
    if [ ${#missing[@]} -gt 0 ]; then
      mkdir -p "$cache/apt/partial"
      echo "ci-checks: installing ${missing[*]}" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o Dir::Cache::archives="$cache/apt" $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
               --no-install-recommends -o Dir::Cache::archives="$cache/apt" \
               $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null; }
    fi
  else
    echo "ci-checks: not root, cannot install ${missing[*]}; their tests will be skipped" >&2
  fi
fi

cd "$here"
# `--install-only`: .ci/run installs the tools here, then runs the whole suite once.
[ "${1:-}" = "--install-only" ] && exit 0
exec "$here/dev" test -q tests/nix tests/docker tests/test_bundle.py "$@"
