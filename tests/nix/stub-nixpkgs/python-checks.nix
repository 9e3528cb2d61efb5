# The checks that real nixpkgs' buildPythonPackage makes while it builds, done here while the
# flake is evaluated, for the packages the project builds (not the stub's own):
#
#   postPatch      `substituteInPlace pyproject.toml --replace-fail 'A' 'B'` lines are applied
#                  to the package's pyproject.toml (a missing pattern fails, as it does there);
#   build-system   pypa/build (pypaBuildHook, no isolation) refuses to build when a
#                  [build-system] requirement is not installed in the build environment at a
#                  matching version ("ERROR Missing dependencies");
#   setuptools     setuptools < 77 rejects an SPDX string as project.license (PEP 639);
#   runtime deps   pythonRuntimeDepsCheckHook: every Requires-Dist of the wheel (markers
#                  evaluated, extras ignored, pythonRelaxDeps / pythonRemoveDeps applied) must
#                  be installed among the package's dependencies at a matching version;
#   FetchContent   a source whose CMakeLists.txt fetches a repository (sdists.nix) builds in a
#                  sandbox without network only if cmakeFlags give that repository's source
#                  directory; with cudaSupport, vLLM's CMake also needs the architectures and
#                  the CUDA root that nixpkgs' vLLM expressions pass (else it probes the build
#                  machine's GPUs, of which the sandbox has none, or misses the split toolkit).
#
# Each returns a list of error lines; buildPythonPackage throws when any is not empty.
{ lib, sdists, config }:

let
  inherit (builtins)
    elemAt
    filter
    isList
    length
    match
    split
    ;

  trim =
    s:
    let
      m = match "[[:space:]]*(.*[^[:space:]])[[:space:]]*" s;
    in
    if m == null then "" else elemAt m 0;

  hasInfix = infix: text: builtins.replaceStrings [ infix ] [ "" ] text != text;

  # The marker environment of the image: CPython 3.12 on x86_64 Linux.
  markerEnv = {
    python_version = "3.12";
    python_full_version = "3.12.8";
    platform_system = "Linux";
    platform_machine = "x86_64";
    sys_platform = "linux";
    os_name = "posix";
    implementation_name = "cpython";
    extra = "";
  };

  compare =
    op: a: b:
    let
      c = builtins.compareVersions a b;
    in
    if op == "==" then
      c == 0
    else if op == "!=" then
      c != 0
    else if op == ">=" then
      c >= 0
    else if op == "<=" then
      c <= 0
    else if op == ">" then
      c > 0
    else if op == "<" then
      c < 0
    else
      throw "stub nixpkgs: marker operator ${op}";

  clauseHolds =
    clause:
    let
      m = match "[[:space:]]*([a-z_]+)[[:space:]]*(==|!=|<=|>=|<|>)[[:space:]]*[\"']([^\"']*)[\"'][[:space:]]*" clause;
      key = elemAt m 0;
      op = elemAt m 1;
      want = elemAt m 2;
      have = markerEnv.${key} or (throw "stub nixpkgs: unknown marker variable ${key}");
    in
    if m == null then
      throw "stub nixpkgs: cannot read the marker clause '${clause}'"
    else if lib.elem key [ "python_version" "python_full_version" ] then
      compare op have want
    else if op == "==" then
      have == want
    else if op == "!=" then
      have != want
    else
      throw "stub nixpkgs: marker '${clause}'";
in
rec {
  normalize = name: lib.toLower (builtins.replaceStrings [ "_" "." ] [ "-" "-" ] name);

  markerHolds =
    marker:
    if marker == null || trim marker == "" then
      true
    else if hasInfix " or " marker then
      throw "stub nixpkgs: 'or' in the marker '${marker}' is not supported"
    else
      lib.all clauseHolds (lib.splitString " and " marker);

  # "name[extras] (>=1,<2) ; marker" -> { name, specs = [ { op, version } ], marker }
  parseRequirement =
    req:
    let
      parts = match "([^;]*)(;(.*))?" req;
      body = trim (elemAt parts 0);
      m = match "([A-Za-z0-9_.-]+)[[:space:]]*([[][A-Za-z0-9_,. -]*[]])?[[:space:]]*\\(?([^)]*)\\)?" body;
      specText = elemAt m 2;
      parseSpec =
        s:
        let
          sm = match "(~=|===|==|!=|<=|>=|<|>)[[:space:]]*([^[:space:]]+)" s;
        in
        if sm == null then
          throw "stub nixpkgs: cannot read the version specifier '${s}' of '${req}'"
        else
          {
            op = elemAt sm 0;
            version = elemAt sm 1;
          };
    in
    if m == null then
      throw "stub nixpkgs: cannot read the requirement '${req}'"
    else
      {
        name = normalize (elemAt m 0);
        specs = map parseSpec (filter (s: s != "") (map trim (lib.splitString "," specText)));
        marker = elemAt parts 2;
        text = req;
      };

  specHolds =
    have: spec:
    let
      v = spec.version;
      stripZeros = s: if lib.hasSuffix ".0" s then stripZeros (lib.removeSuffix ".0" s) else s;
      equal = a: b: builtins.compareVersions (stripZeros a) (stripZeros b) == 0;
      wildcard = lib.hasSuffix ".*" v;
      prefix = lib.removeSuffix "*" v;
    in
    if spec.op == "==" || spec.op == "===" then
      (if wildcard then lib.hasPrefix prefix "${have}." else equal have v)
    else if spec.op == "!=" then
      !(if wildcard then lib.hasPrefix prefix "${have}." else equal have v)
    else if spec.op == "~=" then
      builtins.compareVersions have v >= 0
      && lib.hasPrefix (lib.concatStringsSep "." (lib.init (lib.splitString "." v)) + ".") "${have}."
    else
      compare spec.op have v;

  # Every python package reachable through dependencies, as { dist name = version; }.
  installed =
    pkgs:
    let
      start = map (p: {
        key = p.stubKey or p.name or "?";
        pkg = p;
      }) (filter (p: p ? stubDist) pkgs);
      all = builtins.genericClosure {
        startSet = start;
        operator =
          item:
          map (p: {
            key = p.stubKey or p.name or "?";
            pkg = p;
          }) (filter (p: p ? stubDist) (item.pkg.stubDeps or [ ]));
      };
    in
    builtins.listToAttrs (
      map (item: {
        name = item.pkg.stubDist.name;
        value = item.pkg.stubDist.version;
      }) all
    );

  # The `substituteInPlace FILE... --replace(-fail|-warn) 'A' 'B'` lines of a script that touch
  # `file`, as a function from the file's text to the patched text.
  substitute =
    file: script: text:
    let
      lines = lib.splitString "\n" (builtins.replaceStrings [ "\\\n" ] [ " " ] script);
      commands = filter (l: match "[[:space:]]*substituteInPlace[[:space:]].*" l != null) lines;
      parse =
        line:
        let
          rest = elemAt (match "[[:space:]]*substituteInPlace[[:space:]]+(.*)" line) 0;
          files = filter (w: w != "") (lib.splitString " " (elemAt (split "[[:space:]]--" rest) 0));
          found = filter isList (split "--replace(-fail|-warn|-quiet)?[[:space:]]+'([^']*)'[[:space:]]+'([^']*)'" rest);
        in
        {
          inherit files;
          subs = map (f: {
            mode = elemAt f 0;
            from = elemAt f 1;
            to = elemAt f 2;
          }) found;
        };
      relevant = filter (c: lib.elem file c.files) (map parse commands);
      apply =
        acc: sub:
        if !(hasInfix sub.from acc) && sub.mode != "-warn" && sub.mode != "-quiet" then
          throw (
            "postPatch: substituteInPlace ${file} --replace-fail '${sub.from}': pattern not found "
            + "(nixpkgs fails the build here)"
          )
        else
          builtins.replaceStrings [ sub.from ] [ sub.to ] acc;
    in
    builtins.foldl' (acc: c: builtins.foldl' apply acc c.subs) text relevant;

  # -> list of error lines
  checkBuildSystem =
    {
      key,
      pyprojectText,
      buildEnv,
    }:
    let
      parsed = if pyprojectText == null then { } else builtins.fromTOML pyprojectText;
      requires = parsed.build-system.requires or [ "setuptools>=40.8.0" ];
      backend = parsed.build-system.build-backend or "setuptools.build_meta:__legacy__";
      have = installed buildEnv;
      missing = filter (
        r:
        let
          req = parseRequirement r;
        in
        markerHolds req.marker
        && !(have ? ${req.name} && lib.all (specHolds have.${req.name}) req.specs)
      ) requires;
      describe =
        r:
        let
          req = parseRequirement r;
        in
        if have ? ${req.name} then "${r} (the build environment has ${req.name} ${have.${req.name}})" else r;
      setuptools = have.setuptools or null;
      license = parsed.project.license or null;
      licenseError =
        lib.hasPrefix "setuptools.build_meta" backend
        && setuptools != null
        && builtins.compareVersions setuptools "77" < 0
        && builtins.isString license;
    in
    lib.optional (missing != [ ]) (
      "pypa/build of ${key}: ERROR Missing dependencies: ${lib.concatMapStringsSep ", " describe missing}"
    )
    ++ lib.optional licenseError (
      "setuptools ${setuptools} building ${key}: configuration error: `project.license` must be "
      + "valid exactly by one definition (a table { text = ... } or { file = ... }); the SPDX "
      + "string \"${license}\" needs setuptools >= 77"
    );

  # -> list of error lines
  checkRuntimeDeps =
    {
      key,
      requiresDist,
      dependencies,
      relax ? false,
      remove ? [ ],
    }:
    let
      have = installed dependencies;
      relaxed = name: relax == true || (isList relax && lib.elem name (map normalize relax));
      removed = map normalize (if isList remove then remove else [ ]);
      check =
        r:
        let
          req = parseRequirement r;
          specs = if relaxed req.name then [ ] else req.specs;
        in
        if !(markerHolds req.marker) || lib.elem req.name removed then
          [ ]
        else if !(have ? ${req.name}) then
          [ "${req.name} not installed" ]
        else if !(lib.all (specHolds have.${req.name}) specs) then
          [
            "${req.name}${lib.concatMapStringsSep "," (s: s.op + s.version) specs} not satisfied by version ${have.${req.name}}"
          ]
        else
          [ ];
      errors = lib.concatMap check requiresDist;
    in
    lib.optional (errors != [ ]) (
      "pythonRuntimeDepsCheck of ${key}:\n${lib.concatMapStringsSep "\n" (e: "    - ${e}") errors}"
    );

  # -> list of error lines
  checkCmakeFlags =
    {
      key,
      fetchContent,
      cmakeFlags,
      cudaSupport,
      cudaPackages,
    }:
    let
      value =
        name:
        let
          found = filter (f: lib.hasPrefix "-D${name}=" f) cmakeFlags;
        in
        if found == [ ] then null else lib.removePrefix "-D${name}=" (lib.last found);
      fetched = lib.mapAttrsToList (
        repo: var:
        lib.optional (!(lib.hasPrefix "/nix/store/" (toString (value var)))) (
          "${key}: CMake's FetchContent would git-clone ${repo} (no network in the sandbox): "
          + "cmakeFlags must give -D${var}=<pinned source>"
        )
      ) fetchContent;
      caps = cudaPackages.cudaFlags.cudaCapabilities;
      expect = {
        TORCH_CUDA_ARCH_LIST = lib.concatStringsSep ";" caps;
        CUTLASS_NVCC_ARCHS_ENABLED = cudaPackages.cudaFlags.cmakeCudaArchitecturesString;
      };
      arch = lib.mapAttrsToList (
        var: want:
        lib.optional (value var != want) (
          "${key}: cmakeFlags must pass -D${var}=${want} (config.cudaCapabilities), has "
          + "${toString (value var)}: without it CMake probes the build machine's GPUs"
        )
      ) expect;
      root =
        lib.optional
          (!(hasInfix "cuda-merged-${cudaPackages.cudaVersion}" (toString (value "CUDA_TOOLKIT_ROOT_DIR"))))
          "${key}: cmakeFlags must pass -DCUDA_TOOLKIT_ROOT_DIR=<the merged CUDA ${cudaPackages.cudaVersion} libraries>, has ${toString (value "CUDA_TOOLKIT_ROOT_DIR")}";
    in
    lib.concatLists fetched ++ lib.optionals cudaSupport (lib.concatLists arch ++ root);
}
