# Every pinned source and version of the appliance, in one place.
#
# The nixpkgs revision itself is pinned in flake.lock (input `nixpkgs`, branch nixos-24.11).
# Everything here is fetched by a fixed-output hash; a hash that does not match fails the build
# loudly, it never silently fetches something else.
{
  # CUDA 12.1: the CUDA that vLLM 0.6.3.post1's PyPI wheels (the card stack) were built for;
  # it needs an NVIDIA driver >= 530.30.02 on the host. nixos-24.11 carries cudaPackages_12_1
  # (so does nixos-25.05; nixpkgs dropped 12.0-12.5 in August 2025, PR #434827, for 25.11).
  # 24.11 is chosen because it is the last release whose vLLM is of the 0.6 line (see below).
  cuda = {
    version = "12.1";
    attr = "cudaPackages_12_1";
    # Compute capabilities compiled for: A100 (8.0), A10/RTX 30 (8.6), L4/L40/RTX 40 (8.9),
    # H100/H200 (9.0). Each added capability lengthens the CUDA build of torch and vLLM.
    capabilities = [ "8.0" "8.6" "8.9" "9.0" ];
  };

  # Python of the appliance: nixos-24.11's default Python 3 (3.12), named explicitly so that a
  # change of nixpkgs' default cannot change the image unnoticed.
  python = {
    attr = "python312";
    version = "3.12";
  };

  # vLLM of the card stack: v0.6.3.post1, the last vLLM release built for CUDA 12.1 and
  # torch 2.4 (0.6.4 moved to torch 2.5.1 and CUDA 12.4) and the newest release of the V0-only
  # 0.6 line that proxima/vllm/vllm_v0.py supports. nixos-24.11 ships vLLM 0.6.2; 0.6.3.post1
  # is its bug-fix successor (same V0 block manager interface). nixos-25.05 moved to vLLM 0.8.
  #
  # Pinned by the release's source distribution on PyPI, which is cut from the upstream tag
  # v0.6.3.post1 (https://github.com/vllm-project/vllm/releases/tag/v0.6.3.post1). The sdist's
  # sha256 below was computed from the downloaded file; tests/nix/test_sources.py re-downloads
  # it and checks both the hash and that every patch in nix/patches/ applies.
  vllm = {
    version = "0.6.3.post1";
    tag = "v0.6.3.post1";
    url = "https://files.pythonhosted.org/packages/a8/e4/aa15731375a16d701331c54fe6024d1ed165777a6bdc29a587a5d77a5713/vllm-0.6.3.post1.tar.gz";
    sha256 = "0aae6ddd5348f86bf20e4f323c09e77d5ad2638d77f0d69323c5a63a40f8c143";
    hash = "sha256-Cq5t3VNI+GvyDk8yPAnnfVrSY4138NaTI8WmOkD4wUM=";
    # The names in its Requires-Dist (PKG-INFO of the sdist) whose markers hold on Linux x86_64
    # with Python 3.12, as nixpkgs attribute names. nixpkgs checks at the end of the build that
    # every one is installed (pythonRuntimeDepsCheckHook; versions are relaxed, see
    # nix/vllm.nix): nix/vllm.nix adds each that nixos-24.11's vLLM 0.6.2 expression does not
    # already list. tests/nix/test_sources.py compares this list with the sdist's PKG-INFO.
    requires = [
      "aiohttp" "compressed-tensors" "einops" "fastapi" "filelock" "gguf" "importlib-metadata"
      "lm-format-enforcer" "mistral-common" "msgspec" "numpy" "nvidia-ml-py" "openai" "outlines"
      "partial-json-parser" "pillow" "prometheus-client" "prometheus-fastapi-instrumentator"
      "protobuf" "psutil" "py-cpuinfo" "pydantic" "pyyaml" "pyzmq" "ray" "requests"
      "sentencepiece" "setuptools" "six" "tiktoken" "tokenizers" "torch" "torchvision" "tqdm"
      "transformers" "typing-extensions" "uvicorn" "xformers"
    ];
  };

  # CUTLASS, fetched by vLLM's CMakeLists.txt with FetchContent (GIT_TAG v3.5.1 in
  # vllm-0.6.3.post1/CMakeLists.txt); Nix provides it as a source directory instead.
  # The hash is the fetchFromGitHub (NAR) hash of NVIDIA/cutlass v3.5.1 as used by public Nix
  # expressions; it was not recomputed on this project's (offline) CI machine.
  cutlass = {
    owner = "NVIDIA";
    repo = "cutlass";
    rev = "v3.5.1";
    hash = "sha256-sTGYN+bjtEqQ7Ootr/wvx3P9f8MCDSSj3qyCWjfdLEA=";
  };

  # vllm-project/flash-attention, fetched by vLLM 0.6.3.post1's CMakeLists.txt with FetchContent
  # (GIT_TAG 013f0c4f... in vllm-0.6.3.post1/CMakeLists.txt, unless VLLM_FLASH_ATTN_SRC_DIR names
  # a source directory); nix/vllm.nix passes this pinned source instead. Its csrc/cutlass git
  # submodule is replaced by the CUTLASS above, as nixpkgs' own vLLM expressions do. The hash is
  # the fetchFromGitHub (NAR, no submodules) hash of that commit used by public Nix expressions of
  # vLLM 0.6.3.post1; it was not recomputed on this project's (offline) CI machine.
  flash-attention = {
    owner = "vllm-project";
    repo = "flash-attention";
    rev = "013f0c4fc47e6574060879d9734c1df8c5c273bd";
    hash = "sha256-5wYPIO9QgqpBqoL/L6dJKaSllgwldu9OeNRutDgcXvs=";
  };

  # Python packages that nixos-24.11 ships too old for this closure: replaced (nix/overlay.nix)
  # when nixpkgs' version is older than `atLeast`. Pinned by their PyPI files (hashes computed
  # from the files, checked again by tests/nix/test_sources.py).
  newer = {
    # proxima/serve/gunicorn_conf.py sets control_socket_disable, a setting gunicorn has since
    # 25.1.0; nixos-24.11's gunicorn (23.0.0) refuses it ("No configuration setting for:
    # control_socket_disable") and `proxima serve` would stop at start-up. The wheel, not the
    # sdist: gunicorn 25 writes its license as an SPDX string, which nixos-24.11's setuptools
    # cannot build (see nix/package.nix); a pure-Python wheel needs no build.
    gunicorn = {
      atLeast = "25.1";
      version = "25.1.0";
      format = "wheel";
      url = "https://files.pythonhosted.org/packages/da/73/4ad5b1f6a2e21cf1e85afdaad2b7b1a933985e2f5d679147a1953aaa192c/gunicorn-25.1.0-py3-none-any.whl";
      sha256 = "d0b1236ccf27f72cfe14bce7caadf467186f19e865094ca84221424e839b8b8b";
      hash = "sha256-0LEjbM8n9yz+FLznyq30ZxhvGehlCUyoQiFCToObi4s=";
      dependencies = [ "packaging" ];
      imports = [ "gunicorn" ];
    };
  };

  # Python packages that nixos-24.11 lacks or ships too new for this closure: built from their
  # PyPI sdists (hashes computed from the files; tests/nix/test_sources.py downloads them again
  # and checks their metadata), used only when the pinned nixpkgs has no package of that name
  # (nix/overlay.nix). `dependencies` and `build-system` are nixpkgs attribute names.
  fallbacks = {
    # gunicorn's UvicornWorker (uvicorn >= 0.30 moved it out of uvicorn), used by `proxima serve`.
    # 0.3.0, not 0.4.0: 0.4.0 requires uvicorn >= 0.36.0 and nixos-24.11's uvicorn is older, so
    # nixpkgs' runtime dependency check (pythonRuntimeDepsCheckHook) would fail the build.
    # 0.3.0 requires uvicorn >= 0.15.0 and gunicorn >= 20.1.0; its UvicornWorker has what
    # proxima/serve/worker.py overrides (_serve, _install_sigquit_handler, CONFIG_KWARGS).
    uvicorn-worker = {
      version = "0.3.0";
      url = "https://files.pythonhosted.org/packages/37/c0/b5df8c9a31b0516a47703a669902b362ca1e569fed4f3daa1d4299b28be0/uvicorn_worker-0.3.0.tar.gz";
      sha256 = "6baeab7b2162ea6b9612cbe149aa670a76090ad65a267ce8e27316ed13c7de7b";
      hash = "sha256-a66reyFi6muWEsvhSapnCnYJCtZaJnzo4nMW7RPH3ns=";
      build-system = [ "hatchling" ];
      dependencies = [ "gunicorn" "uvicorn" ];
      imports = [ "uvicorn_worker" ];
    };
    # Three requirements of vLLM 0.6.3.post1 that nixpkgs only gained after 24.11 branched
    # (nixpkgs PR #359609 introduced them along with vLLM 0.6.4). Their own pins (mistral-common:
    # pillow < 11, sentencepiece == 0.2.0, tiktoken < 0.8) are relaxed like vLLM's, to the
    # versions of the pinned nixpkgs.
    compressed-tensors = {
      version = "0.6.0"; # vLLM 0.6.3.post1 asks for == 0.6.0
      url = "https://files.pythonhosted.org/packages/66/35/744dff9b02c0746dd248844b43e801fdcc73356f0a57ece86343a7360cd8/compressed-tensors-0.6.0.tar.gz";
      sha256 = "639ca97afc852602be0d3666b236ad6a96880de45af87851f515047eff700927";
      hash = "sha256-Y5ypevyFJgK+DTZmsjatapaIDeRa+HhR9RUEfv9wCSc=";
      build-system = [ "setuptools" ];
      dependencies = [ "torch" "transformers" "pydantic" ];
      imports = [ "compressed_tensors" ];
    };
    mistral-common = {
      version = "1.4.4"; # vLLM 0.6.3.post1 asks for >= 1.4.4
      url = "https://files.pythonhosted.org/packages/b3/7c/5391ddeb4720546314542e7ecf5c909bcb16c2044aafb7ff46b8a48f482b/mistral_common-1.4.4.tar.gz";
      sha256 = "110e1b937aee99fdcf3cefc6b4e924e7e22ff445246090fe9215051245caa59c";
      hash = "sha256-EQ4bk3rumf3PPO/GtOkk5+Iv9EUkYJD+khUFEkXKpZw=";
      build-system = [ "poetry-core" ];
      dependencies = [ "jsonschema" "numpy" "pillow" "pydantic" "requests" "sentencepiece" "tiktoken" "typing-extensions" ];
      relaxDeps = true;
      imports = [ "mistral_common" ];
    };
    partial-json-parser = {
      version = "0.2.1.1.post4";
      url = "https://files.pythonhosted.org/packages/26/b7/1bea5eda490b2fbb2a5c7454da5827658f65306fc71d1053d06204f16c4c/partial_json_parser-0.2.1.1.post4.tar.gz";
      sha256 = "a38f11ceb89a86fbfbd0acad4170d417dcb317621c6ec9ab5f2b6652f3f460bf";
      hash = "sha256-o48Rzriahvv70KytQXDUF9yzF2IcbsmrXytmUvP0YL8=";
      build-system = [ "pdm-backend" ];
      dependencies = [ ];
      imports = [ "partial_json_parser" ];
    };
  };
}
