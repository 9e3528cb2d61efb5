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
    # ---- found by trying things ------------------------------------------------------
    Row("replay-trace-misspelt-optional-key", ["replay", "--trace", "{tmp}/arival.jsonl"],
        ["unknown key 'arival_step': did you mean 'arrival_step'?"]),
    Row("replay-trace-unknown-key", ["replay", "--trace", "{tmp}/unknown.jsonl"],
        ["unknown key 'temperature': the keys are prompt_len, output_len"]),
    Row("replay-trace-nul", ["replay", "--trace", "{tmp}/nul.jsonl"], ["holds a NUL byte"]),
    Row("replay-trace-dir", ["replay", "--trace", "{tmp}/outdir"],
        ["cannot read trace {tmp}/outdir: it is a directory"]),
    Row("replay-trace-missing", ["replay", "--trace", "{tmp}/missing.jsonl"],
        ["cannot read trace {tmp}/missing.jsonl: No such file or directory"]),
    Row("replay-trace-empty", ["replay", "--trace", "{tmp}/empty.jsonl"], ["holds no requests"]),
    Row("replay-trace-not-json", ["replay", "--trace", "{tmp}/notjson.jsonl"],
        ["{tmp}/notjson.jsonl:1: not JSON"]),
    Row("replay-trace-float", ["replay", "--trace", "{tmp}/float.jsonl"],
        ["prompt_len must be an integer >= 1, got 1.5"]),
    Row("replay-trace-too-long", ["replay", "--trace", "{tmp}/long.jsonl"],
        ["prompt_len + output_len = 9000 exceeds the model length 8192"]),
    Row("replay-json-dev-null", ["replay", "--json", "/dev/null"],
        ["--json /dev/null exists and is not a regular file"]),
    Row("replay-json-no-dir", ["replay", "--json", "{tmp}/nodir/r.json"],
        ["directory {tmp}/nodir does not exist"]),
    Row("replay-json-empty", ["replay", "--json", ""], ["--json needs a file name"]),
    Row("replay-json-over-trace", ["replay", "--trace", "{tmp}/good.jsonl", "--json",
                                   "{tmp}/good.jsonl"], ["would overwrite the trace"]),
    Row("replay-max-model-len", ["replay", "--max-model-len", "200000"],
        ["--max-model-len 200,000 is above the bound of 131,072"]),
    Row("replay-batched-below-seqs", ["replay", "--max-num-batched-tokens", "100"],
        ["--max-num-batched-tokens (100) must be >= --max-num-seqs (1024)"]),
    Row("replay-block-size", ["replay", "--block-size", "3"], ["power of two"]),
    Row("replay-repeat-0", ["replay", "--repeat", "0"], ["--repeat must be >= 1, got 0"]),
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
        ["--request-rate must be > 0 requests/s"]),
    Row("bench-timeout-inf", ["bench", "--base-url", "{url:good}", "--timeout", "inf"],
        ["--timeout must be > 0 seconds (a finite number), got inf"]),
    Row("bench-trace-binary", ["bench", "--base-url", "{url:good}", "--trace",
                               "{tmp}/binary.jsonl"], ["not UTF-8 text"]),
    Row("bench-requests-huge", ["bench", "--base-url", "{url:good}", "--num-prompts",
                                "1000000000"], ["is above the bound of 100,000"]),
    Row("bench-bad-url", ["bench", "--base-url", "localhost:8000"],
        ["--base-url must look like http://HOST:PORT"]),
    Row("bench-labels", ["bench", "--base-url", "{url:good}", "--label", "a", "--label", "b"],
        ["got 2 --label for 1 --base-url"]),
    Row("bench-no-server", ["bench"], ["give --base-url URL"]),
    Row("bench-offline-no-model", ["bench", "--offline"], ["--offline needs --model DIR"]),
    Row("bench-offline-missing-model", ["bench", "--offline", "--model", "{tmp}/nomodel"],
        ["no such directory"]),
    Row("bench-offline-online-flag", ["bench", "--offline", "--model", TINY, "--base-url",
                                      "http://x:1"], ["--base-url do not apply with --offline"]),
    Row("bench-offline-plot-txt", ["bench", "--offline", "--model", TINY, "--plot",
                                   "{tmp}/x.txt"], ["must end in .png"]),
    Row("serve-bad-value-no-gpu", ["serve", "--max-model-len", "abc"],
        ["argument --max-model-len: invalid", "'abc'"], skip=NO_GPU),
    Row("serve-port", ["serve", "--port", "70000"], ["out of range"]),
    Row("serve-compaction-env-without-elastic", ["serve", TINY],
        ["PROXIMA_COMPACTION needs PROXIMA_ELASTIC=1"], env={"PROXIMA_COMPACTION": "1"}),
    Row("serve-block-size", ["serve", "--block-size", "17"], ["--block-size 17 is not supported"]),
    Row("serve-missing-model", ["serve", "{tmp}/nomodel"], ["does not exist"]),
    Row("selfcheck-url-not-url", ["selfcheck", "--url", "notaurl"],
        ["--url must look like http://HOST:PORT", "'notaurl'"]),
    Row("selfcheck-url-closed", ["selfcheck", "--url", "{closed}"], ["cannot reach"]),
    Row("selfcheck-missing-model", ["selfcheck", "--model", "{tmp}/nomodel"], ["does not exist"]),
    Row("selfcheck-model-no-engine", ["selfcheck", "--no-engine", "--model", TINY],
        ["drop one of them"]),
    Row("bundle-no-out", ["bundle"], ["--out DIR is required"]),
    Row("bundle-verify-missing", ["bundle", "--verify", "{tmp}/nobundle"], ["no SHA256SUMS"]),
    Row("unknown-command", ["nosuch"], ["invalid choice: 'nosuch'"]),
    # ---- elastic KV memory (issue 13) -----------------------------------------------------
    Row("kv-no-url", ["kv"], ["give --url URL"]),
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
        ["max_bytes: 'lots' is not a size"]),
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
    (tmp / "nul.jsonl").write_text(good.replace("10", "1\x000"))
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "notjson.jsonl").write_text("prompt_len=10\n")
    (tmp / "float.jsonl").write_text('{"prompt_len": 1.5, "output_len": 5}\n')
    (tmp / "long.jsonl").write_text('{"prompt_len": 8000, "output_len": 1000}\n')
    (tmp / "notimg.txt").write_text("not an image\n")
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
