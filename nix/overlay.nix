# The appliance's changes to nixpkgs, as one overlay:
#   1. CUDA 12.1 becomes the CUDA of the whole package set. torch, triton, xformers, cupy and
#      vLLM take `cudaPackages` from the package set, so pointing it at cudaPackages_12_1 here
#      rebuilds all of them against 12.1: there is exactly one CUDA in the closure.
#   2. vLLM moves to the pinned card-stack release (nix/vllm.nix).
#   3. The Python packages nixos-24.11 lacks (sources.fallbacks: uvicorn-worker and three of
#      vLLM 0.6.3's requirements) are built from PyPI, each only if nixpkgs has none; those it
#      has too old (sources.newer: gunicorn) are replaced by the pinned release.
#   4. Proxima (nix/package.nix) joins every Python package set.
#
# nixpkgs must be imported with config.cudaSupport = true (flake.nix does), or torch and vLLM
# build for CPU only.
{
  sources,
  src,
  pyprojectFile,
}:

final: prev: {
  cudaPackages = final.${sources.cuda.attr};

  pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
    (
      pyfinal: pyprev:
      let
        fromPyPI = import ./pypi-package.nix {
          inherit (final) lib fetchurl;
          inherit (pyfinal) buildPythonPackage python;
        };
        fallback = name: pyprev.${name} or (fromPyPI name sources.fallbacks.${name});
        atLeast =
          name: pin:
          if builtins.compareVersions pyprev.${name}.version pin.atLeast < 0 then
            fromPyPI name pin
          else
            pyprev.${name};
      in
      builtins.mapAttrs (name: _: fallback name) sources.fallbacks
      // builtins.mapAttrs atLeast sources.newer
      // {
        vllm = pyfinal.callPackage ./vllm.nix {
          inherit sources;
          vllm = pyprev.vllm;
        };
        proxima = pyfinal.callPackage ./package.nix { inherit src pyprojectFile; };
      }
    )
  ];
}
