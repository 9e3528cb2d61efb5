# What the stub nixpkgs knows of the sources the project builds (nix/sources.nix), as real
# nixpkgs would learn it while building them: the sdist's [build-system] table (pypa/build checks
# it before building) and the wheel's Requires-Dist (pythonRuntimeDepsCheckHook checks it after),
# and for vLLM the repositories its CMakeLists.txt fetches with FetchContent (which a sandboxed
# build cannot). Keyed "<pname>-<version>"; a project package with no entry here fails the
# evaluation, so the stub never passes something it knows nothing about.
#
# Copied from the sdists on PyPI; tests/nix/test_sources.py downloads them and compares every
# entry with the file's PKG-INFO (or egg-info/requires.txt), pyproject.toml and CMakeLists.txt.
# Requirements of extras are left out: the runtime check never looks at them.
{
  "vllm-0.6.3.post1" = {
    buildSystem = ''
      [build-system]
      requires = [
          "cmake>=3.26",
          "ninja",
          "packaging",
          "setuptools>=61",
          "setuptools-scm>=8.0",
          "torch == 2.4.0",
          "wheel",
          "jinja2",
      ]
      build-backend = "setuptools.build_meta"
    '';
    requiresDist = [
      "psutil"
      "sentencepiece"
      "numpy<2.0.0"
      "requests>=2.26.0"
      "tqdm"
      "py-cpuinfo"
      "transformers>=4.45.2"
      "tokenizers>=0.19.1"
      "protobuf"
      "fastapi<0.113.0,>=0.107.0; python_version < \"3.9\""
      "fastapi!=0.113.*,!=0.114.0,>=0.107.0; python_version >= \"3.9\""
      "aiohttp"
      "openai>=1.40.0"
      "uvicorn[standard]"
      "pydantic>=2.9"
      "pillow"
      "prometheus_client>=0.18.0"
      "prometheus-fastapi-instrumentator>=7.0.0"
      "tiktoken>=0.6.0"
      "lm-format-enforcer==0.10.6"
      "outlines<0.1,>=0.0.43"
      "typing_extensions>=4.10"
      "filelock>=3.10.4"
      "partial-json-parser"
      "pyzmq"
      "msgspec"
      "gguf==0.10.0"
      "importlib_metadata"
      "mistral_common[opencv]>=1.4.4"
      "pyyaml"
      "six>=1.16.0; python_version > \"3.11\""
      "setuptools>=74.1.1; python_version > \"3.11\""
      "einops"
      "compressed-tensors==0.6.0"
      "ray>=2.9"
      "nvidia-ml-py"
      "torch==2.4.0"
      "torchvision==0.19"
      "xformers==0.0.27.post2; platform_system == \"Linux\" and platform_machine == \"x86_64\""
    ];
    # FetchContent_Declare name -> the CMake variable that gives it a local source directory.
    fetchContent = {
      cutlass = "FETCHCONTENT_SOURCE_DIR_CUTLASS";
      vllm-flash-attn = "VLLM_FLASH_ATTN_SRC_DIR";
    };
  };

  # The pure-Python wheel (installed as it is: no build system involved).
  "gunicorn-25.1.0" = {
    requiresDist = [ "packaging" ];
  };

  "uvicorn-worker-0.3.0" = {
    buildSystem = ''
      [build-system]
      requires = ["hatchling"]
      build-backend = "hatchling.build"
    '';
    requiresDist = [
      "gunicorn>=20.1.0"
      "uvicorn>=0.15.0"
    ];
  };

  "uvicorn-worker-0.4.0" = {
    buildSystem = ''
      [build-system]
      requires = ["hatchling"]
      build-backend = "hatchling.build"
    '';
    requiresDist = [
      "gunicorn>=21.0.0"
      "uvicorn>=0.36.0"
    ];
  };

  # No [build-system] table: pypa/build falls back to setuptools >= 40.8.0.
  "compressed-tensors-0.6.0" = {
    buildSystem = null;
    requiresDist = [
      "torch>=1.7.0"
      "transformers"
      "pydantic>=2.0"
    ];
  };

  "mistral-common-1.4.4" = {
    buildSystem = ''
      [build-system]
      requires = ["poetry-core"]
      build-backend = "poetry.core.masonry.api"
    '';
    requiresDist = [
      "jsonschema (>=4.21.1,<5.0.0)"
      "numpy (>=1.22,<1.25) ; python_version < \"3.9\""
      "numpy (>=1.25) ; python_version >= \"3.9\""
      "pillow (>=10.3.0,<11.0.0)"
      "pydantic (>=2.6.1,<3.0.0)"
      "requests (>=2.0.0,<3.0.0)"
      "sentencepiece (==0.2.0)"
      "tiktoken (>=0.7.0,<0.8.0)"
      "typing-extensions (>=4.11.0,<5.0.0)"
    ];
  };

  "partial-json-parser-0.2.1.1.post4" = {
    buildSystem = ''
      [build-system]
      requires = [
          "pdm-backend",
      ]
      build-backend = "pdm.backend"
    '';
    requiresDist = [ ];
  };
}
