# vLLM of the card stack (V0 engine), built from source against the pinned nixpkgs' torch and
# CUDA 12.1 (the overlay makes cudaPackages_12_1 the global CUDA, so torch, triton, xformers
# and this vLLM all link the same CUDA).
#
# Starts from nixos-24.11's own vLLM expression (0.6.2) and moves it to 0.6.3.post1
# (see nix/sources.nix for why that version). What changes:
#   - src: the pinned 0.6.3.post1 release;
#   - patches: nixpkgs' 0.6.2 patches are dropped (they are cut against 0.6.2's setup.py) and
#     replaced by nix/patches/, cut against 0.6.3.post1 and checked to apply by
#     tests/nix/test_sources.py;
#   - CUTLASS: 0.6.3.post1 fetches v3.5.1 with CMake's FetchContent, which a sandboxed build
#     cannot do, so the pinned source directory is passed in through cmakeFlags;
#   - compressed-tensors joins the dependencies (0.6.3 imports it at start-up).
#
# Proxima itself needs NO source patch of vLLM: vLLM 0.6.3.post1 loads the
# `vllm.general_plugins` entry points (vllm/plugins/__init__.py) in every engine process, and
# Proxima's plugin does nothing unless PROXIMA_ALLOCATOR=1. Keep it that way: a patch here
# would make the Nix build differ from the pip-installed card stack that CI tests.
{
  lib,
  vllm,
  fetchurl,
  fetchFromGitHub,
  compressed-tensors,
  sources,
}:

let
  pin = sources.vllm;
  cutlass = fetchFromGitHub {
    name = "cutlass-source";
    inherit (sources.cutlass) owner repo rev hash;
  };
in
vllm.overridePythonAttrs (old: {
  version = pin.version;
  src = fetchurl {
    inherit (pin) url hash;
  };

  patches = [ ./patches/0001-setup.py-pass-nix-cmakeFlags-to-cmake.patch ];

  # setuptools-scm cannot read a version from a source tree without git metadata.
  env = (old.env or { }) // {
    SETUPTOOLS_SCM_PRETEND_VERSION = pin.version;
  };

  cmakeFlags = [
    (lib.cmakeFeature "FETCHCONTENT_SOURCE_DIR_CUTLASS" "${cutlass}")
  ];

  dependencies = (old.dependencies or [ ]) ++ [ compressed-tensors ];

  # vLLM 0.6.3.post1 pins torch==2.4.0, xformers==0.0.27.post2 and friends; nixos-24.11 builds
  # torch 2.5.1 from source. vLLM's CMake only warns on the torch version, and the kernels are
  # compiled against the torch they run with, so the pins are relaxed rather than torch rebuilt.
  pythonRelaxDeps = true;

  passthru = (old.passthru or { }) // {
    inherit cutlass;
    proximaPin = pin;
  };
})
