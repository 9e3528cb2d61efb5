# gunicorn's UvicornWorker as its own package (uvicorn >= 0.30 moved it out of uvicorn).
# Used only when the pinned nixpkgs has no `uvicorn-worker` (see nix/overlay.nix).
{
  buildPythonPackage,
  fetchurl,
  hatchling,
  gunicorn,
  uvicorn,
  sources,
}:

buildPythonPackage {
  pname = "uvicorn-worker";
  inherit (sources.uvicorn-worker) version;
  pyproject = true;
  src = fetchurl {
    inherit (sources.uvicorn-worker) url hash;
  };
  build-system = [ hatchling ];
  dependencies = [
    gunicorn
    uvicorn
  ];
  pythonImportsCheck = [ "uvicorn_worker" ];
}
