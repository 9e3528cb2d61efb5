# A stand-in for nixpkgs, owned by the tests: just enough of nixos-24.11's interface for
# Proxima's flake to evaluate (`nix flake check --no-build --override-input nixpkgs path:...`)
# on a machine that cannot fetch or evaluate the real nixpkgs. It checks what it can of the
# real interface (argument names, hash formats, OCI config keys) and builds nothing real.
{
  description = "stub nixpkgs for Proxima's flake tests";
  outputs =
    { self }:
    {
      lib = import ./lib.nix;
      legacyPackages.x86_64-linux = import ./. { system = "x86_64-linux"; };
    };
}
