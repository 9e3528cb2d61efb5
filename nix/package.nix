# The `proxima` Python package, built from this repository's pyproject.toml.
#
# The card stack's vLLM (nix/vllm.nix) is a run-time dependency here: in the appliance,
# Proxima always serves through vLLM. The version comes from pyproject.toml so that the Nix
# package and the wheel can never disagree.
#
# passthru.tests run on any builder (CPU). passthru.gpuChecks need a GPU in the build sandbox:
# they carry requiredSystemFeatures = [ "cuda" ] (the nixpkgs gpuCheck convention), so Nix
# schedules them only on a builder that declares the `cuda` system feature and mounts the
# driver (on NixOS: programs.nix-required-mounts.presets.nvidia-gpu.enable = true).
{
  lib,
  buildPythonPackage,
  runCommand,
  python,
  setuptools,
  vllm,
  gunicorn,
  uvicorn-worker,
  prometheus-client,
  pytest,
  hypothesis,
  pytest-benchmark,
  src,
  # pyproject.toml, parsed (read from the flake's own tree, not from `src`: `src` is a filtered
  # copy that need not exist yet while evaluating).
  pyproject,
}:

let

  # The environment the tests run in: Proxima plus the test tools of pyproject's `test` extra.
  testEnv = python.withPackages (_: [
    proxima
    pytest
    hypothesis
    pytest-benchmark
  ]);

  # Tests read from the source tree but import the installed package (not ./proxima).
  pytestIn =
    {
      name,
      args,
      gpu ? false,
    }:
    runCommand "proxima-${name}"
      (
        {
          nativeBuildInputs = [ testEnv ];
          # The tests must not reach a model hub: everything they load ships in the package.
          HF_HUB_OFFLINE = "1";
          TRANSFORMERS_OFFLINE = "1";
        }
        // lib.optionalAttrs gpu { requiredSystemFeatures = [ "cuda" ]; }
      )
      ''
        cp -r ${src}/tests ./tests
        cp ${src}/pyproject.toml .
        chmod -R u+w .
        export HOME=$TMPDIR
        python -m pytest -p no:cacheprovider -q ${args}
        touch $out
      '';

  proxima = buildPythonPackage {
    pname = pyproject.project.name;
    inherit (pyproject.project) version;
    pyproject = true;
    inherit src;

    build-system = [ setuptools ];
    dependencies = [
      vllm
      gunicorn
      uvicorn-worker
      prometheus-client
    ];

    pythonImportsCheck = [
      "proxima"
      "proxima.allocator"
    ];
    # The pytest suites run as passthru.tests below, against the installed package.
    doCheck = false;

    passthru = {
      inherit vllm;
      tests = {
        # Allocator and everything else that needs neither a GPU nor a model.
        cpu = pytestIn {
          name = "cpu-tests";
          args = "tests/unit";
        };
      };
      gpuChecks = {
        # `proxima selfcheck` on a real GPU: driver, CUDA 12.1 runtime, versions, Proxima
        # active inside the engine, and one canary generation with the embedded model.
        selfcheck =
          runCommand "proxima-gpu-selfcheck"
            {
              nativeBuildInputs = [ testEnv ];
              requiredSystemFeatures = [ "cuda" ];
              HF_HUB_OFFLINE = "1";
              TRANSFORMERS_OFFLINE = "1";
              PROXIMA_ALLOCATOR = "1";
            }
            ''
              export HOME=$TMPDIR
              proxima selfcheck
              touch $out
            '';
        # The `gpu`-marked tests of the repository (serving, restart, metrics).
        pytest = pytestIn {
          name = "gpu-tests";
          args = "-m gpu tests/gpu";
          gpu = true;
        };
      };
    };

    meta = {
      description = pyproject.project.description;
      license = lib.licenses.asl20;
      mainProgram = "proxima";
      platforms = [ "x86_64-linux" ];
    };
  };
in
proxima
