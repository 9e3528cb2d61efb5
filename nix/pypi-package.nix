# A Python package from its PyPI sdist (or pure-Python wheel), for what the pinned nixpkgs lacks
# or has too old (nix/overlay.nix). `pin` is an entry of `sources.fallbacks` or `sources.newer`
# (nix/sources.nix): version, url, hash, and the nixpkgs attribute names of its build system
# and dependencies.
{
  lib,
  buildPythonPackage,
  fetchurl,
  python,
}:

name: pin:
let
  byName = n: python.pkgs.${n} or (throw "nix/sources.nix fallbacks.${name}: nixpkgs has no python package '${n}'");
in
buildPythonPackage (
  {
    pname = name;
    inherit (pin) version;
    src = fetchurl { inherit (pin) url hash; };
    dependencies = map byName pin.dependencies;
  # Version pins of the package's own metadata, relaxed to the pinned nixpkgs' versions where
  # the pin says so (the runtime dependency check still demands every name).
    pythonRelaxDeps = pin.relaxDeps or false;
    pythonImportsCheck = pin.imports;
    meta.description = "${name} ${pin.version} from PyPI (Proxima's pin for nixos-24.11)";
  }
  # A pure-Python wheel is installed as it is; an sdist is built with its build system.
  // (
    if (pin.format or "sdist") == "wheel" then
      { format = "wheel"; }
    else
      {
        pyproject = true;
        build-system = map byName pin.build-system;
      }
  )
)
