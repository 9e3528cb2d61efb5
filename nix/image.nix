# The appliance's OCI image: Proxima + vLLM 0.6.3.post1 + torch on CUDA 12.1, nothing else.
#
#   stream = true   dockerTools.streamLayeredImage: `result` is a script that writes the image
#                   to stdout, never storing the multi-GB tarball:  ./result | docker load
#   stream = false  dockerTools.buildLayeredImage: `result` is the image tarball in the store:
#                   docker load < result
#
# Layers hold store paths only (popular paths get their own layer, so an update of Proxima
# re-ships one small layer, not torch). Timestamps are fixed (`created` below and the store's
# epoch mtimes), so the same inputs give the same image digest.
#
# The image has no shell and no package manager: the entrypoint is Proxima's own executable.
# It runs as the unprivileged user `proxima` (uid/gid 1000), declares a health check on
# GET /health (docker/healthcheck.py with the image's Python), carries the C compiler that
# Triton compiles its CUDA launcher with at the first kernel launch (CC, as nixpkgs' own Triton
# GPU test sets it) and the CA certificates (SSL_CERT_FILE).
{
  lib,
  dockerTools,
  cacert,
  cudaPackages,
  python,
  sources,
  nixpkgsRev ? "unknown",
  stream ? true,
}:

let
  env = python.withPackages (ps: [ ps.proxima ]);
  proxima = python.pkgs.proxima;
  inherit (python.pkgs) vllm torch;

  uid = 1000;
  gid = 1000;
  # /etc/passwd and /etc/group with root, nobody and proxima: torch's inductor and triton look
  # the running user up (getpass.getuser()) and fail without an entry.
  nss = dockerTools.fakeNss.override {
    extraPasswdLines = [ "proxima:x:${toString uid}:${toString gid}:proxima:/tmp:/noshell" ];
    extraGroupLines = [ "proxima:x:${toString gid}:" ];
  };
  healthcheck = ../docker/healthcheck.py;
  second = 1000000000; # Docker's health check durations are nanoseconds

  imageConfig = {
    User = "${toString uid}:${toString gid}";
    # `proxima serve` runs the self-check first and exits non-zero before accepting traffic if
    # it fails; arguments of `docker run IMAGE ...` are appended (model path, vLLM options).
    Entrypoint = [
      "${env}/bin/proxima"
      "serve"
    ];
    Cmd = [ ];
    Env = [
      "PATH=${env}/bin"
      "PROXIMA_ALLOCATOR=1"
      # Air-gapped by default: models come from /models, never from a hub.
      "HF_HUB_OFFLINE=1"
      "TRANSFORMERS_OFFLINE=1"
      "HF_HOME=/tmp/huggingface"
      # Caches of triton, torch.compile and vLLM go to the writable /tmp.
      "HOME=/tmp"
      "PYTHONDONTWRITEBYTECODE=1"
      # The NVIDIA driver's user-space libraries (libcuda.so.1, libnvidia-ml.so.1, ...) are not
      # in the image: they must match the host's kernel driver, so the NVIDIA Container Toolkit
      # bind-mounts the host's copies at start (`docker run --gpus all`). It puts them in
      # /usr/lib64, or in /usr/lib/x86_64-linux-gnu when that directory exists in the image.
      # Nix-built binaries do not search those directories (their glibc has no ld.so.cache of
      # the host's layout): CUDA binaries built with autoAddDriverRunpath look in
      # /run/opengl-driver/lib, which the image links to /usr/lib64, and LD_LIBRARY_PATH covers
      # both toolkit locations for everything that dlopen()s the driver (torch, pynvml, triton).
      "LD_LIBRARY_PATH=/usr/lib64:/usr/lib/x86_64-linux-gnu"
      "NVIDIA_VISIBLE_DEVICES=all"
      "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
      # Triton builds a small C launcher per kernel signature at its first launch with $CC.
      "CC=${lib.getExe' cudaPackages.backendStdenv.cc "cc"}"
      "SSL_CERT_FILE=${cacert}/etc/ssl/certs/ca-bundle.crt"
    ];
    # Healthy once `proxima serve`'s self-check (canary included) passed, while the engine
    # lives; the start period covers the self-check and a large model's loading.
    Healthcheck = {
      Test = [
        "CMD"
        "${env}/bin/python"
        "${healthcheck}"
      ];
      Interval = 30 * second;
      Timeout = 10 * second;
      StartPeriod = 1200 * second;
      Retries = 3;
    };
    ExposedPorts = {
      "8000/tcp" = { };
    };
    Volumes = {
      "/models" = { };
    };
    WorkingDir = "/models";
    Labels = {
      "org.opencontainers.image.title" = "proxima";
      "org.opencontainers.image.description" = proxima.meta.description;
      "org.opencontainers.image.version" = proxima.version;
      "org.opencontainers.image.licenses" = "Apache-2.0";
      "org.opencontainers.image.base.name" = "nixpkgs/nixos-24.11@${nixpkgsRev}";
      "ai.proxima.stack" = "card";
      "ai.proxima.cuda.version" = sources.cuda.version;
      "ai.proxima.cuda.capabilities" = lib.concatStringsSep "," sources.cuda.capabilities;
      "ai.proxima.vllm.version" = vllm.version;
      "ai.proxima.torch.version" = torch.version;
      "ai.proxima.python.version" = python.pythonVersion;
    };
  };

  args = {
    name = "proxima";
    tag = "${proxima.version}-cuda${sources.cuda.version}";
    contents = [
      env
      nss
      cacert
    ];
    # A writable /tmp, the model mount point and the driver path that CUDA binaries search.
    extraCommands = ''
      mkdir -p tmp models usr/lib64 run/opengl-driver
      chmod 1777 tmp
      ln -s /usr/lib64 run/opengl-driver/lib
    '';
    config = imageConfig;
    created = "1970-01-01T00:00:01Z";
    maxLayers = 100;
    passthru = {
      inherit imageConfig env;
    };
  };
in
if stream then dockerTools.streamLayeredImage args else dockerTools.buildLayeredImage args
