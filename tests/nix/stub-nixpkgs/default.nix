# `import nixpkgs { system; overlays; config; }`, stubbed. Packages are trivial derivations
# (instantiable, never meant to be built) that carry the attributes nixpkgs' real packages
# expose and that Proxima's flake reads (version, cudaSupport, cudaPackages, passthru, ...).
{
  system ? builtins.currentSystem,
  overlays ? [ ],
  config ? { },
  ...
}:

let
  lib = import ./lib.nix;

  # Every value that reaches a derivation's environment must be a string, a path, a
  # derivation or a list of those: nixpkgs would fail the same way on anything else.
  mkDrv =
    {
      name,
      deps ? [ ],
      env ? { },
    }:
    derivation (
      {
        inherit name system;
        builder = "/bin/sh";
        args = [
          "-c"
          "echo 'stub nixpkgs: this derivation is for evaluation only' >&2; exit 1"
        ];
        deps = map toString deps;
      }
      // env
    );

  # Fixed-output fetchers: the hash must be an SRI sha256, as nixpkgs requires of new code.
  checkHash =
    what: hash:
    assert lib.assertMsg (
      builtins.isString hash && builtins.match "sha256-[A-Za-z0-9+/]{43}=" hash != null
    ) "${what}: hash must be an SRI sha256 (sha256-<44 base64 chars>), got ${toString hash}";
    hash;
  fixedOutput =
    name: hash:
    derivation {
      inherit name system;
      builder = "/bin/sh";
      args = [
        "-c"
        "exit 1"
      ];
      outputHashMode = "recursive";
      outputHash = checkHash name hash;
    };

  unfreeOk =
    what:
    lib.assertMsg (config.allowUnfree or false)
      "stub nixpkgs: ${what} has an unfree license; set config.allowUnfree = true";

  mkCudaPackages =
    version:
    let
      comp =
        n:
        assert unfreeOk "cudaPackages.${n}";
        mkDrv { name = "${n}-${version}"; };
    in
    {
      cudaVersion = version;
      cudaMajorMinorVersion = version;
      cuda_nvcc = comp "cuda_nvcc";
      cuda_cudart = comp "cuda_cudart";
      cudnn = comp "cudnn";
      nccl = comp "nccl";
      libcublas = comp "libcublas";
      flags.cudaCapabilities = config.cudaCapabilities or [ "7.5" "8.0" "8.6" "9.0" ];
    };

  # The real streamLayeredImage takes exactly these arguments (no `...`): an unknown one is an
  # evaluation error there, and so it is here.
  ociConfigKeys = [
    "User"
    "ExposedPorts"
    "Env"
    "Entrypoint"
    "Cmd"
    "Volumes"
    "WorkingDir"
    "Labels"
    "StopSignal"
    "Healthcheck"
  ];
  streamLayeredImage =
    {
      name,
      tag ? null,
      fromImage ? null,
      contents ? [ ],
      config ? { },
      architecture ? "amd64",
      created ? "1970-01-01T00:00:01Z",
      uid ? 0,
      gid ? 0,
      uname ? "root",
      gname ? "root",
      maxLayers ? 100,
      extraCommands ? "",
      fakeRootCommands ? "",
      enableFakechroot ? false,
      includeStorePaths ? true,
      passthru ? { },
    }:
    let
      badKeys = lib.filter (k: !(lib.elem k ociConfigKeys)) (builtins.attrNames config);
      conf = builtins.toJSON config;
    in
    assert lib.assertMsg (badKeys == [ ])
      "streamLayeredImage: not OCI image config keys: ${toString badKeys}";
    assert lib.assertMsg (maxLayers > 1 && maxLayers <= 125) "streamLayeredImage: maxLayers out of range";
    assert lib.assertMsg (builtins.match "[0-9]{4}-[0-9]{2}-[0-9]{2}T.*Z|now" created != null)
      "streamLayeredImage: created must be an ISO 8601 UTC time or \"now\"";
    (mkDrv {
      name = "stream-${baseNameOf name}";
      deps = contents;
      env = {
        inherit conf extraCommands fakeRootCommands;
        imageName = name;
        imageTag = if tag == null then "latest" else tag;
      };
    })
    // passthru
    // {
      inherit passthru;
      imageTag = if tag == null then "latest" else tag;
      isExe = true;
    };

  buildLayeredImage =
    {
      name,
      compressor ? "gz",
      ...
    }@args:
    let
      stream = streamLayeredImage (builtins.removeAttrs args [ "compressor" ]);
    in
    (mkDrv {
      name = "${baseNameOf name}.tar.gz";
      deps = [ stream ];
    })
    // {
      inherit (stream) imageTag;
      inherit stream;
    };

  pythonFor =
    pkgs: attr: pythonVersion:
    let
      interpreter = mkDrv { name = "${attr}-${pythonVersion}.8"; };

      buildPythonPackage =
        attrs:
        assert lib.assertMsg (attrs ? pname && attrs ? version) "buildPythonPackage: pname and version are required";
        assert lib.assertMsg (attrs ? src) "buildPythonPackage ${attrs.pname}: src is required";
        assert lib.assertMsg (
          (attrs.pyproject or false) -> (attrs ? build-system || attrs ? nativeBuildInputs)
        ) "buildPythonPackage ${attrs.pname}: pyproject = true needs build-system";
        let
          drv = mkDrv {
            name = "${attr}-${attrs.pname}-${attrs.version}";
            deps =
              [ attrs.src ]
              ++ (attrs.dependencies or [ ])
              ++ (attrs.propagatedBuildInputs or [ ])
              ++ (attrs.build-system or [ ])
              ++ (attrs.patches or [ ]);
            env = {
              cmakeFlags = toString (attrs.cmakeFlags or [ ]);
            } // (attrs.env or { });
          };
        in
        drv
        // (attrs.passthru or { })
        // {
          inherit (attrs) pname version;
          # Like nixpkgs' mkDerivation: passthru attributes are on the result and under .passthru.
          passthru = attrs.passthru or { };
          meta = attrs.meta or { };
          overridePythonAttrs =
            f: buildPythonPackage (attrs // (if builtins.isFunction f then f attrs else f));
          # What buildPythonPackage passed along, for the tests to inspect.
          stubArgs = attrs;
        };

      simple =
        pname: version: extra:
        buildPythonPackage (
          {
            inherit pname version;
            src = mkDrv { name = "${pname}-${version}-src"; };
          }
          // extra
        );

      base = self: {
        python = pythonSelf;
        inherit buildPythonPackage;
        callPackage =
          fn: args:
          let
            f = if builtins.isFunction fn then fn else import fn;
          in
          f (builtins.intersectAttrs (builtins.functionArgs f) (pkgs // self) // args);

        setuptools = simple "setuptools" "75.1.0" { };
        hatchling = simple "hatchling" "1.25.0" { };
        pytest = simple "pytest" "8.3.3" { };
        hypothesis = simple "hypothesis" "6.111.1" { };
        pytest-benchmark = simple "pytest-benchmark" "4.0.0" { };
        gunicorn = simple "gunicorn" "23.0.0" { };
        uvicorn = simple "uvicorn" "0.30.6" { };
        prometheus-client = simple "prometheus-client" "0.21.0" { };
        compressed-tensors = simple "compressed-tensors" "0.6.0" { };
        triton = simple "triton" "3.1.0" { };
        torch =
          assert lib.assertMsg (!(config.cudaSupport or false) || (config.allowUnfree or false))
            "torch: cudaSupport needs allowUnfree";
          simple "torch" "2.5.1" {
            dependencies = [ self.triton ] ++ lib.optional (config.cudaSupport or false) pkgs.cudaPackages.cuda_cudart;
            passthru = {
              cudaSupport = config.cudaSupport or false;
              inherit (pkgs) cudaPackages;
            };
          };
        # nixos-24.11's vLLM: 0.6.2 with its own patches and CUTLASS.
        vllm = simple "vllm" "0.6.2" {
          pyproject = true;
          build-system = [ self.setuptools ];
          dependencies = [ self.torch ];
          patches = [ ./vllm-0.6.2-stub.patch ];
          cmakeFlags = [ "-DFETCHCONTENT_SOURCE_DIR_CUTLASS=/nix/store/stub-cutlass-3.5.0" ];
          passthru.cudaSupport = config.cudaSupport or false;
        };
      };

      packages = lib.fix (
        lib.foldl' (acc: ext: lib.extends ext acc) base pkgs.pythonPackagesExtensions
      );

      pythonSelf =
        interpreter
        // {
          inherit pythonVersion;
          pkgs = packages;
          withPackages =
            f:
            mkDrv {
              name = "${attr}-${pythonVersion}.8-env";
              deps = [ interpreter ] ++ f packages;
            };
        };
    in
    pythonSelf;

  base = self: {
    inherit lib system config;
    pythonPackagesExtensions = [ ];

    callPackage =
      fn: args:
      let
        f = if builtins.isFunction fn then fn else import fn;
      in
      f (builtins.intersectAttrs (builtins.functionArgs f) self // args);

    runCommand =
      name: env: script:
      mkDrv {
        inherit name;
        env = (builtins.removeAttrs env [ "passthru" ]) // {
          buildCommand = script;
        };
      }
      // (env.passthru or { })
      // {
        passthru = env.passthru or { };
      };
    writeShellScriptBin =
      name: text:
      mkDrv {
        name = name;
        env.text = text;
      };
    mkShell =
      {
        packages ? [ ],
        shellHook ? "",
        ...
      }:
      mkDrv {
        name = "nix-shell";
        deps = packages;
        env = {
          inherit shellHook;
        };
      };

    fetchurl =
      { url, hash, ... }:
      assert lib.assertMsg (lib.hasPrefix "https://" url) "fetchurl: url must be https, got ${url}";
      fixedOutput (baseNameOf url) hash;
    fetchFromGitHub =
      {
        owner,
        repo,
        rev ? null,
        tag ? null,
        hash,
        name ? "source",
        fetchSubmodules ? false,
      }:
      assert lib.assertMsg ((rev == null) != (tag == null)) "fetchFromGitHub: give exactly one of rev and tag";
      fixedOutput name hash;

    dockerTools = {
      inherit streamLayeredImage buildLayeredImage;
      fakeNss = mkDrv { name = "fake-nss"; };
    };

    cudaPackages_12_1 = mkCudaPackages "12.1";
    cudaPackages_12_4 = mkCudaPackages "12.4";
    # nixos-24.11's default CUDA is 12.4: the flake's overlay has to move it to 12.1.
    cudaPackages = self.cudaPackages_12_4;

    python312 = pythonFor self "python312" "3.12";
    python311 = pythonFor self "python311" "3.11";
    python3 = self.python312;
    python3Packages = self.python3.pkgs;
  };
in
lib.fix (lib.foldl' (acc: overlay: lib.extends overlay acc) base overlays)
