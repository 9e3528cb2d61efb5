"""Every subcommand over a table of bad input, run as a user runs it: `python -m proxima.cli`
in a fresh process. For each row: the exit status, no traceback, one error line that holds
the row's message, nothing on stdout (no work was done: no table), and nothing written
where the row says so.

The first rows are issue 15's table; the rest were found by trying things. A subcommand
added later (e.g. ``kv``) is covered by the generic rows at the end (an unknown flag).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxima.cli import SUBCOMMANDS
from tests.bench.conftest import FakeOpenAIServer, ServerConfig

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "proxima" / "models" / "tiny-llama")


def has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


@dataclass
class Row:
    id: str
    argv: list[str]                 # "{tmp}", "{url:NAME}", "{closed}" are filled in
    message: list[str]              # fragments of the one error line
    code: int = 2
    absent: list[str] = field(default_factory=list)   # paths that must not exist after
    skip: str | None = None         # reason to skip here (e.g. a GPU is present)
    env: dict = field(default_factory=dict)
    xfail: str | None = None


NO_GPU = "a GPU is present: the command would run" if has_gpu() else None


def _vllm_minor() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("vllm").split(".")[:2]
    return int(major), int(minor)


# vLLM 0.33's serve parser is built only with a GPU platform: without one, serve's GPU
# refusal (one line, exit 2) comes before a model's options are checked
PARSER_NEEDS_GPU = ("vLLM 0.33 checks serve options only on a GPU machine" if _vllm_minor() >= (0, 33)
                    else None)
NO_GPU_PARSER = NO_GPU or PARSER_NEEDS_GPU

ROWS = [
    # ---- issue 15's table ------------------------------------------------------------
    Row("bench-offline-no-gpu", ["bench", "--offline", "--model", TINY, "--load-format", "dummy",
                                 "--requests", "4"],
        ["--offline runs vLLM's engine on a GPU and vLLM finds none", "--base-url"],
        skip=NO_GPU),
    Row("replay-compaction-env-without-elastic", ["replay", "--requests", "4"],
        ["PROXIMA_COMPACTION needs PROXIMA_ELASTIC=1"], env={"PROXIMA_COMPACTION": "1"}),
    Row("replay-elastic-env-without-allocator", ["replay", "--requests", "4"],
        ["PROXIMA_ELASTIC=1 needs PROXIMA_ALLOCATOR=1"], env={"PROXIMA_ELASTIC": "1"}),
    Row("replay-stats-file-in-proc", ["replay", "--requests", "4"],   # a traceback, at the end
        ["PROXIMA_STATS_FILE", "'/proc' does not exist or is not writable"],
        env={"PROXIMA_STATS_FILE": "/proc/stats.json"}),
    Row("replay-allow-unproven-env-bad", ["replay", "--requests", "4"],
        ["PROXIMA_ALLOW_UNPROVEN_ELASTIC must be 1", "got 'yes'"],
        env={"PROXIMA_ALLOW_UNPROVEN_ELASTIC": "yes"}),
    Row("replay-json-dir", ["replay", "--json", "{tmp}/outdir"],
        ["--json {tmp}/outdir is a directory: give a file name"]),
    Row("replay-json-proc", ["replay", "--json", "/proc/x.json"],
        ["--json /proc/x.json: cannot create a file in /proc", "writable directory"],
        absent=["/proc/x.json"]),
    Row("replay-plot-txt", ["replay", "--plot", "{tmp}/x.txt"],
        ["--plot {tmp}/x.txt: the file name must end in .png"], absent=["{tmp}/x.txt"]),
    Row("bench-plot-txt", ["bench", "--base-url", "{url:good}", "--plot", "{tmp}/x.txt"],
        ["--plot {tmp}/x.txt: the file name must end in .png"], absent=["{tmp}/x.txt"]),
    Row("replay-plot-dir-slash", ["replay", "--plot", "{tmp}/outdir/"],
        ["--plot {tmp}/outdir/ is a directory: give a file name"], absent=["{tmp}/outdir/.png"]),
    Row("bundle-bad-image", ["bundle", "--out", "{tmp}/bundle1", "--image", "{tmp}/notimg.txt"],
        ["--image {tmp}/notimg.txt: neither a docker-archive image"], absent=["{tmp}/bundle1"]),
    Row("bundle-bad-extra", ["bundle", "--out", "{tmp}/bundle2", "--extra", "nosuch"],
        ["--extra nosuch: not an extra of proxima"], absent=["{tmp}/bundle2"]),
    Row("replay-requests-huge", ["replay", "--requests", "1000000000"],
        ["--requests 1,000,000,000 is above the bound of 100,000"]),
    Row("replay-num-blocks-huge", ["replay", "--num-blocks", "100000000"],
        ["--num-blocks 100,000,000 is above the bound of 4,194,304"]),
    Row("replay-trace-binary", ["replay", "--trace", "{tmp}/binary.jsonl"],
        ["{tmp}/binary.jsonl:1: not UTF-8 text", "JSON Lines"]),
    Row("replay-trace-misspelt-key", ["replay", "--trace", "{tmp}/misspelt.jsonl"],
        ["{tmp}/misspelt.jsonl:2: unknown key 'promt_len': did you mean 'prompt_len'?"]),
    Row("bench-models-data-5", ["bench", "--base-url", "{url:data5}", "--requests", "2"],
        ['answered GET /v1/models with {"data": 5}', "not an OpenAI model list"]),
    Row("serve-no-such-flag", ["serve", "--no-such-flag"],
        ["unrecognized arguments: --no-such-flag", "vllm serve --help"]),
    Row("serve-misspelt-proxima-flag", ["serve", "--models-file", "m.toml"],
        ["unrecognized arguments: --models-file; did you mean --models?"]),
    Row("serve-misspelt-vllm-flag", ["serve", "--max-modle-len", "64"],
        ["unrecognized arguments: --max-modle-len; did you mean --max-model-len?"]),
    # ---- found by trying things ------------------------------------------------------
    Row("replay-trace-misspelt-optional-key", ["replay", "--trace", "{tmp}/arival.jsonl"],
        ["unknown key 'arival_step': did you mean 'arrival_step'?"]),
    Row("replay-trace-unknown-key", ["replay", "--trace", "{tmp}/unknown.jsonl"],
        ["unknown key 'temperature': the keys are prompt_len, output_len"]),
    Row("replay-trace-nul", ["replay", "--trace", "{tmp}/nul.jsonl"], ["holds a NUL byte"]),
    Row("replay-trace-bom", ["replay", "--trace", "{tmp}/bom.jsonl"],   # was: "not JSON
        ["{tmp}/bom.jsonl:2: missing 'output_len'"]),                   # (Unexpected UTF-8 BOM"
    Row("replay-trace-key-twice", ["replay", "--trace", "{tmp}/twice.jsonl"],  # used the last
        ["{tmp}/twice.jsonl:2: key 'prompt_len' is given twice: a trace line looks like"]),
    Row("bench-trace-key-twice", ["bench", "--base-url", "{url:good}", "--trace",
                                  "{tmp}/twice.jsonl"], ["key 'prompt_len' is given twice"]),
    Row("replay-trace-dir", ["replay", "--trace", "{tmp}/outdir"],
        ["cannot read trace {tmp}/outdir: it is a directory"]),
    Row("replay-trace-missing", ["replay", "--trace", "{tmp}/missing.jsonl"],
        ["cannot read trace {tmp}/missing.jsonl: No such file or directory"]),
    Row("replay-trace-empty", ["replay", "--trace", "{tmp}/empty.jsonl"], ["holds no requests"]),
    Row("replay-trace-not-json", ["replay", "--trace", "{tmp}/notjson.jsonl"],
        ["{tmp}/notjson.jsonl:1: not JSON"]),
    Row("replay-trace-float", ["replay", "--trace", "{tmp}/float.jsonl"],
        ["prompt_len must be an integer >= 1, got 1.5"]),
    Row("replay-trace-bool", ["replay", "--trace", "{tmp}/bool.jsonl"],     # "got True"
        ["{tmp}/bool.jsonl:1: output_len must be an integer >= 1, got true"]),
    Row("replay-trace-string-number", ["replay", "--trace", "{tmp}/strnum.jsonl"],
        ['prompt_len must be an integer >= 1, got "10"']),                  # "got '10'"
    Row("replay-trace-too-long", ["replay", "--trace", "{tmp}/long.jsonl"],
        ["prompt_len + output_len = 9000 exceeds the model length 8192"]),
    Row("replay-json-dev-null", ["replay", "--json", "/dev/null"],
        ["--json /dev/null exists and is not a regular file"]),
    Row("replay-json-no-dir", ["replay", "--json", "{tmp}/nodir/r.json"],
        ["directory {tmp}/nodir does not exist"]),
    Row("replay-json-empty", ["replay", "--json", ""], ["--json needs a file name"]),
    Row("replay-json-dash", ["replay", "--json", "-"],             # wrote a file named '-'
        ["--json - would write a file named '-' (--json writes a file; the table is on stdout)"],
        absent=["{tmp}/-"]),
    Row("bench-plot-dash", ["bench", "--base-url", "{url:good}", "--plot", "-"],
        ["--plot - would write a file named '-'", "e.g. result.png"], absent=["{tmp}/-"]),
    Row("bench-json-missing-dir-slash", ["bench", "--base-url", "{url:good}", "--json",
                                         "{tmp}/nodir/"],      # said "is a directory"
        ["--json {tmp}/nodir/ ends in / (a directory's name): give a file name"]),
    Row("replay-json-over-trace", ["replay", "--trace", "{tmp}/good.jsonl", "--json",
                                   "{tmp}/good.jsonl"], ["would overwrite the trace"]),
    Row("replay-max-model-len", ["replay", "--max-model-len", "200000"],
        ["--max-model-len 200,000 is above the bound of 131,072"]),
    Row("replay-batched-below-seqs", ["replay", "--max-num-batched-tokens", "100"],
        ["--max-num-batched-tokens (100) must be >= --max-num-seqs (1024)"]),
    Row("replay-block-size", ["replay", "--block-size", "3"], ["power of two"]),
    Row("replay-repeat-0", ["replay", "--repeat", "0"], ["--repeat must be from 1 to 1,000, got 0"]),
    Row("replay-requests-not-int", ["replay", "--requests", "abc"], ["invalid int value: 'abc'"]),
    Row("replay-pool-too-small", ["replay", "--workload", "pressure", "--num-blocks", "20"],
        ["raise --num-blocks"]),
    Row("bench-json-proc", ["bench", "--base-url", "{url:good}", "--json", "/proc/x.json"],
        ["cannot create a file in /proc"]),
    Row("bench-json-dir", ["bench", "--base-url", "{url:good}", "--json", "{tmp}/outdir"],
        ["is a directory"]),
    Row("bench-models-list", ["bench", "--base-url", "{url:list}"],
        ["answered GET /v1/models with []", "not an OpenAI model list"]),
    Row("bench-models-not-json", ["bench", "--base-url", "{url:html}"],
        ["sent a /v1/models answer that is not JSON"]),
    Row("bench-models-empty-no-model", ["bench", "--base-url", "{url:empty}"],
        ["serves no model", "pass --model"]),
    Row("bench-wrong-model", ["bench", "--base-url", "{url:good}", "--model", "gpt"],
        ["does not serve model 'gpt'; it serves: tiny"]),
    Row("bench-unreachable", ["bench", "--base-url", "{closed}"],
        ["cannot reach server A", "check --base-url"]),
    Row("bench-vllm-dataset", ["bench", "--base-url", "{url:good}", "--dataset-name", "random"],
        ["--dataset-name random: proxima bench does not build vLLM's 'random' dataset"]),
    Row("bench-unknown-dataset", ["bench", "--base-url", "{url:good}", "--dataset-name", "x"],
        ["--dataset-name 'x' is not a workload"]),
    Row("bench-result-filename-alone", ["bench", "--base-url", "{url:good}",
                                        "--result-filename", "{tmp}/r.json"],
        ["only apply with --save-result"]),
    Row("bench-save-result-and-json", ["bench", "--base-url", "{url:good}", "--save-result",
                                       "--json", "{tmp}/r.json"], ["not both"]),
    Row("bench-endpoint-path", ["bench", "--base-url", "{url:good}", "--endpoint",
                                "/v1/embeddings"], ["--endpoint must be completions or chat"]),
    Row("bench-rate-nan", ["bench", "--base-url", "{url:good}", "--request-rate", "nan"],
        ["--request-rate must be above 0 and at most 1,000,000 requests/s", "got nan"]),
    Row("bench-timeout-inf", ["bench", "--base-url", "{url:good}", "--timeout", "inf"],
        ["--timeout must be from 0.01 to 86,400 seconds (a day), got inf"]),
    # ---- absurd values that ran (for ever): refused before any load, with the bounds ------
    Row("bench-rate-1e-9", ["bench", "--base-url", "{url:good}", "--request-rate", "1e-9",
                            "--requests", "2"],                  # waited 2e9 s for a request
        ["--request-rate 1e-09 spreads 2 requests over about 2,000,000,000 s",
         "above the bound of 86,400 s (a day): give --request-rate 2.32e-05 or more"]),
    Row("bench-rate-huge", ["bench", "--base-url", "{url:good}", "--request-rate", "1e300"],
        ["--request-rate must be above 0 and at most 1,000,000 requests/s", "got 1e+300"]),
    Row("bench-repeat-huge", ["bench", "--base-url", "{url:good}", "--repeat", "1000000000",
                              "--requests", "2"],                # ran round after round
        ["--repeat must be from 1 to 1,000, got 1000000000"]),
    Row("bench-timeout-1e300", ["bench", "--base-url", "{url:good}", "--timeout", "1e300"],
        ["--timeout must be from 0.01 to 86,400 seconds (a day), got 1e+300"]),
    Row("bench-timeout-tiny", ["bench", "--base-url", "{url:good}", "--timeout", "1e-9"],
        ["--timeout must be from 0.01 to 86,400 seconds", "got 1e-09"]),  # every request failed
    Row("bench-concurrency-huge", ["bench", "--base-url", "{url:good}", "--concurrency",
                                   "1000000000"],
        ["--concurrency must be from 1 to 100,000 (requests in flight), got 1000000000"]),
    Row("bench-offline-repeat-huge", ["bench", "--offline", "--model", TINY, "--repeat",
                                      "1001"], ["--repeat must be from 1 to 1,000, got 1001"]),
    # vLLM checks the load format in its worker, once the engine is up (a traceback there)
    Row("bench-offline-load-format-bogus", ["bench", "--offline", "--model", TINY,
                                            "--load-format", "bogus"],
        ["--load-format 'bogus' is not a load format of this vLLM: give one of", "dummy"]),
    Row("bench-offline-load-format-empty", ["bench", "--offline", "--model", TINY,
                                            "--load-format", ""],
        ["--load-format '' is not a load format of this vLLM"]),
    Row("bench-offline-seed-negative", ["bench", "--offline", "--model", TINY, "--seed", "-1"],
        ["--seed must be from 0 to 4,294,967,295 with --offline (vLLM seeds numpy with it), "
         "got -1"]),                              # failed in each engine's worker: np.random.seed
    Row("bench-offline-seed-2-32", ["bench", "--offline", "--model", TINY, "--seed",
                                    str(2**32)], ["--seed must be from 0 to 4,294,967,295"]),
    Row("replay-repeat-huge", ["replay", "--repeat", "1000000000"],
        ["--repeat must be from 1 to 1,000, got 1000000000"]),
    Row("bench-trace-binary", ["bench", "--base-url", "{url:good}", "--trace",
                               "{tmp}/binary.jsonl"], ["not UTF-8 text"]),
    Row("bench-requests-huge", ["bench", "--base-url", "{url:good}", "--num-prompts",
                                "1000000000"], ["is above the bound of 100,000"]),
    Row("bench-bad-url", ["bench", "--base-url", "localhost:8000"],
        ["--base-url must look like http://HOST:PORT"]),
    Row("bench-url-ipv6-unclosed", ["bench", "--base-url", "http://[::1"],     # a traceback
        ["--base-url must look like http://HOST:PORT (an OpenAI-compatible server",
         "'http://[::1' (Invalid IPv6 URL)"]),
    Row("bench-url-query", ["bench", "--base-url", "{url:good}/?x=1"],      # "HTTP 404"
        ["drop the query or fragment"]),
    Row("bench-url-port-range", ["bench", "--base-url", "http://127.0.0.1:99999"],
        ["(Port out of range 0-65535)"]),                    # "cannot reach server A"
    Row("bench-url-space", ["bench", "--base-url", "http://a b:1"],
        ["holds a space or a control character"]),
    Row("bench-labels", ["bench", "--base-url", "{url:good}", "--label", "a", "--label", "b"],
        ["got 2 --label for 1 --base-url"]),
    Row("bench-label-empty", ["bench", "--base-url", "{url:good}", "--label", ""],
        ["--label needs a name, got ''"]),                 # ran with a blank column heading
    Row("bench-label-newline", ["bench", "--base-url", "{url:good}", "--label", "a\nb"],
        ["--label 'a\\nb': give a name of at most 40 printable characters"]),  # split the table
    Row("bench-label-long", ["bench", "--base-url", "{url:good}", "--label", "x" * 300],
        ["--label '" + "x" * 40 + "'...: give a name of at most 40"]),  # a 300-wide column
    Row("bench-result-filename-empty", ["bench", "--base-url", "{url:good}", "--save-result",
                                        "--result-filename", ""],
        ["--result-filename needs a name, got ''"]),       # wrote the default name instead
    Row("bench-result-dir-empty", ["bench", "--base-url", "{url:good}", "--save-result",
                                   "--result-dir", " "], ["--result-dir needs a name, got ' '"]),
    Row("bench-no-server", ["bench"], ["give --base-url URL"]),
    Row("bench-offline-no-model", ["bench", "--offline"], ["--offline needs --model DIR"]),
    Row("bench-offline-missing-model", ["bench", "--offline", "--model", "{tmp}/nomodel"],
        ["no such directory"]),
    Row("bench-offline-online-flag", ["bench", "--offline", "--model", TINY, "--base-url",
                                      "http://x:1"], ["--base-url does not apply with --offline"]),
    Row("bench-offline-plot-txt", ["bench", "--offline", "--model", TINY, "--plot",
                                   "{tmp}/x.txt"], ["must end in .png"]),
    Row("serve-bad-value-no-gpu", ["serve", "--max-model-len", "abc"],
        ["argument --max-model-len: invalid", "'abc'"], skip=NO_GPU),
    Row("serve-port", ["serve", "--port", "70000"], ["out of range"]),
    Row("serve-compaction-env-without-elastic", ["serve", TINY],
        ["PROXIMA_COMPACTION needs PROXIMA_ELASTIC=1"], env={"PROXIMA_COMPACTION": "1"}),
    Row("serve-block-size", ["serve", "--block-size", "17"], ["--block-size 17 is not supported"]),
    Row("serve-missing-model", ["serve", "{tmp}/nomodel"], ["does not exist"]),
    # an empty model went on to the GPU pre-flight, then to vLLM as the model ''
    Row("serve-empty-model", ["serve", ""], ["the model is empty (''): give a model directory"]),
    # not a path here, nor a Hugging Face id: went on to the GPU pre-flight, then to the Hub
    Row("serve-model-neither-path-nor-id", ["serve", "--model", "a b=/x"],
        ["model 'a b=/x' is neither a path here (none exists) nor a Hugging Face model id"]),
    Row("serve-model-missing-relative-dir", ["serve", "models/llama/8b"],
        ["model 'models/llama/8b' is neither a path here"]),
    Row("selfcheck-model-not-an-id", ["selfcheck", "--model", "org/name:latest"],
        ["model 'org/name:latest' is neither a path here"]),
    Row("serve-empty-model-option", ["serve", "--model", " "], ["the model is empty (' ')"]),
    Row("selfcheck-empty-model", ["selfcheck", "--model", ""], ["the model is empty ('')"]),
    Row("selfcheck-url-empty-model", ["selfcheck", "--url", "{closed}", "--model", ""],
        ["--no-engine and --model do not apply with it"]),
    Row("selfcheck-url-not-url", ["selfcheck", "--url", "notaurl"],
        ["--url must look like http://HOST:PORT", "'notaurl'"]),
    Row("selfcheck-url-closed", ["selfcheck", "--url", "{closed}"], ["cannot reach"]),
    Row("selfcheck-missing-model", ["selfcheck", "--model", "{tmp}/nomodel"], ["does not exist"]),
    Row("selfcheck-model-no-engine", ["selfcheck", "--no-engine", "--model", TINY],
        ["drop one of them"]),
    Row("bundle-no-out", ["bundle"], ["--out DIR is required"]),
    Row("bundle-verify-missing", ["bundle", "--verify", "{tmp}/nobundle"], ["no SHA256SUMS"]),
    Row("bundle-python-2", ["bundle", "--out", "{tmp}/b4", "--python-version", "2.7"],
        ["--python-version 2.7: proxima needs Python >= 3.10"], absent=["{tmp}/b4"]),  # "give X.Y"
    Row("bundle-python-3-5", ["bundle", "--out", "{tmp}/b4", "--python-version", "3.5"],
        ["--python-version 3.5: proxima needs Python >= 3.10 (its requires-python)"],
        absent=["{tmp}/b4"]),                                # went on to pip for Python 3.5
    Row("bundle-out-empty", ["bundle", "--out", ""],              # was: --out {cwd} exists
        ["argument --out: needs a directory name, got ''"]),
    Row("bundle-verify-empty", ["bundle", "--verify", ""],        # was: checked the cwd
        ["argument --verify: needs a directory name, got ''"]),
    Row("bundle-verify-and-out", ["bundle", "--verify", "{tmp}/nobundle", "--out",
                                  "{tmp}/b3", "--tar"],           # --out was ignored
        ["--verify DIR checks a bundle and writes nothing: --out, --tar do not apply with it"],
        absent=["{tmp}/b3"]),
    # an empty name was read as '.': "--model .: no config.json in it", "--wheel .: not a ..."
    Row("bundle-model-empty", ["bundle", "--out", "{tmp}/b5", "--model", ""],
        ["argument --model: needs a directory name, got ''"], absent=["{tmp}/b5"]),
    Row("bundle-wheel-empty", ["bundle", "--out", "{tmp}/b5", "--wheel", " "],
        ["argument --wheel: needs a file name, got ' '"], absent=["{tmp}/b5"]),
    Row("bundle-image-empty", ["bundle", "--out", "{tmp}/b5", "--image", ""],
        ["argument --image: needs a file name, got ''"], absent=["{tmp}/b5"]),
    Row("bundle-nix-closure-empty", ["bundle", "--out", "{tmp}/b5", "--nix-closure", ""],
        ["argument --nix-closure: needs a store path", "got ''"], absent=["{tmp}/b5"]),
    Row("bundle-platform-empty", ["bundle", "--out", "{tmp}/b5", "--platform", ""],
        ["--platform '': not a wheel platform tag"], absent=["{tmp}/b5"]),   # "--platform : "
    Row("bundle-python-99", ["bundle", "--out", "{tmp}/b5", "--python-version", "99.99"],
        ["--python-version 99.99: there is no Python 99.x to build for: give 3.Y"],
        absent=["{tmp}/b5"]),                                # wrote a bundle "for Python 99.99"
    Row("bundle-out-in-proc", ["bundle", "--out", "/proc/proxima-bundle"],   # a traceback
        ["--out /proc/proxima-bundle: cannot create a directory in /proc"],
        absent=["/proc/proxima-bundle"]),
    Row("bundle-out-under-a-file", ["bundle", "--out", "{tmp}/good.jsonl/b"],
        ["--out {tmp}/good.jsonl/b: {tmp}/good.jsonl is not a directory"]),
    Row("bundle-tar-exists", ["bundle", "--out", "{tmp}/b6", "--tar"],   # it was replaced
        ["--tar: {tmp}/b6.tar exists; choose a new --out"], absent=["{tmp}/b6"]),
    Row("bundle-tar-is-a-directory", ["bundle", "--out", "{tmp}/b7", "--tar"],
        ["--tar: {tmp}/b7.tar exists"], absent=["{tmp}/b7"]),   # a traceback, once written
    Row("unknown-command", ["nosuch"], ["invalid choice: 'nosuch'"]),
    # ---- elastic KV memory (issue 13) -----------------------------------------------------
    Row("kv-empty-url", ["kv", "--url", ""], ["give --url URL"]),
    Row("kv-min-without-url", ["kv", "--min", "1GiB"],
        ["--min/--max set one engine's bounds: give its --url"]),
    Row("kv-watch-zero", ["kv", "--watch", "0"], ["--watch: '0' is out of range"]),
    Row("kv-watch-set", ["kv", "--url", "{closed}", "--watch", "--max", "1GiB"],
        ["--watch shows the status again and again: it cannot set --min/--max"]),
    Row("kv-ledger-dir-missing", ["kv", "--ledger-dir", "{tmp}/nowhere"],
        ["--ledger-dir", "is not a directory"]),
    Row("kv-ledger-dir-env-missing", ["kv"],         # was: "no Proxima engine is running"
        ["PROXIMA_LEDGER_DIR '/nonexistent/proxima-ledgers' is not a directory"],
        env={"PROXIMA_LEDGER_DIR": "/nonexistent/proxima-ledgers"}),
    Row("kv-bad-url", ["kv", "--url", "notaurl"], ["--url must look like http://HOST:PORT"]),
    Row("kv-bad-size", ["kv", "--url", "{closed}", "--max", "lots"], ["--max: 'lots' is not a size"]),
    Row("kv-max-below-min", ["kv", "--url", "{closed}", "--min", "8GiB", "--max", "1GiB"],
        ["--max 1GiB is below --min 8GiB"]),
    Row("kv-closed", ["kv", "--url", "{closed}"], ["cannot reach", "is proxima serve running"]),
    Row("replay-kv-max-no-elastic", ["replay", "--kv-max", "8GiB"], ["--kv-max needs --elastic"]),
    Row("replay-elastic-bad-eviction", ["replay", "--elastic", "--eviction", "fifo"],
        ["--eviction: eviction policy 'fifo'"]),
    Row("replay-elastic-bad-size", ["replay", "--elastic", "--kv-min", "much"],
        ["--kv-min: 'much' is not a size"]),
    Row("replay-granule-blocks", ["replay", "--granule-blocks", "0"],
        ["--granule-blocks must be >= 1, got 0"]),
    Row("bench-elastic-options-alone", ["bench", "--offline", "--model", TINY,
                                        "--elastic-options", "min_bytes=1GiB"],
        ["--elastic-options needs --elastic"]),
    Row("bench-elastic-bad-option", ["bench", "--offline", "--model", TINY, "--elastic",
                                     "--elastic-options", "speed=9"], ["unknown option(s) speed"]),
    Row("serve-elastic-bad-size", ["serve", "--elastic", "--kv-max", "lots"],
        ["--kv-max: 'lots' is not a size"]),
    Row("serve-kv-max-below-kv-min", ["serve", "--elastic", "--kv-min", "8GiB", "--kv-max",
                                      "4GiB"],             # named max_bytes and min_bytes
        ["--kv-max 4GiB is below --kv-min 8GiB"]),
    Row("serve-models-kv-max-below-kv-min", ["serve", "--model",
                                             f"a={TINY} --kv-min 8GiB --kv-max 4GiB"],
        ["model 'a': --kv-max 4GiB is below --kv-min 8GiB"]),
    Row("serve-kv-min-and-elastic-options-min", ["serve", "--elastic", "--elastic-options",
                                                 "min_bytes=1GiB", "--kv-min", "2GiB"],
        ["--kv-min 2GiB and --elastic-options' min_bytes both set min_bytes: give one"]),
    Row("serve-idle-release-and-elastic-options", ["serve", "--elastic", "--elastic-options",
                                                   "idle_release_s=5", "--idle-release", "9"],
        ["--idle-release 9 and --elastic-options' idle_release_s both set"]),  # 9 won
    # ---- issue 36: sizing and fit, before the GPU is probed ------------------------------
    Row("serve-gpu-bytes-without-elastic", ["serve", TINY, "--gpu-memory-bytes", "80GiB"],
        ["--gpu-memory-bytes sizes elastic engines: add --elastic"]),
    Row("serve-gpu-bytes-bad", ["serve", TINY, "--elastic", "--gpu-memory-bytes", "80G"],
        ["--gpu-memory-bytes: '80G' is not a size: the unit 'G' is ambiguous"]),
    Row("serve-model-does-not-fit", ["serve", TINY, "--elastic", "--gpu-memory-bytes", "1GiB"],
        ["does not fit on the GPU even at its minimum", "= 2.50 GiB > the GPU's 1.00 GiB"]),
    Row("serve-models-do-not-fit", ["serve", "--model", f"a={TINY}", "--model",
                                    f"b={TINY} --kv-min 1GiB", "--gpu-memory-bytes", "4GiB"],
        ["the models do not fit on one GPU even at their minimums: a 2.50 GiB + b 3.00 GiB = "
         "5.51 GiB > --gpu-memory-bytes's 4.00 GiB"]),
    Row("serve-idle-release-bad", ["serve", TINY, "--elastic", "--idle-release", "-5"],
        ["--idle-release: '-5' is out of range"]),
    Row("serve-models-idle-release-bad", ["serve", "--model", f"b={TINY} --idle-release soon"],
        ["model 'b': --idle-release: 'soon' is not a number"]),
    # ---- issue 37: proxima kv, selfcheck, serve ---------------------------------------------
    # The server's fault is exit 1, the user's exit 2; either way one line on stderr and
    # nothing on stdout ({url:answers}/NAME is a server whose GET/POST NAME/proxima/kv and
    # NAME/proxima/selfcheck answer as ANSWERS[NAME] says).
    Row("kv-answer-list", ["kv", "--url", "{url:answers}/list"],
        ["the server's answer is not an elastic KV status: it is a list [], not a JSON object"],
        code=1),
    Row("kv-answer-list-json", ["kv", "--url", "{url:answers}/list", "--json"],
        ["not an elastic KV status: it is a list []"], code=1),
    Row("kv-answer-null", ["kv", "--url", "{url:answers}/null"], ["it is null"], code=1),
    Row("kv-answer-wrong-type", ["kv", "--url", "{url:answers}/wrongtype", "--json"],
        ['mapped_bytes is a string "lots" (expected a number of bytes'], code=1),
    Row("kv-answer-bool-count", ["kv", "--url", "{url:answers}/boolcount"],
        ["grows is a boolean true (expected an integer"], code=1),
    Row("kv-answer-missing-field", ["kv", "--url", "{url:answers}/empty"],
        ["policy is missing (expected a string): is this proxima serve --elastic?"], code=1),
    Row("kv-500-html", ["kv", "--url", "{url:answers}/html500"],
        ["/html500/proxima/kv answered 500 Internal Server Error: ", "Oops, the worker died"],
        code=1),
    Row("kv-not-json", ["kv", "--url", "{url:answers}/text"],
        ["answered 200 OK with a body that is not JSON (text/plain: 'hello')"], code=1),
    Row("kv-huge-body", ["kv", "--url", "{url:answers}/huge"],
        ["with a body over 1,048,576 bytes (read no further)"], code=1),
    Row("kv-redirect", ["kv", "--url", "{url:answers}/redirect"],
        ["answered 302 Found, a redirect to https://elsewhere.example/, which is not followed"],
        code=1),
    Row("kv-404", ["kv", "--url", "{url:answers}/nosuch"],
        ["answered 404 Not Found: not found (is this proxima serve with --elastic?"], code=1),
    Row("kv-openai-error", ["kv", "--url", "{url:answers}/openai", "--max", "1GiB"],
        ["answered 400 Bad Request: max_bytes 1073741824 is below min_bytes"], code=1),
    Row("kv-no-scheme", ["kv", "--url", "127.0.0.1:8000"],
        ["got '127.0.0.1:8000': add the scheme, http://127.0.0.1:8000"]),
    Row("kv-url-ipv6-unclosed", ["kv", "--url", "http://[::1"], ["(Invalid IPv6 URL)"]),
    Row("kv-url-port-not-number", ["kv", "--url", "http://localhost:port"],
        ["got 'http://localhost:port' (Port could not be cast to integer"]),
    Row("kv-url-query", ["kv", "--url", "http://127.0.0.1:8000/?x=1"],
        ["drop the query or fragment"]),
    Row("kv-timeout-inf", ["kv", "--url", "{closed}", "--timeout", "inf"],
        ["--timeout must be a number of seconds > 0, got inf"]),
    Row("kv-timeout-negative-ledgers", ["kv", "--timeout", "-1"],   # was: the table, exit 0
        ["--timeout must be a number of seconds > 0, got -1"]),
    Row("kv-timeout-huge", ["kv", "--url", "{closed}", "--timeout", "1e12"],
        ["--timeout 1e+12 is above the bound of 3600 seconds"]),
    Row("selfcheck-url-ipv6-unclosed", ["selfcheck", "--url", "http://[::1"],
        ["--url must look like http://HOST:PORT", "'http://[::1' (Invalid IPv6 URL)"]),
    Row("selfcheck-url-port-range", ["selfcheck", "--url", "http://127.0.0.1:99999"],
        ["(Port out of range 0-65535)"]),
    Row("selfcheck-url-no-host", ["selfcheck", "--url", "http:///x"], ["it has no host"]),
    Row("selfcheck-url-empty", ["selfcheck", "--url", ""], ["give --url URL"]),
    Row("selfcheck-url-space", ["selfcheck", "--url", "http://a b:1"],
        ["holds a space or a control character"]),
    Row("selfcheck-answer-list", ["selfcheck", "--url", "{url:answers}/list"],
        ["the server's answer is not a self-check report: it is '[]'"], code=1),
    Row("selfcheck-answer-bad-check", ["selfcheck", "--url", "{url:answers}/badcheck"],
        ["checks[0] is"], code=1),
    Row("selfcheck-500-html", ["selfcheck", "--url", "{url:answers}/html500"],
        ["answered 500 Internal Server Error: ", "Oops, the worker died"], code=1),
    Row("serve-elastic-no-gpu", ["serve", "--elastic"],
        ["self-check failed, not serving: gpu: failed: no NVIDIA GPU visible"], skip=NO_GPU),
    # ---- issue 37: sizes and numbers -----------------------------------------------------
    # one parser (proxima.config): one line naming the option, the value and the range
    Row("kv-max-1e400", ["kv", "--url", "{closed}", "--max", "1e400"],
        ["--max: '1e400' is above the bound of 1024TiB", "a size from 0 to 1024TiB",
         "KiB, MiB, GiB, TiB (powers of 1024)"]),
    Row("kv-max-1e308TiB", ["kv", "--url", "{closed}", "--max", "1e308TiB"],
        ["--max: '1e308TiB' is above the bound of 1024TiB"]),
    Row("kv-min-inf", ["kv", "--url", "{closed}", "--min", "inf"],
        ["--min: 'inf' is not finite", "from 0 to 1024TiB"]),
    Row("kv-min-minus-inf", ["kv", "--url", "{closed}", "--min=-inf"],
        ["--min: '-inf' is not finite"]),
    Row("kv-max-nan", ["kv", "--url", "{closed}", "--max", "nan"], ["--max: 'nan' is not finite"]),
    Row("kv-min-negative", ["kv", "--url", "{closed}", "--min=-1GiB"],
        ["--min: '-1GiB' is negative"]),
    Row("kv-max-bare-g", ["kv", "--url", "{closed}", "--max", "8G"],
        ["--max: '8G' is not a size: the unit 'G' is ambiguous", "GiB (2^30 bytes) or GB"]),
    Row("kv-max-hex", ["kv", "--url", "{closed}", "--max", "0x10"],
        ["--max: '0x10' is not a size"]),
    Row("kv-max-empty", ["kv", "--url", "{closed}", "--max", ""], ["--max: '' is not a size"]),
    Row("kv-max-inner-space", ["kv", "--url", "{closed}", "--max", "1 000"],
        ["--max: '1 000' is not a size"]),
    Row("kv-max-5000-digits", ["kv", "--url", "{closed}", "--max", "9" * 5000],
        ["(5000 characters) is above the bound of 1024TiB"]),
    Row("kv-min-above-max-units", ["kv", "--url", "{closed}", "--min", "2gib", "--max", "2GB"],
        ["--max 2GB is below --min 2gib"]),
    Row("replay-kv-min-1e400", ["replay", "--elastic", "--kv-min", "1e400"],
        ["--kv-min: '1e400' is above the bound of 1024TiB"]),
    Row("replay-kv-max-1e308TiB", ["replay", "--elastic", "--kv-max", "1e308TiB"],
        ["--kv-max: '1e308TiB' is above the bound of 1024TiB"]),
    Row("replay-kv-max-minus-inf", ["replay", "--elastic", "--kv-max=-inf"],
        ["--kv-max: '-inf' is not finite"]),
    Row("replay-gpu-kv-nan", ["replay", "--elastic", "--gpu-kv", "nan"],
        ["--gpu-kv: 'nan' is not finite"]),
    Row("replay-gpu-kv-1e400", ["replay", "--elastic", "--gpu-kv", "1e400"],
        ["--gpu-kv: '1e400' is above the bound of 1024TiB"]),
    Row("replay-kv-min-without-elastic", ["replay", "--kv-min", "4GiB"],
        ["--kv-min needs --elastic"]),
    Row("replay-kv-initial-without-elastic", ["replay", "--kv-initial", "1GiB"],
        ["--kv-initial needs --elastic"]),
    Row("replay-kv-initial-below-min", ["replay", "--elastic", "--kv-min", "4GiB",
                                        "--kv-initial", "1GiB"],
        ["--kv-initial 1GiB is below --kv-min 4GiB"]),
    # ---- two engines on one simulated GPU (issue 33, item 5) ---------------------------
    Row("replay-engines-3", ["replay", "--engines", "3"],
        ["--engines must be 1 or 2", "got 3"]),
    Row("replay-two-engine-workload-alone", ["replay", "--workload", "steady"],
        ["--workload steady is a two-engine workload: add --engines 2"]),
    Row("replay-engines-2-one-engine-workload", ["replay", "--engines", "2", "--workload",
                                                 "chat"],
        ["--workload chat is a one-engine workload", "alternating-bursts or steady"]),
    Row("replay-engines-2-trace", ["replay", "--engines", "2", "--trace", "t.jsonl"],
        ["--trace replays one engine"]),
    Row("replay-engines-2-num-blocks", ["replay", "--engines", "2", "--num-blocks", "100"],
        ["--num-blocks is a one-engine option", "from --gpu-kv"]),
    Row("replay-engines-2-gpu-kv-below-two-requests", ["replay", "--engines", "2",
                                                       "--gpu-kv", "512MiB"],
        ["--gpu-kv 512MiB is too small for two engines", "largest request (216 blocks)",
         "use at least 1GiB"]),
    Row("replay-engines-2-gpu-kv-below-two-minimums", ["replay", "--engines", "2",
                                                       "--gpu-kv", "2GiB",
                                                       "--granule-blocks", "32"],
        ["--gpu-kv 2GiB is too small for two elastic engines' minimums",
         "each maps 32 granules of 64 MiB at start-up", "the GPU holds 32",
         "use at least 5GiB"]),
    Row("replay-engines-2-kv-min-half-each", ["replay", "--engines", "2", "--gpu-kv", "16GiB",
                                              "--kv-min", "9GiB", "--granule-blocks", "32"],
        ["too small for two elastic engines' minimums", "each maps 144 granules"]),
    Row("replay-headroom-1e400", ["replay", "--elastic", "--headroom", "1e400"],
        ["--headroom: '1e400' is out of range", "a share of the live blocks from 0 to 100"]),
    Row("replay-headroom-inf", ["replay", "--elastic", "--headroom", "inf"],
        ["--headroom: 'inf' is not finite"]),
    Row("replay-headroom-nan-without-elastic", ["replay", "--headroom", "nan"],
        ["--headroom: 'nan' is not finite"]),
    Row("replay-release-delay-inf", ["replay", "--elastic", "--release-delay", "inf"],
        ["--release-delay: 'inf' is not finite", "seconds from 0 to 86400"]),
    Row("replay-release-delay-above-a-day", ["replay", "--elastic", "--release-delay", "1e6"],
        ["--release-delay: '1e6' is out of range", "seconds from 0 to 86400"]),
    Row("replay-release-delay-idle-steps", ["replay", "--elastic", "--release-delay", "1000"],
        ["--release-delay 1000 is 40,000 steps of --step-seconds 0.025",
         "above the bound of 20,000"]),
    Row("replay-step-seconds-negative", ["replay", "--elastic", "--step-seconds=-1"],
        ["--step-seconds: '-1' is out of range", "seconds above 0 to 60"]),
    Row("replay-step-seconds-5000-digits", ["replay", "--elastic", "--step-seconds", "9" * 5000],
        ["(5000 characters) is out of range"]),
    Row("replay-eviction-auto-colon", ["replay", "--elastic", "--eviction", "auto:"],
        ["--eviction: eviction policy 'auto:': give lru, auto, auto:Q"]),    # ran as auto
    Row("replay-eviction-lru-colon", ["replay", "--elastic", "--eviction", "lru:"],
        ["--eviction: eviction policy 'lru:'"]),                            # ran as lru
    Row("replay-eviction-bogus-without-elastic", ["replay", "--eviction", "bogus"],
        ["--eviction: eviction policy 'bogus'", "lru, auto"]),
    Row("replay-elastic-options-env-garbage", ["replay", "--requests", "4"],
        ["PROXIMA_ELASTIC_OPTIONS must be key=value", "'garbage' is not key=value"],
        env={"PROXIMA_ELASTIC_OPTIONS": "garbage"}),
    Row("replay-elastic-options-env-nan", ["replay", "--requests", "4"],
        ["PROXIMA_ELASTIC_OPTIONS must be", "headroom: 'NaN' is not finite"],
        env={"PROXIMA_ELASTIC_OPTIONS": "headroom=NaN"}),
    Row("replay-elastic-options-env-json-inf", ["replay", "--requests", "4"],
        ["release_delay_s: 'Infinity' is not finite"],
        env={"PROXIMA_ELASTIC_OPTIONS": '{"release_delay_s": Infinity}'}),
    Row("replay-elastic-options-env-json-list", ["replay", "--requests", "4"],
        ["PROXIMA_ELASTIC_OPTIONS must be", "([1, 2] is JSON but not an object"],
        env={"PROXIMA_ELASTIC_OPTIONS": "[1,2]"}),                 # "'[1' is not key=value"
    Row("replay-elastic-options-env-json-true", ["replay", "--requests", "4"],
        ["(min_bytes: true is not a size"],                        # "True is not a size"
        env={"PROXIMA_ELASTIC_OPTIONS": '{"min_bytes": true}'}),
    Row("bench-elastic-options-1e400GiB", ["bench", "--offline", "--model", TINY, "--elastic",
                                           "--elastic-options", "max_bytes=1e400GiB"],
        ["--elastic-options: max_bytes: '1e400GiB' is above the bound of 1024TiB"]),
    Row("bench-elastic-options-nan", ["bench", "--offline", "--model", TINY, "--elastic",
                                      "--elastic-options", "headroom=nan"],
        ["--elastic-options: headroom: 'nan' is not finite"]),
    Row("bench-elastic-options-twice", ["bench", "--offline", "--model", TINY, "--elastic",
                                        "--elastic-options", "min_bytes=1GiB,min_bytes=2GiB"],
        ["--elastic-options: min_bytes is given twice"]),
    Row("bench-elastic-options-5000-digits", ["bench", "--offline", "--model", TINY,
                                              "--elastic", "--elastic-options",
                                              "reserve_blocks=" + "9" * 5000],
        ["reserve_blocks:", "(5000 characters) is out of range"]),
    Row("bench-elastic-options-min-above-max", ["bench", "--offline", "--model", TINY,
                                                "--elastic", "--elastic-options",
                                                "min_bytes=8GiB,max_bytes=1GiB"],
        ["max_bytes (1GiB) is below min_bytes (8GiB)"]),
    Row("replay-compaction-budget-huge", ["replay", "--compaction", "1",
                                          "--compaction-budget-mib", "9" * 30],
        ["is above the bound of 1,073,741,824 (1024TiB)"]),
    Row("bench-kv-cache-memory-bytes-1e400", ["bench", "--offline", "--model", TINY,
                                              "--kv-cache-memory-bytes", "1e400"],
        ["--kv-cache-memory-bytes: '1e400' is above the bound of 1024TiB"]),
    Row("bench-kv-cache-memory-bytes-bare-g", ["bench", "--offline", "--model", TINY,
                                               "--kv-cache-memory-bytes", "8G"],
        ["--kv-cache-memory-bytes: '8G' is not a size: the unit 'G' is ambiguous"]),
    Row("serve-elastic-kv-max-1e400", ["serve", "--elastic", "--kv-max", "1e400"],
        ["--kv-max: '1e400' is above the bound of 1024TiB"]),
    Row("serve-elastic-kv-min-inf", ["serve", "--elastic", "--kv-min=inf"],
        ["--kv-min: 'inf' is not finite"]),
    Row("serve-elastic-options-nan", ["serve", "--elastic", "--elastic-options",
                                      "release_delay_s=nan"],
        ["--elastic-options: release_delay_s: 'nan' is not finite"]),
    Row("serve-elastic-options-env-garbage", ["serve", TINY],
        ["PROXIMA_ELASTIC_OPTIONS must be key=value", "'garbage' is not key=value"],
        env={"PROXIMA_ELASTIC_OPTIONS": "garbage"}),
    # ---- issue 37: replay, bench, traces --------------------------------------------------
    Row("replay-trace-deep-nesting", ["replay", "--trace", "{tmp}/deep.jsonl"],
        ["{tmp}/deep.jsonl:1: JSON nested 30,000 deep, past the bound of 8"]),
    Row("replay-trace-5000-digits", ["replay", "--trace", "{tmp}/bigint.jsonl"],
        ["{tmp}/bigint.jsonl:2: a number of 5,000 characters", "longer than the bound of 20"]),
    Row("replay-trace-dev-zero", ["replay", "--trace", "/dev/zero"],
        ["cannot read trace /dev/zero: it is a character device, not a regular file"]),
    Row("replay-trace-fifo", ["replay", "--trace", "{tmp}/fifo.jsonl"],
        ["cannot read trace {tmp}/fifo.jsonl: it is a FIFO (named pipe), not a regular file"]),
    Row("replay-trace-1gb-line", ["replay", "--trace", "{tmp}/huge.jsonl"],
        ["{tmp}/huge.jsonl:1: the line is longer than the bound of 65,536 bytes"]),
    Row("replay-json-plot-same", ["replay", "--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"],
        ["--json {tmp}/r.png and --plot {tmp}/r.png are the same file"],
        absent=["{tmp}/r.png"]),
    Row("replay-json-plot-same-dot", ["replay", "--json", "r.png", "--plot", "./r.png"],
        ["--json r.png and --plot ./r.png are the same file"], absent=["{tmp}/r.png"]),
    Row("replay-json-plot-symlink", ["replay", "--json", "{tmp}/link.png", "--plot",
                                     "{tmp}/plotted.png"],
        ["--json {tmp}/link.png and --plot {tmp}/plotted.png are the same file"]),
    Row("replay-json-symlink-to-trace", ["replay", "--trace", "{tmp}/good.jsonl", "--json",
                                         "{tmp}/tracelink.json"],
        ["--json {tmp}/tracelink.json would overwrite the trace (--trace {tmp}/good.jsonl)"]),
    Row("replay-plot-over-trace", ["replay", "--trace", "{tmp}/trace.png", "--plot",
                                   "{tmp}/trace.png"],
        ["--plot {tmp}/trace.png would overwrite the trace"]),
    Row("replay-compaction-budget-alone", ["replay", "--compaction-budget-mib", "64"],
        ["--compaction-budget-mib needs --compaction"]),
    Row("replay-compaction-bad-mode", ["replay", "--compaction", "always"],
        ["--compaction must be 1, got 'always'"]),
    Row("replay-granule-blocks-huge", ["replay", "--granule-blocks", "100000000"],
        ["--granule-blocks 100,000,000 is above the bound of 4,194,304"]),
    Row("replay-seed-5000-digits", ["replay", "--seed", "9" * 5000],
        ["argument --seed: invalid int value"]),
    Row("bench-json-plot-same", ["bench", "--base-url", "{url:good}", "--json", "{tmp}/b.png",
                                 "--plot", "{tmp}/b.png"],
        ["--json {tmp}/b.png and --plot {tmp}/b.png are the same file"],
        absent=["{tmp}/b.png"]),
    Row("bench-result-filename-plot-same", ["bench", "--base-url", "{url:good}",
                                            "--save-result", "--result-filename", "b.png",
                                            "--plot", "{tmp}/b.png"],
        ["--result-filename b.png and --plot {tmp}/b.png are the same file"],
        absent=["{tmp}/b.png"]),
    Row("bench-json-over-trace", ["bench", "--base-url", "{url:good}", "--trace",
                                  "{tmp}/good.jsonl", "--json", "./good.jsonl"],
        ["--json ./good.jsonl would overwrite the trace"]),
    Row("bench-offline-json-plot-same", ["bench", "--offline", "--model", TINY, "--json",
                                         "{tmp}/o.png", "--plot", "{tmp}/o.png"],
        ["are the same file"], absent=["{tmp}/o.png"]),
    Row("bench-trace-fifo", ["bench", "--base-url", "{url:good}", "--trace",
                             "{tmp}/fifo.jsonl"], ["it is a FIFO (named pipe)"]),
    Row("bench-trace-deep-nesting", ["bench", "--base-url", "{url:good}", "--trace",
                                     "{tmp}/deep.jsonl"], ["past the bound of 8"]),
    Row("bench-trace-5000-digits", ["bench", "--base-url", "{url:good}", "--trace",
                                    "{tmp}/bigint.jsonl"], ["longer than the bound of 20"]),
    Row("bench-trace-dev-zero", ["bench", "--base-url", "{url:good}", "--trace", "/dev/zero"],
        ["it is a character device"]),
    Row("bench-trace-1gb-line", ["bench", "--base-url", "{url:good}", "--trace",
                                 "{tmp}/huge.jsonl"], ["longer than the bound of 65,536 bytes"]),
    Row("bench-trace-fewer-than-requests", ["bench", "--base-url", "{url:good}", "--trace",
                                            "{tmp}/good.jsonl", "--requests", "5"],
        ["--requests 5: trace {tmp}/good.jsonl holds only 1 request: give --requests 1 or "
         "fewer, or leave --requests out"]),              # ran 1 request, "1 requests"
    Row("replay-trace-fewer-than-requests", ["replay", "--trace", "{tmp}/good.jsonl",
                                             "--requests", "2"],
        ["--requests 2: trace {tmp}/good.jsonl holds only 1 request"]),
    Row("replay-trace-empty-name", ["replay", "--trace", ""],
        ["--trace needs a file name, got ''"]),                # ran the chat workload instead
    Row("bench-trace-empty-name", ["bench", "--base-url", "{url:good}", "--trace", ""],
        ["--trace needs a file name, got ''"]),
    Row("replay-max-model-len-below-workload", ["replay", "--max-model-len", "100"],
        ["--max-model-len 100 is too short for the chat workload", "use at least"]),
    Row("replay-multiturn-max-model-len", ["replay", "--workload", "multiturn",
                                           "--max-model-len", "64"],          # used to hang
        ["--max-model-len 64 is too short for the multiturn workload", "use at least 580"]),
    Row("bench-multiturn-max-model-len", ["bench", "--base-url", "{url:good}", "--workload",
                                          "multiturn", "--max-model-len", "64"],
        ["use at least 580"]),
    # ---- issue 36: serve with several models -------------------------------------------------
    # Each refused in one line before any engine starts ({tmp}/models-*.toml: see world()).
    Row("serve-multi-duplicate-name", ["serve", "--model", f"a={TINY}", "--model", f"a={TINY}"],
        ["model name 'a' is given twice", "every model needs its own name"]),
    Row("serve-multi-missing-dir", ["serve", "--model", f"a={TINY}", "--model", "b={tmp}/nomodel"],
        ["model 'b': model path '{tmp}/nomodel' does not exist"]),
    Row("serve-multi-unknown-option", ["serve", "--model", f"a={TINY} --no-such-flag"],
        ["model 'a': unrecognized arguments: --no-such-flag"], skip=NO_GPU_PARSER),
    Row("serve-multi-unknown-option-for-all", ["serve", "--model", f"a={TINY}", "--no-such-flag"],
        ["the options for every model: unrecognized arguments: --no-such-flag"], skip=NO_GPU_PARSER),
    Row("serve-multi-proxima-options-are-not-vllms",
        ["serve", "--model", f"a={TINY} --elastic-options release_delay_s=5 --no-such-flag",
         "--kv-min", "1GiB"],
        ["model 'a': unrecognized arguments: --no-such-flag (the options"], skip=NO_GPU_PARSER),
    Row("serve-multi-compaction-env", ["serve", "--model", f"a={TINY} --no-such-flag"],
        ["model 'a': unrecognized arguments: --no-such-flag"], skip=NO_GPU_PARSER,
        env={"PROXIMA_COMPACTION": "1"}),          # every engine is elastic: no refusal for it
    Row("serve-multi-reserved-option", ["serve", "--model", f"a={TINY} --host 0.0.0.0"],
        ["--model a: --host cannot be given for one model", "belongs to the endpoint"]),
    Row("serve-multi-same-port", ["serve", "--model", f"a={TINY} --port 9100", "--model",
                                  f"b={TINY} --port 9100"],
        ["models 'a' and 'b' are both given port 9100"]),
    Row("serve-multi-endpoint-port", ["serve", "--port", "9000", "--model", f"a={TINY} --port 9000"],
        ["model 'a': port 9000 is the endpoint's port"]),
    Row("serve-multi-bad-size", ["serve", "--model", f"a={TINY} --kv-max lots"],
        ["model 'a': ", "--kv-max: 'lots' is not a size"]),
    Row("serve-multi-positional", ["serve", TINY, "--model", f"a={TINY}"],
        ["with several models give each as --model NAME=PATH"]),
    Row("serve-multi-file-unknown-field", ["serve", "--models", "{tmp}/models-field.toml"],
        ["--models {tmp}/models-field.toml: models[2]: unknown field 'kv_maxx': did you mean "
         "'kv_max'?"]),
    Row("serve-multi-file-bad-toml", ["serve", "--models", "{tmp}/models-syntax.toml"],
        ["--models {tmp}/models-syntax.toml:4: not valid TOML"]),
    Row("serve-multi-file-bad-json", ["serve", "--models", "{tmp}/models-syntax.json"],
        ["--models {tmp}/models-syntax.json:3: not valid JSON"]),
    Row("serve-multi-file-duplicate", ["serve", "--models", "{tmp}/models-twice.toml"],
        ["model name 'a' is given twice (--models {tmp}/models-twice.toml: models[1] and "
         "--models {tmp}/models-twice.toml: models[2])"]),
    Row("serve-multi-file-missing", ["serve", "--models", "{tmp}/nosuch.toml"],
        ["--models {tmp}/nosuch.toml: the file does not exist"]),
    Row("serve-multi-file-json-key-twice", ["serve", "--models", "{tmp}/models-key-twice.json"],
        ["--models {tmp}/models-key-twice.json: the key 'name' is given twice in one object"]),
    Row("serve-multi-file-toml-bom", ["serve", "--models", "{tmp}/models-bom.toml"],
        ["model 'a': --kv-min: '1XB' is not a size"]),    # was: line 1: Invalid statement
    Row("serve-multi-file-json-bom", ["serve", "--models", "{tmp}/models-bom.json"],
        ["model 'a': --kv-min: '1XB' is not a size"]),    # was: Unexpected UTF-8 BOM
    Row("serve-multi-file-empty-name", ["serve", "--models", ""],   # was: "is a directory"
        ["--models needs a file name, got ''"]),
    Row("serve-multi-file-yaml", ["serve", "--models", "{tmp}/models.yaml"],  # "not valid TOML"
        ["--models {tmp}/models.yaml: YAML is not read: write the same fields as TOML"]),
    Row("serve-multi-file-empty-list", ["serve", "--models", "{tmp}/models-none.json"],
        ["--models {tmp}/models-none.json: no models: add one [[models]] table"]),  # "give --models"
    Row("serve-multi-file-not-tables", ["serve", "--models", "{tmp}/models-five.json"],
        ["--models {tmp}/models-five.json: models[2] must be a table (name, path), got int 5"]),
    # (was: "models must be a list of tables ([[models]]), got list")
    Row("serve-compaction-without-elastic", ["serve", "--compaction"],
        ["--compaction needs --elastic"]),
] + [
    Row(f"{name}-unknown-flag", [name, "--no-such-flag"],
        ["--no-such-flag"], skip=NO_GPU if name == "serve" else None)
    for name in SUBCOMMANDS if name != "serve"      # serve's row is in the issue's table
]

SERVERS = {
    "good": ServerConfig(),
    "data5": ServerConfig(models_answer=b'{"data": 5}'),
    "list": ServerConfig(models_answer=b"[]"),
    "html": ServerConfig(models_answer=b"<html>hello</html>"),
    "empty": ServerConfig(models_answer=b'{"object": "list", "data": []}'),
    "answers": ServerConfig(routes={
        f"/{name}/proxima/{route}": answer
        for name, answer in {
            "list": (200, b"[]", "application/json"),
            "null": (200, b"null", "application/json"),
            "wrongtype": (200, b'{"policy": "auto", "granule_blocks": 32, "bytes_per_granule": '
                               b'1, "mapped_bytes": "lots", "pool_bytes": 1}',
                          "application/json"),
            "boolcount": (200, b'{"policy": "auto", "granule_blocks": 32, "bytes_per_granule": '
                               b'1, "mapped_bytes": 1, "pool_bytes": 1, "grows": true}',
                          "application/json"),
            "empty": (200, b"{}", "application/json"),
            "html500": (500, b"<html><head><title>500 Internal Server Error</title></head>"
                             b"<body><h1>Oops, the worker died</h1>\x1b[31m</body></html>",
                        "text/html"),
            "text": (200, b"hello\n", "text/plain"),
            "huge": (200, b"[" + b"0," * (1 << 19) + b"0]", "application/json"),
            "redirect": (302, b"", "text/plain", {"Location": "https://elsewhere.example/"}),
            "openai": (400, b'{"object": "error", "message": "x", "error": {"message": '
                            b'"max_bytes 1073741824 is below min_bytes 2147483648", '
                            b'"type": "BadRequestError", "code": 400}}', "application/json"),
            "badcheck": (200, b'{"passed": true, "checks": [{"name": "gpu", "status": 1}]}',
                         "application/json"),
        }.items() for route in ("kv", "selfcheck")}),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Files and servers the rows refer to."""
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "outdir").mkdir()
    (tmp / "binary.jsonl").write_bytes(bytes([0x98, 0x00, 0xff, 0x10]) * 64)
    good = '{"prompt_len": 10, "output_len": 5}\n'
    (tmp / "good.jsonl").write_text(good)
    (tmp / "misspelt.jsonl").write_text(good + '{"promt_len": 10, "output_len": 5}\n')
    (tmp / "arival.jsonl").write_text('{"prompt_len": 10, "output_len": 5, "arival_step": 3}\n')
    (tmp / "unknown.jsonl").write_text('{"prompt_len": 10, "output_len": 5, "temperature": 0}\n')
    (tmp / "twice.jsonl").write_text(good + '{"prompt_len": 10, "output_len": 5, '
                                     '"prompt_len": 11}\n')
    (tmp / "nul.jsonl").write_text(good.replace("10", "1\x000"))
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "notjson.jsonl").write_text("prompt_len=10\n")
    (tmp / "float.jsonl").write_text('{"prompt_len": 1.5, "output_len": 5}\n')
    (tmp / "bool.jsonl").write_text('{"prompt_len": 10, "output_len": true}\n')
    (tmp / "strnum.jsonl").write_text('{"prompt_len": "10", "output_len": 5}\n')
    (tmp / "long.jsonl").write_text('{"prompt_len": 8000, "output_len": 1000}\n')
    (tmp / "notimg.txt").write_text("not an image\n")
    (tmp / "deep.jsonl").write_text("[" * 30_000 + "]" * 30_000 + "\n")   # past json's recursion
    (tmp / "bigint.jsonl").write_text(good + '{"prompt_len": ' + "7" * 5000
                                      + ', "output_len": 5}\n')
    os.mkfifo(tmp / "fifo.jsonl")
    with open(tmp / "huge.jsonl", "wb") as huge:        # one 1 GiB line, sparse on disk
        huge.write(b'{"prompt_len": 10, "output_len": 5, "prefix_id": "')
        huge.seek(2**30)
        huge.write(b'"}\n')
    (tmp / "plotted.png").write_bytes(b"\x89PNG not really\n")
    (tmp / "link.png").symlink_to(tmp / "plotted.png")
    (tmp / "tracelink.json").symlink_to("good.jsonl")
    (tmp / "trace.png").write_text(good)
    model = f'name = "a"\npath = "{TINY}"\n'
    (tmp / "models-field.toml").write_text(f'[[models]]\n{model}\n[[models]]\nname = "b"\n'
                                           f'path = "{TINY}"\nkv_maxx = "1GiB"\n')
    (tmp / "models-syntax.toml").write_text(f'[[models]]\n{model}args = [1,,2]\nport = 1\n')
    (tmp / "models-syntax.json").write_text('{"models": [\n  {"name": "a",\n   "path": }]}\n')
    (tmp / "models-twice.toml").write_text(f"[[models]]\n{model}[[models]]\n{model}")
    (tmp / "models-key-twice.json").write_text(       # was: served as 'b'
        json.dumps({"models": [{"name": "a", "path": TINY}]}).replace('"a"', '"a", "name": "b"'))
    (tmp / "models-bom.toml").write_text(f'\ufeff[[models]]\n{model}kv_min = "1XB"\n')
    (tmp / "models-bom.json").write_text('\ufeff' + json.dumps(
        {"models": [{"name": "a", "path": TINY, "kv_min": "1XB"}]}))
    (tmp / "bom.jsonl").write_text('\ufeff' + good + '{"prompt_len": 10}\n')
    (tmp / "models-none.json").write_text('{"models": []}')
    (tmp / "models-five.json").write_text(json.dumps({"models": [{"name": "a", "path": TINY}, 5]}))
    (tmp / "b6.tar").write_text("someone's earlier bundle\n")
    (tmp / "b7.tar").mkdir()
    (tmp / "models.yaml").write_text(f"models:\n  - name: a\n    path: {TINY}\n")
    servers = {name: FakeOpenAIServer(cfg).start() for name, cfg in SERVERS.items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    yield {"tmp": str(tmp), "servers": servers, "closed": closed}
    for server in servers.values():
        server.stop()


def fill(text: str, world) -> str:
    text = text.replace("{tmp}", world["tmp"]).replace("{closed}", world["closed"])
    for name, server in world["servers"].items():
        text = text.replace(f"{{url:{name}}}", server.url)
    return text


def run_proxima(argv: list[str], env: dict | None = None,
                cwd: Path = REPO) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    for key in ("PROXIMA_ALLOCATOR", "PROXIMA_STATS_FILE", "VLLM_PLUGINS",
                "VLLM_LOGGING_STREAM", "PROXIMA_EXPECT_GPU"):
        full.pop(key, None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "proxima.cli", *argv], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def assert_bad_input(done: subprocess.CompletedProcess, command: str, fragments: list[str],
                     code: int = 2) -> str:
    """Exit ``code``, no traceback anywhere, nothing on stdout, exactly one error line
    ``proxima COMMAND: error: ...`` holding every fragment; returns that line."""
    shown = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == code, shown
    assert "Traceback" not in done.stderr + done.stdout, shown
    if command != "serve":          # a server's logs (vLLM's on stdout) are no table
        assert done.stdout.strip() == "", shown                 # no table: no work was done
    prefix = f"proxima {command}: error: " if command else "proxima: error: "
    errors = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, shown
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def _param(row: Row):
    marks = []
    if row.skip:
        marks.append(pytest.mark.skip(reason=row.skip))
    if row.xfail:
        marks.append(pytest.mark.xfail(reason=row.xfail, strict=False))
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_bad_input(row: Row, world):
    argv = [fill(a, world) for a in row.argv]
    command = argv[0] if argv[0] in SUBCOMMANDS else ""
    tmp = Path(world["tmp"])
    before = sorted(tmp.rglob("*"))
    for attempt in range(2 if row.absent else 1):     # twice: the first left nothing behind
        done = run_proxima(argv, env=row.env, cwd=tmp)  # (a default file name lands in tmp)
        assert_bad_input(done, command, [fill(m, world) for m in row.message], row.code)
        for path in row.absent:
            assert not Path(fill(path, world)).exists(), (attempt, path)
    if not row.xfail:
        assert sorted(tmp.rglob("*")) == before, "bad input left a file behind"


def test_the_table_covers_the_issue_and_as_many_again():
    issue = [r for r in ROWS if r.id in {
        "bench-offline-no-gpu", "replay-json-dir", "replay-json-proc", "replay-plot-txt",
        "bench-plot-txt", "replay-plot-dir-slash", "bundle-bad-image", "bundle-bad-extra",
        "replay-requests-huge", "replay-num-blocks-huge", "replay-trace-binary",
        "replay-trace-misspelt-key", "bench-models-data-5", "serve-no-such-flag"}]
    assert len(issue) == 14
    assert len(ROWS) - len(issue) >= len(issue)
    commands = {r.argv[0] for r in ROWS}
    assert set(SUBCOMMANDS) <= commands            # every subcommand has rows


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_help_shows_every_default(name):
    """`proxima NAME --help`: exit 0, and every option's help says its default (serve's
    options are vLLM's: its help points there)."""
    import argparse

    from proxima.cli import build_parser

    done = run_proxima([name, "--help"])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    if name == "serve":
        assert "vllm serve --help" in done.stdout
        return
    parser = build_parser([name])
    sub = next(a for a in parser._actions
               if isinstance(a, argparse._SubParsersAction)).choices[name]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        assert "default" in text or "required" in text, (action.option_strings, text)
        assert " ".join(text.split())[:40] in " ".join(done.stdout.split()), action.option_strings


def test_replay_and_bench_help_explain_the_table_and_the_exit_status():
    replay = run_proxima(["replay", "--help"]).stdout
    for line in ("blocks_per_run         KV blocks per contiguous run of block ids",
                 "single_run_fraction    share of finished requests whose blocks form ONE run",
                 "exit status:"):
        assert line in replay
    bench = run_proxima(["bench", "--help"]).stdout
    for text in ("blocks", "per run (KV blocks per contiguous run of block ids",
                 "exit status:", "NOT trustworthy", "cut before [DONE]", "--num-prompts N",
                 "--max-concurrency C", "--dataset-name W", "--save-result"):
        assert text in bench, text


def test_a_trace_error_names_the_line_even_after_good_lines(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": 5, "output_len": 2})
                               for _ in range(3)) + '\n{"prompt_len": 5}\n')
    done = run_proxima(["replay", "--trace", str(trace)])
    assert_bad_input(done, "replay", [f"{trace}:4: missing 'output_len'"])


@pytest.mark.parametrize("name, lines", [
    ("replay", ["1    done, but a parity check FAILED", "143 terminated (SIGTERM)"]),
    ("bench", ["1    the report is printed (and written) but is NOT trustworthy",
               "143 terminated (SIGTERM)"]),
    ("selfcheck", ["1  a check failed", "2  bad input"]),
    ("bundle", ["1    --verify: a file is missing or does not match"]),
    ("", ["143 terminated (SIGTERM): replay and bench keep what was finished"]),
])
def test_help_states_the_exit_statuses(name, lines):
    """Each command's --help says what its exit statuses mean (issue 37: replay said 0
    when a parity check failed, selfcheck and bundle said nothing)."""
    done = run_proxima([name, "--help"] if name else ["--help"])
    assert done.returncode == 0, done.stderr
    assert "exit status" in done.stdout
    for line in lines:
        assert line in done.stdout, line


@pytest.mark.parametrize("sums, line", [
    (b"\xff\xfe\x00garbage\n", "SHA256SUMS: not UTF-8 text (the copy is damaged)"),
    (b"not a sums line\n", "SHA256SUMS:1: not a line '<sha256>  <file>' (the copy is damaged)"),
])
def test_bundle_verify_of_a_damaged_sha256sums_is_a_failed_check_not_a_traceback(tmp_path, sums,
                                                                               line):
    """A SHA256SUMS that is not UTF-8 used to end in a UnicodeDecodeError traceback, a line
    without a checksum in 'FAILED : missing'."""
    (tmp_path / "SHA256SUMS").write_bytes(sums)
    done = run_proxima(["bundle", "--verify", str(tmp_path)])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"FAILED {line}" in done.stderr.splitlines(), done.stderr
    assert done.stderr.splitlines()[-1].startswith("proxima bundle: 1 file(s) of ")


def test_bundle_nix_closure_error_is_one_line(tmp_path):
    """nix-store's stderr (a warning line, then its error) used to be pasted into the error
    as is: two lines. A stand-in nix-store on PATH prints what Nix printed here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nix-store").write_text(
        "#!/bin/sh\necho \"warning: the group 'nixbld' specified in 'build-users-group' does "
        "not exist\" >&2\necho \"error: 'nope' is too short to be a valid store path\" >&2\n"
        "exit 1\n")
    (bin_dir / "nix-store").chmod(0o755)
    done = run_proxima(["bundle", "--out", str(tmp_path / "b"), "--nix-closure",
                        "/nix/store/nope"],
                       env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert_bad_input(done, "bundle", ["--nix-closure /nix/store/nope: not a valid store path "
                                      "(error: 'nope' is too short to be a valid store path); "
                                      "build it first"])
    assert "warning" not in done.stderr and not (tmp_path / "b").exists()


def test_serve_help_gives_the_defaults_of_proxima_s_own_options():
    """serve's help is text, not argparse's (the rest are vLLM's options): every option
    of proxima's says its default. With several models --host/--port are proxima's own (the
    endpoint's), not vLLM's: their defaults were not said anywhere; nor --elastic's."""
    help_text = " ".join(run_proxima(["serve", "--help"]).stdout.split())
    assert "one OpenAI endpoint on --host/--port (default: 0.0.0.0, port 8000)" in help_text
    assert "on a free port unless given one" in help_text
    for option in ("--elastic switch it on (sets PROXIMA_ELASTIC=1; default: off)",
                   "--compaction KV compaction too (sets PROXIMA_COMPACTION=1; needs --elastic; "
                   "default: off)", "--kv-min SIZE least KV memory kept mapped (default 512MiB",
                   "(default: never)", "--gpu-memory-bytes SIZE size for a GPU of this many "
                   "bytes (default: the GPU's memory)"):
        assert option in help_text, option


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(tmp_path):
    """`proxima kv --watch | head -1`: the next write met the closed pipe and Python printed
    a BrokenPipeError traceback (exit 1). Now exit 141, as a shell reports a process SIGPIPE
    ended, and nothing on stderr."""
    rc, stderr = _with_stdout_closed(["kv", "--watch", "0.2", "--ledger-dir", str(tmp_path)],
                                     after_line=True, timeout=120)   # as head -1 does
    assert rc == 141 and stderr == "", stderr


def _with_stdout_closed(args: list[str], *, after_line: bool, timeout: float):
    """``proxima ARGS`` whose stdout's reader goes away (after its first line, or at once);
    returns (exit status, stderr)."""
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", *args], cwd=REPO, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if after_line:
            assert proc.stdout.readline()        # running: its first line came
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr


@pytest.mark.parametrize("command", [["replay", "--requests", "3"],
                                     ["bench", "--base-url", "{url:good}", "--requests", "2",
                                      "--model", "tiny"]])
def test_a_closed_stdout_does_not_lose_the_json_of_a_finished_run(world, tmp_path, command):
    """The table was printed before --json was written: with stdout's reader gone (`| true`)
    the print raised and the finished run's JSON was never written."""
    pytest.importorskip("vllm", reason="replay needs vLLM (./dev test)")
    out = tmp_path / "r.json"
    rc, stderr = _with_stdout_closed([*[fill(a, world) for a in command], "--no-progress",
                                      "--json", str(out)], after_line=False, timeout=300)
    assert rc == 141 and "Traceback" not in stderr, stderr        # gone before the table
    assert json.loads(out.read_text())["results"]
