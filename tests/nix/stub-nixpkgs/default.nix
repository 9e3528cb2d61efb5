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
  checks = import ./python-checks.nix {
    inherit lib config;
    sdists = import ./sdists.nix;
  };

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

  # nixos-24.11's cudaPackages_X_Y: the components the flake's packages link, and cudaFlags
  # (24.11's name; later nixpkgs call it `flags`) computed from config.cudaCapabilities.
  mkCudaPackages =
    version:
    let
      comp =
        n:
        assert unfreeOk "cudaPackages.${n}";
        mkDrv { name = "${n}-${version}"; };
      capabilities = config.cudaCapabilities or [ "7.5" "8.0" "8.6" "9.0" ];
    in
    lib.genAttrs [
      "cuda_nvcc"
      "cuda_cudart"
      "cuda_cccl"
      "cuda_nvtx"
      "cuda_nvrtc"
      "cudnn"
      "nccl"
      "libcublas"
      "libcusparse"
      "libcusolver"
      "libcufile"
    ] comp
    // {
      cudaVersion = version;
      cudaMajorMinorVersion = version;
      cudaFlags = {
        cudaCapabilities = capabilities;
        cmakeCudaArchitecturesString = lib.concatStringsSep ";" (
          map (c: builtins.replaceStrings [ "." ] [ "" ] c) capabilities
        );
      };
      # The compiler CUDA code is built with (and that Triton's launcher is compiled with).
      backendStdenv.cc = mkDrv { name = "gcc-wrapper-13.3.0"; };
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
    # What Docker accepts in the image config it loads (nixpkgs passes the config through).
    assert lib.assertMsg (
      !(config ? Healthcheck)
      || (
        builtins.isList (config.Healthcheck.Test or null)
        && lib.elem (builtins.head config.Healthcheck.Test) [ "CMD" "CMD-SHELL" "NONE" ]
        && lib.all (k: builtins.isInt (config.Healthcheck.${k} or 0)) [ "Interval" "Timeout" "StartPeriod" "Retries" ]
      )
    ) "streamLayeredImage: Healthcheck must be { Test = [ \"CMD\" ... ]; Interval/Timeout/StartPeriod = <ns>; Retries = <n>; }";
    assert lib.assertMsg (
      !(config ? User) || builtins.match "[a-z0-9_-]+(:[a-z0-9_-]+)?" config.User != null
    ) "streamLayeredImage: User must be NAME, UID or UID:GID, got ${config.User or ""}";
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

      # nixpkgs' buildPythonPackage, with the checks of its build hooks done at evaluation time
      # (python-checks.nix) for every package the project builds. The stub's own packages
      # (stubOwn) stand for nixpkgs' and are not checked.
      buildPythonPackage =
        attrs:
        assert lib.assertMsg (attrs ? pname && attrs ? version) "buildPythonPackage: pname and version are required";
        assert lib.assertMsg (attrs ? src) "buildPythonPackage ${attrs.pname}: src is required";
        assert lib.assertMsg (
          (attrs.pyproject or false) -> (attrs ? build-system || attrs ? nativeBuildInputs)
        ) "buildPythonPackage ${attrs.pname}: pyproject = true needs build-system";
        let
          key = "${attrs.pname}-${attrs.version}";
          deps = (attrs.dependencies or [ ]) ++ (attrs.propagatedBuildInputs or [ ]);
          buildEnv =
            deps
            ++ (attrs.build-system or [ ])
            ++ (attrs.nativeBuildInputs or [ ])
            ++ (attrs.buildInputs or [ ]);
          # What the sdist says: from the source tree itself when it is local (Proxima), else
          # what sdists.nix recorded of the release.
          # A local source tree's own pyproject.toml (passthru.pyprojectFile, as nix/package.nix
          # gives it: `src` itself is not readable during `nix flake check --no-build`).
          localPyproject =
            if (attrs.passthru or { }) ? pyprojectFile then builtins.readFile attrs.passthru.pyprojectFile else null;
          recorded = import ./sdists.nix;
          sdist =
            if localPyproject != null then
              let
                patched = checks.substitute "pyproject.toml" (attrs.postPatch or "") localPyproject;
              in
              {
                pyprojectText = patched;
                requiresDist = (builtins.fromTOML patched).project.dependencies or [ ];
              }
            else if recorded ? ${key} then
              {
                pyprojectText =
                  if (recorded.${key}.buildSystem or null) == null then
                    null
                  else
                    checks.substitute "pyproject.toml" (attrs.postPatch or "") recorded.${key}.buildSystem;
                inherit (recorded.${key}) requiresDist;
              }
            else
              throw (
                "stub nixpkgs: nothing is known of the sdist ${key} (its [build-system] and "
                + "Requires-Dist): record them in tests/nix/stub-nixpkgs/sdists.nix"
              );
          # A wheel is installed, not built: no build-system check.
          errors =
            lib.optionals ((attrs.format or null) != "wheel") (
              checks.checkBuildSystem {
                inherit key buildEnv;
                inherit (sdist) pyprojectText;
              }
            )
            ++ lib.optionals (!(attrs.dontCheckRuntimeDeps or false)) (
              checks.checkRuntimeDeps {
                inherit key;
                inherit (sdist) requiresDist;
                dependencies = deps;
                relax = attrs.pythonRelaxDeps or false;
                remove = attrs.pythonRemoveDeps or [ ];
              }
            )
            ++ lib.optionals (recorded ? ${key} && recorded.${key} ? fetchContent) (
              checks.checkCmakeFlags {
                inherit key;
                inherit (recorded.${key}) fetchContent;
                cmakeFlags = attrs.cmakeFlags or [ ];
                cudaSupport = config.cudaSupport or false;
                inherit (pkgs) cudaPackages;
              }
            );
          verdict =
            if attrs.stubOwn or false || errors == [ ] then
              "passed"
            else
              throw "stub nixpkgs: building ${key} would fail in nixpkgs:\n  ${lib.concatStringsSep "\n  " errors}";
          drv = mkDrv {
            name = "${attr}-${attrs.pname}-${attrs.version}";
            deps =
              [ attrs.src ]
              ++ deps
              ++ (attrs.build-system or [ ])
              ++ (attrs.patches or [ ]);
            env = {
              cmakeFlags = toString (attrs.cmakeFlags or [ ]);
              postPatch = attrs.postPatch or "";
              stubBuildChecks = verdict;
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
          optional-dependencies = attrs.optional-dependencies or { };
          overridePythonAttrs =
            f:
            buildPythonPackage (
              builtins.removeAttrs (attrs // (if builtins.isFunction f then f attrs else f)) [ "stubOwn" ]
            );
          # What buildPythonPackage passed along, for the tests to inspect.
          stubArgs = attrs;
          stubDist = {
            name = checks.normalize attrs.pname;
            inherit (attrs) version;
          };
          stubKey = key;
          stubDeps = deps;
        };

      # One of nixpkgs' own packages (not checked; see buildPythonPackage).
      simple =
        pname: version: extra:
        buildPythonPackage (
          {
            inherit pname version;
            src = mkDrv { name = "${pname}-${version}-src"; };
            stubOwn = true;
          }
          // extra
        );

      # Versions are nixos-24.11's where the flake's checks depend on them (setuptools, uvicorn,
      # gunicorn, torch, cmake, setuptools-scm); the others only need to exist.
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
        wheel = simple "wheel" "0.44.0" { };
        packaging = simple "packaging" "24.1" { };
        setuptools-scm = simple "setuptools-scm" "8.1.0" { dependencies = [ self.packaging self.setuptools ]; };
        cmake = simple "cmake" "3.30.5" { };
        ninja = simple "ninja" "1.11.1.1" { };
        hatchling = simple "hatchling" "1.25.0" { };
        poetry-core = simple "poetry-core" "1.9.1" { };
        pdm-backend = simple "pdm-backend" "2.4.2" { };
        pytest = simple "pytest" "8.3.3" { };
        hypothesis = simple "hypothesis" "6.111.1" { };
        pytest-benchmark = simple "pytest-benchmark" "4.0.0" { };
        gunicorn = simple "gunicorn" "23.0.0" { dependencies = [ self.packaging ]; };
        uvicorn = simple "uvicorn" "0.30.6" {
          dependencies = [ self.click self.h11 ];
          optional-dependencies.standard = [ self.httptools self.uvloop self.websockets self.python-dotenv self.pyyaml self.watchfiles ];
        };
        aioprometheus = simple "aioprometheus" "23.12.0" {
          optional-dependencies.starlette = [ self.starlette ];
        };
        prometheus-client = simple "prometheus-client" "0.21.0" { };
        triton = simple "triton" "3.1.0" { dependencies = [ self.filelock ]; };
        jinja2 = simple "jinja2" "3.1.4" { };
        torch =
          assert lib.assertMsg (!(config.cudaSupport or false) || (config.allowUnfree or false))
            "torch: cudaSupport needs allowUnfree";
          simple "torch" "2.5.1" {
            dependencies = [
              self.triton
              self.jinja2
              self.filelock
              self.typing-extensions
              self.sympy
              self.networkx
              self.fsspec
            ] ++ lib.optional (config.cudaSupport or false) pkgs.cudaPackages.cuda_cudart;
            passthru = {
              cudaSupport = config.cudaSupport or false;
              inherit (pkgs) cudaPackages;
            };
          };
        transformers = simple "transformers" "4.46.3" {
          dependencies = [ self.requests self.tqdm self.filelock self.pyyaml self.numpy self.tokenizers self.packaging ];
        };
      }
      # Packages that only need to exist, at versions of nixos-24.11's era (names as in nixpkgs).
      // builtins.mapAttrs (name: version: simple name version { }) {
        aiohttp = "3.10.10";
        click = "8.1.7";
        cupy = "13.3.0";
        einops = "0.8.0";
        fastapi = "0.115.2";
        filelock = "3.16.1";
        fsspec = "2024.9.0";
        gguf = "0.10.0";
        h11 = "0.14.0";
        httptools = "0.6.1";
        importlib-metadata = "8.4.0";
        jsonschema = "4.23.0";
        lm-format-enforcer = "0.10.6";
        msgspec = "0.18.6";
        networkx = "3.3";
        numpy = "1.26.4";
        nvidia-ml-py = "12.560.30";
        openai = "1.52.0";
        outlines = "0.0.46";
        pandas = "2.2.3";
        pillow = "11.0.0";
        prometheus-fastapi-instrumentator = "7.0.0";
        protobuf = "4.25.5";
        psutil = "6.0.0";
        py-cpuinfo = "9.0.0";
        pyarrow = "17.0.0";
        pydantic = "2.9.2";
        pynvml = "11.5.3";
        python-dotenv = "1.0.1";
        pyyaml = "6.0.2";
        pyzmq = "26.2.0";
        ray = "2.38.0";
        requests = "2.32.3";
        sentencepiece = "0.2.0";
        six = "1.16.0";
        starlette = "0.40.0";
        sympy = "1.13.3";
        tiktoken = "0.8.0";
        tokenizers = "0.20.3";
        torchvision = "0.20.1";
        tqdm = "4.66.5";
        typing-extensions = "4.12.2";
        uvloop = "0.20.0";
        watchfiles = "0.24.0";
        websockets = "13.1";
        xformers = "0.0.28.post2";
      }
      // {
        # nixos-24.11's vLLM expression: 0.6.2, built the way nixpkgs' 0.6.x expressions build it.
        # compressed-tensors, mistral-common and partial-json-parser are not in nixos-24.11 (nixpkgs
        # PR #359609 introduced them with vLLM 0.6.4), nor is uvicorn-worker.
        vllm =
          let
            cudaSupport = config.cudaSupport or false;
            cp = pkgs.cudaPackages;
            cutlass = pkgs.fetchFromGitHub {
              owner = "NVIDIA";
              repo = "cutlass";
              rev = "refs/tags/v3.5.1";
              hash = "sha256-sTGYN+bjtEqQ7Ootr/wvx3P9f8MCDSSj3qyCWjfdLEA=";
            };
            mergedCudaLibraries = with cp; [ cuda_cudart cuda_cccl libcusparse libcusolver cuda_nvtx cuda_nvrtc libcublas ];
          in
          simple "vllm" "0.6.2" {
            pyproject = true;
            patches = [ ./vllm-0.6.2-stub.patch ];
            postPatch = ''
              substituteInPlace CMakeLists.txt \
                --replace-fail 'set(PYTHON_SUPPORTED_VERSIONS' 'set(PYTHON_SUPPORTED_VERSIONS "3.12"'
            '';
            nativeBuildInputs = [ self.cmake self.ninja ];
            build-system = [ self.packaging self.setuptools self.wheel ];
            buildInputs = [ self.setuptools-scm self.torch ] ++ lib.optionals cudaSupport (mergedCudaLibraries ++ [ cp.cudnn cp.libcufile ]);
            dependencies =
              (with self; [
                aioprometheus fastapi lm-format-enforcer numpy openai outlines pandas
                prometheus-fastapi-instrumentator psutil py-cpuinfo pyarrow pydantic pyzmq ray
                sentencepiece tiktoken tokenizers msgspec gguf einops importlib-metadata torch
                torchvision transformers uvicorn xformers
              ])
              ++ self.uvicorn.optional-dependencies.standard
              ++ self.aioprometheus.optional-dependencies.starlette
              ++ lib.optionals cudaSupport [ self.cupy self.pynvml ];
            cmakeFlags = [
              (lib.cmakeFeature "FETCHCONTENT_SOURCE_DIR_CUTLASS" "${cutlass}")
            ]
            ++ lib.optionals cudaSupport [
              (lib.cmakeFeature "TORCH_CUDA_ARCH_LIST" (lib.concatStringsSep ";" cp.cudaFlags.cudaCapabilities))
              (lib.cmakeFeature "CUTLASS_NVCC_ARCHS_ENABLED" cp.cudaFlags.cmakeCudaArchitecturesString)
              (lib.cmakeFeature "CUDA_TOOLKIT_ROOT_DIR" "${pkgs.symlinkJoin {
                name = "cuda-merged-${cp.cudaVersion}";
                paths = mergedCudaLibraries;
              }}")
              (lib.cmakeFeature "CAFFE2_USE_CUDNN" "ON")
              (lib.cmakeFeature "CAFFE2_USE_CUFILE" "ON")
              (lib.cmakeFeature "CUTLASS_ENABLE_CUBLAS" "ON")
            ];
            env = lib.optionalAttrs cudaSupport {
              VLLM_TARGET_DEVICE = "cuda";
              CUDA_HOME = "${cp.cuda_nvcc}";
            };
            pythonRelaxDeps = true;
            passthru.cudaSupport = cudaSupport;
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
    symlinkJoin =
      { name, paths, ... }:
      mkDrv {
        inherit name;
        deps = paths;
      };
    cacert = mkDrv { name = "nss-cacert-3.104"; };
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
      # nixpkgs' fakeNss: /etc/passwd and /etc/group with root and nobody, plus extra lines.
      fakeNss =
        let
          make =
            {
              extraPasswdLines ? [ ],
              extraGroupLines ? [ ],
            }:
            mkDrv {
              name = "fake-nss";
              env = {
                passwd = lib.concatStringsSep "\n" ([ "root:x:0:0:root user:/var/empty:/bin/sh" ] ++ extraPasswdLines ++ [ "nobody:x:65534:65534:nobody:/var/empty:/bin/sh" ]);
                group = lib.concatStringsSep "\n" ([ "root:x:0:" ] ++ extraGroupLines ++ [ "nobody:x:65534:" ]);
              };
            }
            // {
              override = args: make args;
              inherit extraPasswdLines extraGroupLines;
            };
        in
        make { };
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
