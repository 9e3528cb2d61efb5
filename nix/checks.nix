# `nix flake check`: what must hold for the appliance.
#
#   image-config, cuda-pin  evaluation-time assertions: they fail `nix flake check --no-build`
#                           already, before anything is built (CI runs them on a stub nixpkgs).
#   proxima, cpu-tests      the package and its CPU test suite: any builder.
#   gpu-selfcheck,          requiredSystemFeatures = [ "cuda" ]: built only by a builder that
#   gpu-tests               has a GPU (system-features = cuda, driver mounted in the sandbox);
#                           elsewhere `nix flake check` reports them as not buildable here.
{
  lib,
  runCommand,
  cudaPackages,
  python,
  image,
  sources,
}:

let
  proxima = python.pkgs.proxima;
  inherit (python.pkgs) torch vllm;
  cfg = image.imageConfig;

  # A check that is decided during evaluation and builds an empty marker file.
  evalCheck =
    name: assertions:
    let
      failed = lib.filter (a: !a.ok) assertions;
    in
    if failed == [ ] then
      runCommand "proxima-${name}" { } "touch $out"
    else
      throw "proxima check ${name} failed:\n${lib.concatMapStringsSep "\n" (a: "  - ${a.what}") failed}";

  hasEnv = entry: lib.elem entry cfg.Env;
in
{
  inherit proxima;
  cpu-tests = proxima.passthru.tests.cpu;

  image-config = evalCheck "image-config" [
    {
      ok = lib.length cfg.Entrypoint == 2 && baseNameOf (lib.head cfg.Entrypoint) == "proxima";
      what = "entrypoint must be <store>/bin/proxima serve, is ${toString cfg.Entrypoint}";
    }
    {
      ok = lib.last cfg.Entrypoint == "serve";
      what = "entrypoint must end in `serve`, is ${toString cfg.Entrypoint}";
    }
    {
      ok = hasEnv "PROXIMA_ALLOCATOR=1";
      what = "Env must set PROXIMA_ALLOCATOR=1";
    }
    {
      ok = hasEnv "HF_HUB_OFFLINE=1" && hasEnv "TRANSFORMERS_OFFLINE=1";
      what = "Env must set HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1";
    }
    {
      ok = cfg.ExposedPorts ? "8000/tcp";
      what = "port 8000/tcp must be exposed";
    }
    {
      ok = cfg.Volumes ? "/models";
      what = "/models must be a volume";
    }
    {
      ok = (cfg.Labels."ai.proxima.cuda.version" or null) == sources.cuda.version;
      what = "label ai.proxima.cuda.version must be ${sources.cuda.version}";
    }
  ];

  cuda-pin = evalCheck "cuda-pin" [
    {
      ok = cudaPackages.cudaVersion == sources.cuda.version;
      what = "cudaPackages is CUDA ${cudaPackages.cudaVersion}, the pin is ${sources.cuda.version}";
    }
    {
      ok = torch.cudaSupport && torch.cudaPackages.cudaVersion == sources.cuda.version;
      what = "torch must be built with CUDA ${sources.cuda.version}";
    }
    {
      ok = vllm.version == sources.vllm.version;
      what = "vLLM is ${vllm.version}, the pin is ${sources.vllm.version}";
    }
  ];

  gpu-selfcheck = proxima.passthru.gpuChecks.selfcheck;
  gpu-tests = proxima.passthru.gpuChecks.pytest;
}
