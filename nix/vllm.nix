# vLLM of the card stack (V0 engine), built from source against the pinned nixpkgs' torch and
# CUDA 12.1 (the overlay makes cudaPackages_12_1 the global CUDA, so torch, triton, xformers
# and this vLLM all link the same CUDA).
#
# Starts from nixos-24.11's own vLLM expression (0.6.2) and moves it to 0.6.3.post1
# (see nix/sources.nix for why that version). What changes, and what is kept:
#   - src: the pinned 0.6.3.post1 release;
#   - patches and postPatch: nixpkgs' are cut against 0.6.2's sources and dropped; in their
#     place nix/patches/ (checked to apply by tests/nix/test_sources.py) and the postPatch
#     below;
#   - cmakeFlags: nixpkgs' flags are KEPT (TORCH_CUDA_ARCH_LIST and CUTLASS_NVCC_ARCHS_ENABLED
#     from config.cudaCapabilities, the merged CUDA 12.1 root CUDA_TOOLKIT_ROOT_DIR, cuDNN,
#     cuFile, cuBLAS); only the FetchContent sources are replaced by the pinned ones. 0.6.3's
#     CMakeLists.txt fetches two repositories with FetchContent, which a sandboxed build cannot
#     (no network): CUTLASS v3.5.1 (FETCHCONTENT_SOURCE_DIR_CUTLASS) and
#     vllm-project/flash-attention (VLLM_FLASH_ATTN_SRC_DIR; new in 0.6.3, so 0.6.2's flags
#     lack it);
#   - dependencies: every requirement of 0.6.3.post1 (sources.vllm.requires) that 0.6.2's
#     list lacks is added by name, so nixpkgs' runtime dependency check finds each installed.
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
  runCommand,
  python,
  sources,
}:

let
  pin = sources.vllm;
  cutlass = fetchFromGitHub {
    name = "cutlass-source";
    inherit (sources.cutlass) owner repo rev hash;
  };
  # flash-attention's csrc/cutlass is a git submodule (absent from a GitHub archive): the pinned
  # CUTLASS takes its place.
  flashAttentionSrc = fetchFromGitHub {
    name = "flash-attention-source";
    inherit (sources.flash-attention) owner repo rev hash;
  };
  flashAttention = runCommand "flash-attention-source-with-cutlass" { } ''
    cp -r ${flashAttentionSrc} $out
    chmod -R u+w $out
    rm -rf $out/csrc/cutlass
    ln -s ${cutlass} $out/csrc/cutlass
  '';

  sourceFlags = [
    "FETCHCONTENT_SOURCE_DIR_CUTLASS"
    "VLLM_FLASH_ATTN_SRC_DIR"
  ];
  isSourceFlag = flag: lib.any (name: lib.hasPrefix "-D${name}=" flag) sourceFlags;

  normalize = name: lib.toLower (builtins.replaceStrings [ "_" "." ] [ "-" "-" ] name);
  pythonPackage =
    name:
    python.pkgs.${name} or (throw (
      "vLLM ${pin.version} requires the Python package '${name}', which the pinned nixpkgs "
      + "does not have: add it to fallbacks in nix/sources.nix"
    ));
in
vllm.overridePythonAttrs (
  old:
  let
    oldDependencies = (old.dependencies or [ ]) ++ (old.propagatedBuildInputs or [ ]);
    listed = map (dep: normalize (dep.pname or "")) oldDependencies;
    missing = lib.filter (name: !lib.elem name listed) pin.requires;
  in
  {
    version = pin.version;
    src = fetchurl {
      inherit (pin) url hash;
    };

    patches = [ ./patches/0001-setup.py-pass-nix-cmakeFlags-to-cmake.patch ];

    # pythonRelaxDeps relaxes the wheel's Requires-Dist, not pyproject.toml's build-system,
    # which pypa/build checks before it builds: 0.6.3.post1 asks for torch == 2.4.0 there.
    postPatch = ''
      substituteInPlace pyproject.toml --replace-fail '"torch == 2.4.0",' '"torch",'
    '';

    # setuptools-scm cannot read a version from a source tree without git metadata.
    env = (old.env or { }) // {
      SETUPTOOLS_SCM_PRETEND_VERSION = pin.version;
    };

    cmakeFlags = lib.filter (flag: !isSourceFlag flag) (old.cmakeFlags or [ ]) ++ [
      (lib.cmakeFeature "FETCHCONTENT_SOURCE_DIR_CUTLASS" "${cutlass}")
      (lib.cmakeFeature "VLLM_FLASH_ATTN_SRC_DIR" "${flashAttention}")
    ];

    dependencies = (old.dependencies or [ ]) ++ map pythonPackage missing;

    # vLLM 0.6.3.post1 pins torch==2.4.0, xformers==0.0.27.post2 and friends; nixos-24.11 builds
    # torch 2.5.1 from source. vLLM's CMake only warns on the torch version, and the kernels are
    # compiled against the torch they run with, so the pins are relaxed rather than torch rebuilt.
    pythonRelaxDeps = true;

    passthru = (old.passthru or { }) // {
      inherit cutlass flashAttention;
      proximaPin = pin;
      proximaAddedDependencies = missing;
    };
  }
)
