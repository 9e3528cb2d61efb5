# `nix flake check`: what must hold for the appliance, on any builder (no GPU, and nothing
# here needs the CUDA build of torch or vLLM).
#
#   image-config, cuda-pin,  evaluation-time assertions: they fail `nix flake check --no-build`
#   gpu-check-wired          already, before anything is built (CI runs them on a stub nixpkgs).
#   cpu-tests                tests/unit against Proxima without its run-time dependencies
#                            (proxima.passthru.core): minutes, no CUDA.
#
# The GPU check is deliberately NOT here (the nixpkgs gpuCheck way): it is
# proxima.passthru.gpuCheck, with requiredSystemFeatures = [ "cuda" ], built by
#   nix build .#proxima.gpuCheck
# on a builder that declares the `cuda` system feature and mounts the driver (docs/deploy.md);
# gpu-check-wired only makes sure it stays wired that way.
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
  cpuTests = proxima.passthru.tests.cpu;
in
{
  cpu-tests = cpuTests;

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
    {
      ok =
        cfg ? User
        && !(lib.elem (lib.head (lib.splitString ":" cfg.User)) [
          ""
          "0"
          "root"
        ]);
      what = "the image must run as a non-root user, User is ${cfg.User or "unset (root)"}";
    }
    {
      ok =
        (cfg.Healthcheck.Test or [ ]) != [ ]
        && lib.head cfg.Healthcheck.Test == "CMD"
        && lib.hasSuffix "healthcheck.py" (lib.last cfg.Healthcheck.Test);
      what = "the image must declare a health check (CMD ... docker/healthcheck.py: GET /health)";
    }
    {
      ok = lib.any (e: lib.hasPrefix "CC=/nix/store/" e) cfg.Env;
      what = "Env must set CC to a C compiler in the image (Triton compiles its launcher with it)";
    }
    {
      ok = lib.any (e: lib.hasPrefix "SSL_CERT_FILE=/nix/store/" e) cfg.Env;
      what = "Env must set SSL_CERT_FILE to the image's CA bundle (cacert)";
    }
  ];

  gpu-check-wired = evalCheck "gpu-check-wired" [
    {
      ok = (proxima.passthru.gpuCheck.requiredSystemFeatures or [ ]) == [ "cuda" ];
      what = "proxima.passthru.gpuCheck must carry requiredSystemFeatures = [ \"cuda\" ]";
    }
    {
      ok = (cpuTests.requiredSystemFeatures or [ ]) == [ ];
      what = "cpu-tests must build on any builder (no requiredSystemFeatures)";
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
}
