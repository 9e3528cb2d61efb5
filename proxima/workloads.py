"""Synthetic workloads and user traces, shared by `proxima replay` and `proxima bench`.

Everything is generated from a seed (nothing is downloaded): prompts are token ids, so no
tokenizer is needed. The same (name, requests, seed) always gives the same requests.

Workloads:
  chat       the seed article's benchmark: short prompts, 100 output tokens, 20 in flight.
  sharegpt   ShareGPT-like lognormal prompt/output lengths, all submitted at once.
  multiturn  conversations whose turns resend the growing history (prefix-cache hits);
             a turn is sent when the previous one has finished.
  pressure   500-style mixed lengths (prompt U[64,1024], output U[32,512]), all at once,
             meant for a small pool (1,920 blocks) so that requests get preempted.
  bursts     load that comes and goes: 4 bursts of 200 requests, 1,500 steps apart, each
             request one of 4 shared 512-token system prompts plus a ShareGPT-like
             question and answer (prefix hits within and across bursts); between bursts
             the engine idles -- what elastic KV memory gives back.

A trace file is JSON Lines, one request a line:
  {"prompt_len": 812, "output_len": 128, "prefix_id": "sys-a", "prefix_len": 256, "arrival_step": 40}
Only prompt_len and output_len are required. Requests with the same prefix_id share their first
prefix_len tokens (default: 256, capped at the prompt); arrival_step (default 0) is the
scheduler step at which the request arrives. Any other key is refused (a misspelt
``promt_len`` must not be silently ignored), and so is a file that is not UTF-8 text.
Sizes are bounded (MAX_REQUESTS, MAX_PROMPT_TOKENS, MAX_MODEL_LEN below): everything is
built in memory before the work starts. The file is read within bounds too (TRACE_MAX_*
below): only a regular file (not a FIFO, a device such as /dev/zero, a directory), lines
of at most 64 KiB, 256 MiB in all, JSON nested at most 8 deep, numbers of at most 20
characters; past a bound, one error line names the file, the line and the bound.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import random
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from proxima.errors import UserError
from proxima.ioutil import KeyTwice, object_keys_once

WORKLOADS = ("chat", "sharegpt", "multiturn", "pressure", "bursts")
BURSTS, BURST_GAP_STEPS, BURST_PREFIX_TOKENS = 4, 1500, 512
# multiturn's first turn: a system prompt of up to 300 tokens, a message of up to 120, an
# answer of up to 160. A shorter --max-model-len would leave conversations without turns.
MULTITURN_MIN_MODEL_LEN = 300 + 120 + 160
VOCAB = (3, 31999)          # token ids drawn here: clear of bos/eos (1, 2) of the tiny models
# Bounds on what is built in memory before any work starts (prompts are lists of ints,
# ~36 bytes a token): 100,000 requests, 50 M prompt tokens (~2 GB), 1 M tokens a request.
MAX_REQUESTS = 100_000
MAX_PROMPT_TOKENS = 50_000_000
MAX_MODEL_LEN = 1_048_576


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int] = field(repr=False)
    max_tokens: int
    arrival_step: int = 0
    #: what the replay's stand-in model answers (multiturn: the reply the next turn
    #: resends, so that its prefix hits the cache as it does in real conversations);
    #: None -> a fixed token
    output_token_ids: list[int] | None = field(default=None, repr=False)
    #: the request that must finish first (the previous turn of a conversation); the
    #: request then arrives ``arrival_step`` steps after it finished (the user's think time)
    follows: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[RequestSpec]
    concurrency: int | None = None   # closed loop: at most this many in flight (None: open)


def _tokens(rng: random.Random, n: int) -> list[int]:
    lo, hi = VOCAB
    return [rng.randint(lo, hi) for _ in range(n)]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def make_workload(name: str, requests: int | None = None, seed: int = 0,
                  max_model_len: int = 8192) -> Workload:
    """Build a named workload. ``requests`` defaults per workload (100 chat, 1000 sharegpt,
    400 multiturn turns, 500 pressure, 800 bursts)."""
    if name not in WORKLOADS:
        raise UserError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)} "
                        f"or pass --trace FILE")
    check_sizes(requests, max_model_len)
    if name == "multiturn" and max_model_len < MULTITURN_MIN_MODEL_LEN:
        raise UserError(f"--max-model-len {max_model_len} is too short for the multiturn "
                        f"workload (its first turns take up to {MULTITURN_MIN_MODEL_LEN} "
                        f"tokens): use at least {MULTITURN_MIN_MODEL_LEN}")
    rng = random.Random(f"{name}:{seed}")
    specs: list[RequestSpec] = []
    concurrency = None
    if name == "chat":
        n = requests or 100
        concurrency = 20
        for i in range(n):
            specs.append(RequestSpec(f"chat-{i}", _tokens(rng, rng.randint(16, 160)), 100))
    elif name == "sharegpt":
        n = requests or 1000
        for i in range(n):
            prompt = _lognormal(rng, 220, 1.0, 4, max_model_len // 2)
            out = _lognormal(rng, 180, 0.9, 1, min(2048, max_model_len - prompt))
            specs.append(RequestSpec(f"sharegpt-{i}", _tokens(rng, prompt), out))
    elif name == "multiturn":
        n = requests or 400
        turns = 4
        conv = 0
        while len(specs) < n:
            history = _tokens(rng, rng.randint(50, 300))     # this conversation's system prompt
            start = rng.randint(0, 60)
            previous = None
            for t in range(turns):
                if len(specs) >= n:
                    break
                history += _tokens(rng, rng.randint(20, 120))     # the user's new message
                out = rng.randint(40, 160)
                if len(history) + out > max_model_len:
                    break
                reply = _tokens(rng, out)
                rid = f"conv{conv}-turn{t}"
                specs.append(RequestSpec(rid, list(history), out, arrival_step=start,
                                         output_token_ids=reply, follows=previous))
                history += reply                                   # resent next turn
                previous = rid
            conv += 1
    elif name == "bursts":
        n = requests or 800
        prefixes = [_tokens(rng, min(BURST_PREFIX_TOKENS, max_model_len // 4))
                    for _ in range(4)]
        per_burst = -(-n // BURSTS)
        for i in range(n):
            burst = i // per_burst
            question = _lognormal(rng, 200, 1.0, 4, max_model_len // 4)
            out = _lognormal(rng, 180, 0.9, 1, min(1024, max_model_len // 4))
            prompt = prefixes[rng.randrange(4)] + _tokens(rng, question)
            specs.append(RequestSpec(f"bursts-{i}", prompt, out,
                                     arrival_step=burst * BURST_GAP_STEPS + rng.randint(0, 50)))
    else:  # pressure
        n = requests or 500
        for i in range(n):
            specs.append(RequestSpec(f"pressure-{i}", _tokens(rng, rng.randint(64, 1024)),
                                     rng.randint(32, 512)))
    longest = max(specs, key=lambda r: r.prompt_len + r.max_tokens)
    if longest.prompt_len + longest.max_tokens > max_model_len:
        raise UserError(f"--max-model-len {max_model_len} is too short for the {name} "
                        f"workload: request {longest.request_id} takes {longest.prompt_len} "
                        f"prompt + {longest.max_tokens} output tokens: use at least "
                        f"{longest.prompt_len + longest.max_tokens}, or a --trace")
    return Workload(name, specs, concurrency)


# ---------------------------------------------------------------- two engines, one GPU
#: workloads of ``proxima replay --engines 2`` (:mod:`proxima.replay.shared_gpu`): a pair
#: of request lists, one per engine, of the same prefill-heavy mix -- issue 33's GPU burst
#: shape (prompts of 2-6k tokens, outputs of 256-768) halved: prompts U[1024, 3072] tokens
#: (one of each engine's 4 shared 256-token system prompts, then the question), outputs
#: U[128, 384] -- in two shapes:
#:   alternating-bursts  one engine busy while the other idles, then the other: 2 x 3
#:                       bursts (A, B, A, B, A, B), TWO_BURST_GAP_STEPS apart, each of
#:                       requests / 6 arriving within 50 steps
#:   steady              both engines busy all the time, the same requests: a closed loop
#:                       of ``in_flight`` requests on each (the caller sizes it)
TWO_ENGINE_WORKLOADS = ("alternating-bursts", "steady")
TWO_ENGINE_REQUESTS = 288
TWO_BURST_ROUNDS, TWO_BURST_GAP_STEPS, TWO_PREFIX_TOKENS = 3, 1200, 256
TWO_PROMPT, TWO_OUTPUT = (1024, 3072), (128, 384)


@dataclass(frozen=True)
class TwoEngineWorkload:
    name: str
    engines: tuple[Workload, Workload]


def make_two_engine_workload(name: str, requests: int | None = None, seed: int = 0,
                             max_model_len: int = 8192,
                             in_flight: int | None = None) -> TwoEngineWorkload:
    """One of :data:`TWO_ENGINE_WORKLOADS`: ``requests`` in all (default
    :data:`TWO_ENGINE_REQUESTS`), half on each engine; ``in_flight``: steady's closed loop
    on each engine (required there)."""
    if name not in TWO_ENGINE_WORKLOADS:
        raise UserError(f"unknown two-engine workload {name!r}: choose one of "
                        f"{', '.join(TWO_ENGINE_WORKLOADS)}")
    check_sizes(requests, max_model_len)
    n = requests or TWO_ENGINE_REQUESTS
    need = TWO_PROMPT[1] + TWO_OUTPUT[1]
    if max_model_len < need:
        raise UserError(f"--max-model-len {max_model_len} is too short for the {name} "
                        f"workload (its requests take up to {TWO_PROMPT[1]} prompt + "
                        f"{TWO_OUTPUT[1]} output tokens): use at least {need}")
    if n < 2:
        raise UserError(f"--requests {n} leaves an engine without requests: use at least 2")
    if name == "steady" and (in_flight is None or in_flight < 1):
        raise ValueError(f"steady needs in_flight >= 1, got {in_flight!r}")
    rng = random.Random(f"two-engines:{seed}")
    bursts = 2 * TWO_BURST_ROUNDS
    per_burst = -(-n // bursts)
    specs: tuple[list, list] = ([], [])
    for e, tag in enumerate("AB"):
        prefixes = [_tokens(rng, TWO_PREFIX_TOKENS) for _ in range(4)]
        count = n // 2 + (n % 2 if e == 0 else 0)
        for i in range(count):
            prompt = prefixes[rng.randrange(4)] + _tokens(
                rng, rng.randint(*TWO_PROMPT) - TWO_PREFIX_TOKENS)
            out = rng.randint(*TWO_OUTPUT)
            burst = 2 * (i // per_burst) + e              # A: 0, 2, 4; B: 1, 3, 5
            jitter = rng.randint(0, 50)                   # drawn for both: same requests
            arrival = burst * TWO_BURST_GAP_STEPS + jitter if name == "alternating-bursts" \
                else 0
            specs[e].append(RequestSpec(f"{tag}-{i}", prompt, out, arrival_step=arrival))
    concurrency = in_flight if name == "steady" else None
    return TwoEngineWorkload(name, tuple(Workload(f"{name}:{tag}", s, concurrency)
                                         for tag, s in zip("AB", specs)))


TRACE_KEYS = ("prompt_len", "output_len", "prefix_id", "prefix_len", "arrival_step")
# How a trace file is read: a line is a small object (~100 bytes), so these bounds only
# stop hostile or mistaken files (a 1 GB line, /dev/zero, [[[[...]]]], a 5,000-digit number)
# before they exhaust memory or the parser's recursion.
TRACE_MAX_LINE_BYTES = 65_536
TRACE_MAX_BYTES = 256 * 2**20
TRACE_MAX_DEPTH = 8
TRACE_MAX_NUMBER_CHARS = 20
_TRACE_EXAMPLE = '{"prompt_len": 100, "output_len": 50}'


def check_sizes(requests: int | None = None, max_model_len: int | None = None) -> None:
    """Refuse sizes that would exhaust memory before any work starts (one line, the bound)."""
    if requests is not None:
        if requests < 1:
            raise UserError(f"--requests must be >= 1, got {requests}")
        if requests > MAX_REQUESTS:
            raise UserError(f"--requests {requests:,} is above the bound of {MAX_REQUESTS:,} "
                            f"(every request's prompt is built in memory first): use at most "
                            f"{MAX_REQUESTS:,}")
    if max_model_len is not None:
        if max_model_len < 2:
            raise UserError(f"--max-model-len must be >= 2, got {max_model_len}")
        if max_model_len > MAX_MODEL_LEN:
            raise UserError(f"--max-model-len {max_model_len:,} is above the bound of "
                            f"{MAX_MODEL_LEN:,} tokens: use at most {MAX_MODEL_LEN:,}")


_FILE_TYPES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _open_trace(path: Path):
    """The trace opened for reading, once it is known to be a regular file: a FIFO is
    opened without waiting for a writer, and refused, as are devices (/dev/zero, endless)
    and directories."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except IsADirectoryError:
        raise UserError(f"cannot read trace {path}: it is a directory (give a .jsonl file)") from None
    except OSError as exc:
        raise UserError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UserError(f"cannot read trace {path}: it is a directory (give a .jsonl file)")
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _FILE_TYPES if test(mode)), "an unusual file")
            raise UserError(f"cannot read trace {path}: it is {what}, not a regular file: a "
                            f"trace is a JSON Lines file on disk (copy the stream to a file "
                            f"first)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _trace_lines(path: Path):
    """(line number, text) of a trace file, read as UTF-8 line by line, within the bounds
    TRACE_MAX_LINE_BYTES (a line) and TRACE_MAX_BYTES (the file)."""
    total = 0
    with _open_trace(path) as handle:
        lineno = 0
        while True:
            raw = handle.readline(TRACE_MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > TRACE_MAX_LINE_BYTES:
                raise UserError(f"{path}:{lineno}: the line is longer than the bound of "
                                f"{TRACE_MAX_LINE_BYTES:,} bytes (a trace line is one small "
                                f"object like {_TRACE_EXAMPLE}; is this a JSON Lines file?)")
            total += len(raw)
            if total > TRACE_MAX_BYTES:
                raise UserError(f"{path}:{lineno}: the file passes the bound of "
                                f"{TRACE_MAX_BYTES:,} bytes read (a trace of "
                                f"{MAX_REQUESTS:,} requests is far smaller): shorten it")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                                f"at column {exc.start + 1}): a trace is a JSON Lines text "
                                f"file, one request per line") from None
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]                 # a byte-order mark, as some editors write
            if "\x00" in text:
                raise UserError(f"{path}:{lineno}: holds a NUL byte: a trace is a JSON Lines "
                                f"text file, one request per line (is this a binary file?)")
            yield lineno, text


class _TraceLineError(ValueError):
    """A trace line past a bound of the parser (its message says which)."""


def _bounded_number(convert):
    def parse(text: str):
        if len(text) > TRACE_MAX_NUMBER_CHARS:
            raise _TraceLineError(f"a number of {len(text):,} characters ({text[:12]}...) "
                                  f"is longer than the bound of {TRACE_MAX_NUMBER_CHARS}")
        return convert(text)
    return parse


_parse_int, _parse_float = _bounded_number(int), _bounded_number(float)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _nesting(line: str) -> int:
    """How deep arrays and objects nest in the JSON text ``line`` (strings skipped)."""
    if line.count("[") + line.count("{") <= TRACE_MAX_DEPTH:
        return 0                               # cannot be deeper: the common case, fast
    depth = deepest = 0
    for char in _STRING.sub('""', line):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _parse_trace_line(line: str):
    """``json.loads`` within the trace bounds: nesting depth and number length (Python's
    own limits would end in a RecursionError or a ValueError, i.e. a traceback)."""
    depth = _nesting(line)
    if depth > TRACE_MAX_DEPTH:
        raise _TraceLineError(f"JSON nested {depth:,} deep, past the bound of "
                              f"{TRACE_MAX_DEPTH}")
    return json.loads(line, parse_int=_parse_int, parse_float=_parse_float,
                      object_pairs_hook=object_keys_once)


def load_trace(path: str | Path, seed: int = 0, max_model_len: int = 8192,
               limit: int | None = None) -> Workload:
    """Read a JSONL trace (see the module docstring). Errors name the line and the field.

    ``limit``: read only the first ``limit`` requests (``--requests N``). A trace longer
    than :data:`MAX_REQUESTS` requests, or holding more than :data:`MAX_PROMPT_TOKENS`
    prompt tokens, is refused (with the bound) before its prompts are built."""
    path = Path(path)
    check_sizes(limit, max_model_len)
    rng = random.Random(f"trace:{seed}")
    rows = []
    prompt_total = 0
    for lineno, line in _trace_lines(path):
        if not line.strip():
            continue
        if limit is not None and len(rows) >= limit:
            break
        where = f"{path}:{lineno}"
        if len(rows) >= MAX_REQUESTS:
            raise UserError(f"trace {path} holds more than {MAX_REQUESTS:,} requests (the "
                            f"bound): pass --requests N (at most {MAX_REQUESTS:,}) to use "
                            f"its first N")
        try:
            row = _parse_trace_line(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg}): a trace line looks like "
                            f'{{"prompt_len": 100, "output_len": 50}}') from None
        except (_TraceLineError, KeyTwice) as exc:
            raise UserError(f"{where}: {exc}: a trace line looks like {_TRACE_EXAMPLE}") from None
        except (ValueError, RecursionError) as exc:   # any other limit of the parser
            raise UserError(f"{where}: not JSON that can be read ({exc}): a trace line "
                            f"looks like {_TRACE_EXAMPLE}") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object like "
                            f'{{"prompt_len": 100, "output_len": 50}}, got {line.strip()[:60]}')
        unknown = [k for k in row if k not in TRACE_KEYS]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), TRACE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(TRACE_KEYS)}"
            raise UserError(f"{where}: unknown key {key!r}: {hint}")
        values = {}
        for key, required, low in (("prompt_len", True, 1), ("output_len", True, 1),
                                   ("arrival_step", False, 0), ("prefix_len", False, 0)):
            value = row.get(key)
            if value is None:
                if required:
                    raise UserError(f"{where}: missing {key!r} (a trace line looks like "
                                    f'{{"prompt_len": 100, "output_len": 50}})')
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UserError(f"{where}: {key} must be an integer >= {low}, got "
                                f"{json.dumps(value)[:40]}")     # as written: true, "10"
            values[key] = value
        prompt_len, output_len = values["prompt_len"], values["output_len"]
        if prompt_len + output_len > max_model_len:
            raise UserError(f"{where}: prompt_len + output_len = {prompt_len + output_len} "
                            f"exceeds the model length {max_model_len} (raise --max-model-len "
                            f"or shorten the request)")
        prompt_total += prompt_len
        if prompt_total > MAX_PROMPT_TOKENS:
            raise UserError(f"trace {path}: its prompts pass the bound of "
                            f"{MAX_PROMPT_TOKENS:,} tokens at line {lineno} (they are built "
                            f"in memory): pass --requests N to use fewer")
        rows.append((lineno, row, values))
    if not rows:
        raise UserError(f"trace {path} holds no requests (a trace line looks like "
                        f'{{"prompt_len": 100, "output_len": 50}})')
    if limit is not None and len(rows) < limit:     # it ran fewer than asked, silently
        raise UserError(f"--requests {limit:,}: trace {path} holds only {len(rows):,} "
                        f"request{'s' if len(rows) > 1 else ''}: give --requests {len(rows):,} "
                        f"or fewer, or leave --requests out (all its lines)")
    prefixes: dict[str, list[int]] = {}
    specs = []
    for lineno, row, values in rows:
        prompt_len = values["prompt_len"]
        tokens: list[int] = []
        if row.get("prefix_id") is not None:
            key = str(row["prefix_id"])
            shared = min(values.get("prefix_len", 256), prompt_len)
            prefix = prefixes.setdefault(key, [])
            if len(prefix) < shared:
                prefix += _tokens(rng, shared - len(prefix))
            tokens = prefix[:shared]
        tokens = tokens + _tokens(rng, prompt_len - len(tokens))
        specs.append(RequestSpec(f"trace-{lineno}", tokens, values["output_len"],
                                 values.get("arrival_step", 0)))
    return Workload(f"trace:{path.name}", specs)
