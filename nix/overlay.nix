# The appliance's changes to nixpkgs, as one overlay:
#   1. CUDA 12.1 becomes the CUDA of the whole package set. torch, triton, xformers, cupy and
#      vLLM take `cudaPackages` from the package set, so pointing it at cudaPackages_12_1 here
#      rebuilds all of them against 12.1: there is exactly one CUDA in the closure.
#   2. vLLM moves to the pinned card-stack release (nix/vllm.nix).
#   3. Proxima (nix/package.nix) joins every Python package set.
#
# nixpkgs must be imported with config.cudaSupport = true (flake.nix does), or torch and vLLM
# build for CPU only.
{ sources, src, pyproject }:

final: prev: {
  cudaPackages = final.${sources.cuda.attr};

  pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
    (pyfinal: pyprev: {
      vllm = pyfinal.callPackage ./vllm.nix {
        inherit sources;
        vllm = pyprev.vllm;
      };
      uvicorn-worker =
        pyprev.uvicorn-worker or (pyfinal.callPackage ./uvicorn-worker.nix { inherit sources; });
      proxima = pyfinal.callPackage ./package.nix { inherit src pyproject; };
    })
  ];
}
