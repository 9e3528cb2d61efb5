# The `proxima` Python package, built from this repository's pyproject.toml.
#
# The card stack's vLLM (nix/vllm.nix) is a run-time dependency here: in the appliance,
# Proxima always serves through vLLM. The version comes from pyproject.toml so that the Nix
# package and the wheel can never disagree.
#
# passthru.core is the same package without its run-time dependencies (no vLLM, no torch, no
# CUDA): what passthru.tests.cpu (tests/unit, the allocator) runs against, so the CPU checks
# of `nix flake check` never wait for the CUDA build.
#
# passthru.gpuCheck needs a GPU in the build sandbox: requiredSystemFeatures = [ "cuda" ] (the
# nixpkgs gpuCheck convention, as in triton's and torch's GPU tests), so Nix builds it only on
# a builder that declares the `cuda` system feature and mounts the driver (on NixOS:
# programs.nix-required-mounts.presets.nvidia-gpu.enable = true). It is not among the flake's
# `checks`: `nix build .#proxima.gpuCheck` runs it, `nix run .#gpu-check` runs the same script
# outside the sandbox on any machine with a GPU (docs/deploy.md).
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
  cudaPackages,
  src,
  # The flake's own pyproject.toml (read from the flake's tree, not from `src`: `src` is a
  # filtered copy that need not exist yet while evaluating).
  pyprojectFile,
}:

let
  pyproject = builtins.fromTOML (builtins.readFile pyprojectFile);
  project = pyproject.project;

  # nixos-24.11's setuptools (75.1) reads neither an SPDX `project.license` string (PEP 639,
  # setuptools >= 77) nor, so, the `setuptools>=77` that pyproject.toml asks for: pypa/build
  # checks build-system.requires before building. For the Nix build only, the license goes
  # back to the table form and the floor is dropped; the wheel's metadata says the same
  # license either way. --replace-fail: a pyproject.toml that no longer reads like this
  # stops the build here, not with a confusing setuptools error.
  license = project.license;
  setuptoolsFloors = lib.filter (r: builtins.match "setuptools *>=.*" r != null) (
    pyproject.build-system.requires or [ ]
  );
  postPatch =
    lib.optionalString (builtins.isString license) ''
      substituteInPlace pyproject.toml --replace-fail 'license = "${license}"' 'license = { text = "${license}" }'
    ''
    + lib.concatMapStrings (floor: ''
      substituteInPlace pyproject.toml --replace-fail '"${floor}"' '"setuptools"'
    '') setuptoolsFloors;

  # Tests read from the source tree but import the installed package (not ./proxima).
  pytestIn =
    {
      name,
      args,
      package,
    }:
    runCommand "proxima-${name}"
      {
        nativeBuildInputs = [
          (python.withPackages (_: [
            package
            pytest
            hypothesis
            pytest-benchmark
          ]))
        ];
        # The tests must not reach a model hub: everything they load ships in the package.
        HF_HUB_OFFLINE = "1";
        TRANSFORMERS_OFFLINE = "1";
      }
      ''
        cp -r ${src}/tests ./tests
        cp ${src}/pyproject.toml .
        chmod -R u+w .
        export HOME=$TMPDIR
        python -m pytest -p no:cacheprovider -q ${args}
        touch $out
      '';

  # What the GPU check runs in: the image's own environment (nix/image.nix), plus the C
  # compiler that Triton compiles its launcher with at the first kernel launch.
  gpuEnv = python.withPackages (_: [ proxima ]);
  cc = lib.getExe' cudaPackages.backendStdenv.cc "cc";
  gpuCheckScript = ./gpu-check.py;

  gpuCheck =
    runCommand "proxima-gpu-check"
      {
        nativeBuildInputs = [ gpuEnv ];
        requiredSystemFeatures = [ "cuda" ];
        HF_HUB_OFFLINE = "1";
        TRANSFORMERS_OFFLINE = "1";
        CC = cc;
        # The images' health check (nix/image.nix), run by the check against a live server.
        PROXIMA_HEALTHCHECK = "${../docker/healthcheck.py}";
        passthru = {
          script = gpuCheckScript;
          env = gpuEnv;
        };
      }
      ''
        export HOME=$TMPDIR
        python ${gpuCheckScript} --out $out
      '';

  proxima = buildPythonPackage {
    pname = project.name;
    inherit (project) version;
    pyproject = true;
    inherit src postPatch;

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
      inherit vllm gpuCheck core;
      # The pyproject.toml that `src` holds (what the build's postPatch edits).
      inherit pyprojectFile;
      tests = {
        # Allocator and everything else that needs neither a GPU nor a model.
        cpu = pytestIn {
          name = "cpu-tests";
          args = "tests/unit";
          package = core;
        };
      };
    };

    meta = {
      description = project.description;
      license = lib.licenses.asl20;
      mainProgram = "proxima";
      platforms = [ "x86_64-linux" ];
    };
  };

  # Proxima without its run-time dependencies: the allocator and the CLI's pure-Python parts.
  core = proxima.overridePythonAttrs (_: {
    pname = "${project.name}-core";
    dependencies = [ ];
    passthru = { inherit pyprojectFile; };
  });
in
proxima
