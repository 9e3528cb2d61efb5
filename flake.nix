{
  description = "Proxima: contiguous KV-cache memory for vLLM, as a hermetic serving appliance (CUDA 12.1)";

  # nixos-24.11: the last release whose vLLM is of the 0.6 line (0.6.2, moved to 0.6.3.post1 by
  # nix/vllm.nix), and it carries cudaPackages_12_1. The exact revision is pinned in flake.lock;
  # see docs/deploy.md for refreshing it.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs =
    { self, nixpkgs }:
    let
      # CUDA images are built for x86_64 Linux only.
      system = "x86_64-linux";
      sources = import ./nix/sources.nix;

      # Only what the Python package is built and tested from: a change to docs/, docker/ or
      # nix/ does not rebuild Proxima.
      src = builtins.path {
        name = "proxima-source";
        path = ./.;
        filter =
          path: type:
          let
            rel = nixpkgs.lib.removePrefix (toString ./. + "/") (toString path);
            top = builtins.head (nixpkgs.lib.splitString "/" rel);
            base = baseNameOf path;
          in
          builtins.elem top [
            "pyproject.toml"
            "README.md"
            "LICENSE"
            "proxima"
            "tests"
          ]
          && base != "__pycache__"
          && !(nixpkgs.lib.hasSuffix ".egg-info" base)
          && !(nixpkgs.lib.hasSuffix ".pyc" base);
      };

      overlay = import ./nix/overlay.nix {
        inherit sources src;
        pyprojectFile = ./pyproject.toml;
      };

      pkgs = import nixpkgs {
        inherit system;
        overlays = [ overlay ];
        config = {
          allowUnfree = true; # the CUDA toolkit's license
          cudaSupport = true;
          cudaCapabilities = sources.cuda.capabilities;
        };
      };

      python = pkgs.${sources.python.attr};
      proxima = python.pkgs.proxima;
      env = python.withPackages (ps: [ ps.proxima ]);
      nixpkgsRev = nixpkgs.rev or "dirty";

      imageWith =
        stream:
        pkgs.callPackage ./nix/image.nix {
          inherit
            python
            sources
            nixpkgsRev
            stream
            ;
        };
      image = imageWith true;

      # The GPU check (nix/gpu-check.py) outside the build sandbox, on any machine with a GPU;
      # inside the sandbox it is `nix build .#proxima.gpuCheck` (a builder with the cuda feature).
      gpuCheck = proxima.passthru.gpuCheck;
      gpuCheckApp = {
        type = "app";
        program = "${pkgs.writeShellScriptBin "proxima-gpu-check" ''
          export CC=''${CC:-${gpuCheck.CC}}
          export PROXIMA_HEALTHCHECK=${gpuCheck.PROXIMA_HEALTHCHECK}
          exec ${gpuCheck.env}/bin/python ${gpuCheck.script} "$@"
        ''}/bin/proxima-gpu-check";
      };

      # `nix run .#serve -- [MODEL] [vLLM options]` and `nix run .#selfcheck`.
      subcommandApp = name: {
        type = "app";
        program = "${pkgs.writeShellScriptBin "proxima-${name}" ''
          export PROXIMA_ALLOCATOR=''${PROXIMA_ALLOCATOR:-1}
          exec ${env}/bin/proxima ${name} "$@"
        ''}/bin/proxima-${name}";
      };
    in
    {
      overlays.default = overlay;

      packages.${system} = {
        default = proxima;
        inherit proxima;
        inherit (python.pkgs) vllm;
        # ./result | docker load
        proxima-image = image;
        # docker load < result
        proxima-image-tarball = imageWith false;
      };

      apps.${system} = {
        default = subcommandApp "serve";
        serve = subcommandApp "serve";
        selfcheck = subcommandApp "selfcheck";
        gpu-check = gpuCheckApp;
      };

      devShells.${system}.default = pkgs.mkShell {
        packages = [
          (python.withPackages (ps: [
            ps.vllm
            ps.gunicorn
            ps.uvicorn-worker
            ps.prometheus-client
            ps.pytest
            ps.hypothesis
            ps.pytest-benchmark
          ]))
        ];
        # The checkout itself is imported, so edits take effect without a rebuild.
        shellHook = ''
          export PYTHONPATH="$PWD''${PYTHONPATH:+:$PYTHONPATH}"
        '';
      };

      checks.${system} = pkgs.callPackage ./nix/checks.nix {
        inherit python image sources;
      };
    };
}
