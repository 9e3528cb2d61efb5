# Every pinned source and version of the appliance, in one place.
#
# The nixpkgs revision itself is pinned in flake.lock (input `nixpkgs`, branch nixos-24.11).
# Everything here is fetched by a fixed-output hash; a hash that does not match fails the build
# loudly, it never silently fetches something else.
{
  # CUDA 12.1: the CUDA that vLLM 0.6.3.post1's PyPI wheels (the card stack) were built for;
  # it needs an NVIDIA driver >= 530.30 on the host. nixos-24.11 is the last nixpkgs release
  # that still carries cudaPackages_12_1.
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
  # 0.6 line that proxima/engines/vllm_v0.py supports. nixos-24.11 ships vLLM 0.6.2; 0.6.3.post1
  # is its bug-fix successor (same V0 block manager interface).
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

  # uvicorn-worker (gunicorn's UvicornWorker, used by `proxima serve`), in case the pinned
  # nixpkgs has no package of it. Pinned by its PyPI sdist (hash computed from the file).
  uvicorn-worker = {
    version = "0.4.0";
    url = "https://files.pythonhosted.org/packages/80/59/9101b9c0680fd80e9d26c07deb822a5d18a324339fcf9cd017885ee808ad/uvicorn_worker-0.4.0.tar.gz";
    sha256 = "8ee5306070d8f38dce124adce488c3c0b50f20cf0c0222b12c66188da7214493";
    hash = "sha256-juUwYHDY843OEkrc5IjDwLUPIM8MAiKxLGYYjachRJM=";
  };
}
