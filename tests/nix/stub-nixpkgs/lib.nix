# The pieces of nixpkgs' lib that Proxima's flake uses, with nixpkgs' semantics.
let
  lib = rec {
    inherit (builtins)
      elem
      filter
      head
      length
      concatStringsSep
      ;
    fix = f: let x = f x; in x;
    all = builtins.all;
    any = builtins.any;
    concatMap = builtins.concatMap;
    concatLists = builtins.concatLists;
    attrNames = builtins.attrNames;
    mapAttrs = builtins.mapAttrs;
    mapAttrsToList = f: attrs: map (name: f name attrs.${name}) (builtins.attrNames attrs);
    genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
    init = list: builtins.genList (builtins.elemAt list) (length list - 1);
    toLower = s: builtins.replaceStrings
      [ "A" "B" "C" "D" "E" "F" "G" "H" "I" "J" "K" "L" "M" "N" "O" "P" "Q" "R" "S" "T" "U" "V" "W" "X" "Y" "Z" ]
      [ "a" "b" "c" "d" "e" "f" "g" "h" "i" "j" "k" "l" "m" "n" "o" "p" "q" "r" "s" "t" "u" "v" "w" "x" "y" "z" ]
      s;
    removeSuffix =
      suffix: str:
      if hasSuffix suffix str then
        builtins.substring 0 (builtins.stringLength str - builtins.stringLength suffix) str
      else
        str;
    # lib.getExe' pkg "cc": <pkg>/bin/cc
    getExe' = pkg: name: "${pkg}/bin/${name}";
    extends = f: rattrs: self: let super = rattrs self; in super // f self super;
    foldl' = builtins.foldl';
    last = list: builtins.elemAt list (length list - 1);
    optional = cond: x: if cond then [ x ] else [ ];
    optionals = cond: xs: if cond then xs else [ ];
    optionalAttrs = cond: as: if cond then as else { };
    optionalString = cond: s: if cond then s else "";
    concatMapStrings = f: list: concatStringsSep "" (map f list);
    concatMapStringsSep = sep: f: list: concatStringsSep sep (map f list);
    hasPrefix = pref: str: builtins.substring 0 (builtins.stringLength pref) str == pref;
    hasSuffix =
      suffix: content:
      let
        lenC = builtins.stringLength content;
        lenS = builtins.stringLength suffix;
      in
      lenC >= lenS && builtins.substring (lenC - lenS) lenC content == suffix;
    removePrefix =
      prefix: str:
      if hasPrefix prefix str then
        builtins.substring (builtins.stringLength prefix) (builtins.stringLength str) str
      else
        str;
    splitString =
      sep: s: builtins.filter builtins.isString (builtins.split (escapeRegex sep) s);
    escapeRegex = s: builtins.replaceStrings [ "." "/" "+" "*" "?" "(" ")" "[" "]" ] [ "\\." "/" "\\+" "\\*" "\\?" "\\(" "\\)" "\\[" "\\]" ] s;
    cmakeFeature =
      feature: value:
      assert builtins.isString feature && builtins.isString value;
      "-D${feature}=${value}";
    cmakeBool = feature: value: "-D${feature}=${if value then "ON" else "OFF"}";
    assertMsg = pred: msg: pred || builtins.throw msg;
    versions.majorMinor =
      v:
      let
        parts = builtins.splitVersion v;
      in
      "${builtins.elemAt parts 0}.${builtins.elemAt parts 1}";
    licenses = {
      asl20 = {
        spdxId = "Apache-2.0";
        free = true;
      };
      unfree = {
        spdxId = "unfree";
        free = false;
      };
    };
  };
in
lib
