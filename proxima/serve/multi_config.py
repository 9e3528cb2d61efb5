"""Several models behind one endpoint: what ``proxima serve`` reads from its command line and
from a models file, checked before anything starts.

Command line (every ``--model`` value is ONE argument: quote it)::

    proxima serve --model 'chat=/models/llama-8b --max-model-len 4096 --kv-max 20GiB' \\
                  --model 'small=/models/qwen-0.5b --kv-cache-memory-bytes 4GiB' \\
                  [--models FILE] [--host H] [--port P] [--compaction] [options for every model]

``NAME=PATH`` names the model (the ``model`` clients send) and where it is (a directory
with config.json, or a Hugging Face id); the tokens after it are that model's own ``vllm
serve`` options, plus Proxima's ``--kv-min``/``--kv-max``/``--idle-release``/
``--sleep-after``/``--elastic-options`` and the engine's local ``--port``. Options outside ``--model`` (other
than ``--host``, ``--port``, ``--models``, ``--compaction``, ``--gpu-memory-bytes``) are given
to every engine.

Models file (``--models FILE``; TOML, or JSON when the name ends in ``.json``)::

    host = "0.0.0.0"          # the endpoint (optional; the command line wins)
    port = 8000
    compaction = false
    gpu_memory_bytes = "80GiB"            # size for a GPU of this many bytes (optional)
    args = ["--enforce-eager"]            # for every model (optional)

    [[models]]
    name = "chat"
    path = "/models/llama-8b"
    args = ["--max-model-len", "4096"]    # or one string: "--max-model-len 4096"
    kv_min = "2GiB"
    kv_max = "20GiB"
    idle_release = 300                    # --idle-release SECONDS (optional)
    sleep_after = 900                     # --sleep-after SECONDS (optional; implies
                                          # the idle release, at most this)
    port = 8101                           # the engine's local port (optional)

Every check raises :class:`~proxima.errors.UserError` with one line. Last, what each engine
is started with: its command (:func:`engine_command`), its environment (:func:`engine_env`)
and a free local port.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from proxima.errors import UserError
from proxima.ioutil import KeyTwice, object_keys_once, shown
from proxima.serve.argv import flag_value, given, option_name
from proxima.serve.serve_flags import ELASTIC_FLAGS

#: a model's name: what clients put in "model" (Hugging Face style ids allowed, and a model
#: directory's absolute path, which is what ``vllm serve PATH`` serves)
NAME_RE = re.compile(r"^[A-Za-z0-9/][A-Za-z0-9._:/@+-]{0,127}$")
TOP_KEYS = ("host", "port", "compaction", "args", "models", "gpu_memory_bytes")
MODEL_KEYS = ("name", "path", "args", "kv_min", "kv_max", "port", "idle_release",
              "sleep_after")
#: per-model flags taken out of a model's options (Proxima's, not vLLM's)
MODEL_FLAGS = ("--port", "--kv-min", "--kv-max", "--idle-release", "--sleep-after")
#: per-model options that the multi-model layout sets itself
RESERVED = {
    "--host": "every engine listens on 127.0.0.1; --host belongs to the endpoint (outside --model)",
    "--uds": "every engine listens on a local TCP port",
    "--served-model-name": "the NAME in NAME=PATH is the served name",
    "--model": "the PATH in NAME=PATH is the model",
    "--models": "--models belongs to the endpoint (outside --model)",
    "--compaction": "--compaction applies to every engine: give it outside --model",
    "--gpu-memory-bytes": "the GPU's size applies to every engine: give it outside --model",
}
#: options of the endpoint (outside --model): flag -> takes a value
ENDPOINT_FLAGS = {"--host": True, "--port": True, "--models": True, "--model": True,
                  "--compaction": False, "--elastic": False, "--gpu-memory-bytes": True}
#: every option of ``proxima serve`` that is Proxima's, not vLLM's (for "did you mean")
OWN_FLAGS = tuple(sorted({*ENDPOINT_FLAGS, *MODEL_FLAGS, *ELASTIC_FLAGS}))


@dataclass
class ModelSpec:
    name: str
    path: str
    args: list[str] = field(default_factory=list)   # the model's own vllm serve options
    kv_min: str | None = None
    kv_max: str | None = None
    idle_release: str | None = None                 # --idle-release SECONDS
    sleep_after: float | None = None                # --sleep-after SECONDS (checked)
    port: int | None = None                         # the engine's local port (None: pick one)
    origin: str = ""                                # where it was given, for error lines

    def elastic_args(self) -> list[str]:
        out = []
        if self.kv_min is not None:
            out += ["--kv-min", str(self.kv_min)]
        if self.kv_max is not None:
            out += ["--kv-max", str(self.kv_max)]
        if self.idle_release is not None:
            out += ["--idle-release", str(self.idle_release)]
        elif self.sleep_after is not None:      # implied: the KV goes before the weights
            out += ["--idle-release", f"{self.sleep_after:g}"]
        if self.sleep_after is not None:
            out += ["--sleep-mode"]
        return out


@dataclass
class MultiPlan:
    models: list[ModelSpec]
    host: str | None = None
    port: int | None = None
    compaction: bool = False
    common: list[str] = field(default_factory=list)   # vllm serve options for every engine
    gpu_bytes: int | None = None                      # --gpu-memory-bytes (None: the GPU's)


def wants_multi(argv: list[str]) -> bool:
    """The command line asks for the several-models layout: ``--models FILE`` or a
    ``--model NAME=PATH`` (vLLM's own ``--model PATH`` has no ``=`` in its first word)."""
    for i, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if flag == "--models":
            return True
        if flag == "--model":
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            words = value.split()
            if words and "=" in words[0]:
                return True
    return False


def one_model_endpoint(argv: list[str]) -> list[str] | None:
    """``proxima serve MODEL [options] --sleep-after S`` -> the command line of the endpoint
    of that one model (``--model 'NAME=MODEL --sleep-after S [options]'``), or None without
    ``--sleep-after``. A model that sleeps needs the endpoint's router in front of its engine
    to hold its next request and wake it. NAME is what ``vllm serve`` would serve: the one
    ``--served-model-name``, else MODEL. The endpoint's options (``--host``, ``--port``,
    ``--compaction``, ``--gpu-memory-bytes``) stay the endpoint's; the others are the model's,
    checked as they are inside ``--model``."""
    if not given(argv, "--sleep-after"):
        return None
    model = argv[0] if argv and not argv[0].startswith("-") else None
    endpoint, own, names = [], [], []
    i = 1 if model else 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        norm = option_name(token)
        if norm in ("--model", "--served-model-name"):
            value, i = flag_value(argv, i, inline if eq else None, f"{norm} needs a value")
            if norm == "--served-model-name":
                names.append(value)
                while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    i += 1                  # vLLM takes several names after one flag
                    names.append(argv[i])
            elif model is not None:
                raise UserError(f"the model was given twice ({model!r} and --model {value!r}): "
                                f"give it once")
            else:
                model = value
        elif norm in ENDPOINT_FLAGS:        # --models: wants_multi() took it
            endpoint.append(token)
            if ENDPOINT_FLAGS[norm] and not eq:
                value, i = flag_value(argv, i, None, f"{norm} needs a value")
                endpoint.append(value)
        else:
            own.append(token)
        i += 1
    if model is None:
        raise UserError("--sleep-after needs the model: proxima serve MODEL --sleep-after "
                        "SECONDS (or several models: --model 'NAME=PATH --sleep-after SECONDS')")
    if len(names) > 1:
        raise UserError(f"--served-model-name with --sleep-after takes one name, got "
                        f"{len(names)} ({' '.join(names)}): the endpoint routes one name to "
                        f"the model")
    name = names[0] if names else model
    if not NAME_RE.match(name):
        raise UserError(f"--sleep-after: the model would be served as {name!r}, not a name "
                        f"the endpoint routes (letters, digits and . _ - : / @ +, at most 128, "
                        f"starting with a letter, a digit or /): give --served-model-name NAME")
    return ["--model", shlex.join([f"{name}={model}", *own]), *endpoint]


def _written(value) -> str:
    """A value as the file could write it ('x', true, [1], null), not as Python's repr
    (True, None); a text as the command line's values are shown, quoted."""
    return repr(value)[:60] if isinstance(value, str) else json.dumps(value, default=str)[:60]


def _port(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UserError(f"{where}: the port must be an integer, got {_written(value)}")
    try:
        port = int(value)
    except ValueError:
        raise UserError(f"{where}: the port must be an integer, got {_written(value)}") from None
    if not 1 <= port <= 65535:
        raise UserError(f"{where}: port {port} is out of range: use 1-65535")
    return port


def _split_model_args(args: list[str], spec: ModelSpec, where: str) -> None:
    """Take --port, --kv-min, --kv-max out of a model's own options; refuse reserved ones."""
    rest, i = [], 0
    while i < len(args):
        token = args[i]
        flag, eq, inline = token.partition("=")
        norm = option_name(token)
        if norm in RESERVED:
            raise UserError(f"{where}: {norm} cannot be given for one model: {RESERVED[norm]}")
        if norm in MODEL_FLAGS:
            value, i = flag_value(args, i, inline if eq else None, f"{where}: {norm} needs a value")
            if norm == "--port":
                spec.port = _port(value, f"{where}: --port")
            elif norm == "--sleep-after":
                spec.sleep_after = sleep_seconds(value, f"{where}: --sleep-after")
            else:
                setattr(spec, norm[2:].replace("-", "_"), value)
        elif norm == "--elastic":
            pass                            # every engine is elastic already
        else:
            rest.append(token)
        i += 1
    spec.args = rest + spec.args


#: the shortest --sleep-after: a sleep and a wake take seconds each
MIN_SLEEP_AFTER_S = 1.0


def sleep_seconds(value, where: str) -> float:
    """``--sleep-after`` / ``sleep_after``: seconds from :data:`MIN_SLEEP_AFTER_S` to a day."""
    from proxima.config import MAX_DELAY_S, parse_number

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UserError(f"{where}: must be seconds (a number), got {value!r}")
    return float(parse_number(value, where, least=MIN_SLEEP_AFTER_S, most=MAX_DELAY_S,
                              unit="seconds"))


def check_sleep_after(spec: ModelSpec, common: list[str]) -> None:
    """A model's ``--sleep-after`` against its idle release and its elastic options: one
    UserError line. (Every engine of the several-models serve is elastic; an
    ``--elastic-options`` policy other than auto has no idle release.)"""
    if spec.sleep_after is None:
        return
    from proxima.config import MAX_DELAY_S, parse_number, parse_options_text

    where = f"model {spec.name!r}: --sleep-after {spec.sleep_after:g}"
    if spec.idle_release is not None:
        release = float(parse_number(spec.idle_release, f"model {spec.name!r}: --idle-release",
                                     least=0, most=MAX_DELAY_S, unit="seconds"))
        if spec.sleep_after < release:
            raise UserError(f"{where} is below its --idle-release {spec.idle_release}: the "
                            f"model gives back its KV before its weights: give --sleep-after "
                            f"at least the idle release (or leave --idle-release out: it is "
                            f"then the --sleep-after)")
    tokens = [*common, *spec.args, ""]
    for i, token in enumerate(tokens[:-1]):
        flag, eq, inline = token.partition("=")
        if flag != "--elastic-options":
            continue
        options = parse_options_text(inline if eq else tokens[i + 1], "--elastic-options")
        if "idle_release_s" in options:
            raise UserError(f"{where}: give the idle release as --idle-release (at most the "
                            f"--sleep-after), not --elastic-options' idle_release_s")
        policy = options.get("policy", "auto")
        if policy != "auto":
            raise UserError(f"{where} needs elastic KV with policy auto (its idle release "
                            f"gives back the KV before the sleep), got --elastic-options "
                            f"policy={policy}: drop the policy, or --sleep-after")


def parse_model_option(value: str) -> ModelSpec:
    """``--model 'NAME=PATH [options...]'``."""
    where = f"--model {value!r}"
    try:
        tokens = shlex.split(value)
    except ValueError as exc:
        raise UserError(f"{where}: cannot split it into words ({exc}): quote it as one "
                        f"argument, e.g. --model 'chat=/models/llama --max-model-len 4096'") from None
    if not tokens or "=" not in tokens[0]:
        raise UserError(f"{where}: give NAME=PATH first, e.g. --model "
                        f"'chat=/models/llama --max-model-len 4096'")
    name, _, path = tokens[0].partition("=")
    spec = ModelSpec(name=name, path=path, origin=where)
    _check_name_path(spec, where)
    _split_model_args(tokens[1:], spec, f"--model {name}")
    return spec


def _check_name_path(spec: ModelSpec, where: str) -> None:
    if not NAME_RE.match(spec.name or ""):
        raise UserError(f"{where}: model name {spec.name!r} is not a valid name: use letters, "
                        f"digits and . _ - : / @ + (at most 128, starting with a letter, a digit or /)")
    if not spec.path:
        raise UserError(f"{where}: model {spec.name!r} has no path: give NAME=PATH (a model "
                        f"directory with config.json, or a Hugging Face id)")


def _args(value, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UserError(f"{where}: cannot split {value!r} into words ({exc})") from None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                       for v in value):
        return [str(v) for v in value]
    raise UserError(f"{where}: must be a list of strings or one string of options, got "
                    f"{shown(value)}")


def _unknown(key: str, known, where: str) -> UserError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f": did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
    return UserError(f"{where}: unknown field {key!r}{hint}")


def _size_value(value, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UserError(f"{where}: must be a size (bytes, or e.g. \"8GiB\"), got "
                        f"{_written(value)}")
    return str(value)


def load_models_file(path: str) -> MultiPlan:
    """A models file (TOML, or JSON for ``*.json``): syntax errors name the line, field
    errors the field (``models[2].kv_max``)."""
    if not path.strip():
        raise UserError(f"--models needs a file name, got {path!r}: give a TOML (or .json) "
                        f"file with one [[models]] table per model")
    file = Path(path).expanduser()
    if file.suffix.lower() in (".yaml", ".yml"):
        raise UserError(f"--models {path}: YAML is not read: write the same fields as TOML "
                        f"(or JSON, in a .json file), one [[models]] table per model (see "
                        f"proxima serve --help)")
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise UserError(f"--models {path}: the file {what}: give a TOML (or .json) file "
                        f"with one [[models]] table per model")
    try:
        text = file.read_text(encoding="utf-8-sig")     # an editor's BOM is no error
    except UnicodeDecodeError as exc:
        raise UserError(f"--models {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--models {path}: cannot read it ({exc.strerror})") from None
    if file.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=object_keys_once)
        except json.JSONDecodeError as exc:
            raise UserError(f"--models {path}:{exc.lineno}: not valid JSON ({exc.msg}, column "
                            f"{exc.colno})") from None
        except KeyTwice as exc:
            raise UserError(f"--models {path}: the key {exc.key!r} is given twice in one "
                            f"object: give it once (TOML refuses this too)") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            message = str(exc)
            line = re.search(r"at line (\d+)", message)
            if line:
                prefix = f"{path}:{line.group(1)}"
            elif "end of document" in message:
                prefix = f"{path}:{max(1, len(text.splitlines()))}"
            else:
                prefix = path
            raise UserError(f"--models {prefix}: not valid TOML ({message})") from None
    where = f"--models {path}"
    if not isinstance(data, dict):
        raise UserError(f"{where}: the top level must be a table/object, got {type(data).__name__}")
    for key in data:
        if key not in TOP_KEYS:
            raise _unknown(key, TOP_KEYS, where)
    plan = MultiPlan(models=[])
    if "host" in data:
        if not isinstance(data["host"], str) or not data["host"]:
            raise UserError(f"{where}: host must be a non-empty string, got "
                            f"{_written(data['host'])}")
        plan.host = data["host"]
    if "port" in data:
        plan.port = _port(data["port"], f"{where}: port")
    if "compaction" in data:
        if not isinstance(data["compaction"], bool):
            raise UserError(f"{where}: compaction must be true or false, got "
                            f"{_written(data['compaction'])}")
        plan.compaction = data["compaction"]
    if "gpu_memory_bytes" in data:
        from proxima.config import parse_size

        plan.gpu_bytes = parse_size(_size_value(data["gpu_memory_bytes"],
                                                f"{where}: gpu_memory_bytes"),
                                    f"{where}: gpu_memory_bytes", least=1)
    if "args" in data:
        plan.common = _args(data["args"], f"{where}: args")
        for token in plan.common:
            norm = option_name(token)
            if norm in RESERVED or norm in MODEL_FLAGS or norm == "--sleep-mode":
                raise UserError(f"{where}: args: {norm} cannot be given for every model here "
                                f"(per model: the [[models]] table; the endpoint: host/port)")
    models = data.get("models")
    if models is None or models == []:
        raise UserError(f"{where}: no models: add one [[models]] table per model (name, path)")
    if not isinstance(models, list):
        raise UserError(f"{where}: models must be a list of tables ([[models]]), got "
                        f"{type(models).__name__}")
    for n, entry in enumerate(models, 1):
        if not isinstance(entry, dict):
            raise UserError(f"{where}: models[{n}] must be a table (name, path), got "
                            f"{type(entry).__name__} {_written(entry)}")
    for n, entry in enumerate(models, 1):
        at = f"{where}: models[{n}]"
        for key in entry:
            if key not in MODEL_KEYS:
                raise _unknown(key, MODEL_KEYS, at)
        for key in ("name", "path"):
            if key not in entry:
                raise UserError(f"{at}: missing {key!r}")
            if not isinstance(entry[key], str):
                raise UserError(f"{at}.{key}: must be a string, got {_written(entry[key])}")
        spec = ModelSpec(name=entry["name"], path=entry["path"], origin=at)
        _check_name_path(spec, at)
        if "port" in entry:
            spec.port = _port(entry["port"], f"{at}.port")
        for key in ("kv_min", "kv_max"):
            if key in entry:
                setattr(spec, key, _size_value(entry[key], f"{at}.{key}"))
        if "idle_release" in entry:
            value = entry["idle_release"]
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise UserError(f"{at}.idle_release: must be seconds (a number), got "
                                f"{_written(value)}")
            spec.idle_release = str(value)
        if "sleep_after" in entry:
            spec.sleep_after = sleep_seconds(entry["sleep_after"], f"{at}.sleep_after")
        if "args" in entry:
            _split_model_args(_args(entry["args"], f"{at}.args"), spec, f"{at}.args")
        plan.models.append(spec)
    return plan


def parse_command_line(argv: list[str]) -> MultiPlan:
    """The several-models command line (see the module's docstring) -> a plan, merged with
    ``--models FILE`` if given. Only the syntax is checked here: :func:`check_plan` next."""
    cli_models: list[ModelSpec] = []
    files: list[str] = []
    host = port = None
    compaction = False
    gpu_bytes = None
    common: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if flag in ENDPOINT_FLAGS and token.startswith("--"):
            if ENDPOINT_FLAGS[flag]:
                value, i = flag_value(argv, i, inline if eq else None, f"{flag} needs a value")
                if flag == "--model":
                    cli_models.append(parse_model_option(value))
                elif flag == "--models":
                    files.append(value)
                elif flag == "--host":
                    host = value
                elif flag == "--gpu-memory-bytes":
                    from proxima.config import parse_size

                    gpu_bytes = parse_size(value, flag, least=1)
                else:
                    port = _port(value, "--port")
            elif eq:
                raise UserError(f"{flag} takes no value, got {token!r}")
            elif flag == "--compaction":
                compaction = True
            i += 1
            continue
        if not token.startswith("-") and not common:
            raise UserError(f"{token!r}: with several models give each as --model NAME=PATH "
                            f"(or in --models FILE), not as a positional MODEL")
        name = option_name(token)
        if name == "--sleep-after":
            raise UserError("--sleep-after is per model: give it inside --model 'NAME=PATH "
                            "--sleep-after SECONDS' (or sleep_after in the models file)")
        if name in ("--served-model-name", "--uds"):
            raise UserError(f"{flag} cannot be given with several models: {RESERVED[name]}")
        common.append(token)
        i += 1
    if len(files) > 1:
        raise UserError(f"--models was given {len(files)} times ({', '.join(files)}): give one file")
    plan = load_models_file(files[0]) if files else MultiPlan(models=[])
    plan.models += cli_models
    plan.host = host if host is not None else plan.host
    plan.port = port if port is not None else plan.port
    plan.compaction = compaction or plan.compaction
    plan.gpu_bytes = gpu_bytes if gpu_bytes is not None else plan.gpu_bytes
    plan.common = plan.common + common
    return plan


def check_plan(plan: MultiPlan, check_model=None) -> None:
    """Names unique, model directories present, ports distinct. ``check_model(path)``
    raises UserError for a bad model path (``proxima.serve.validate.check_model``)."""
    if not plan.models:
        raise UserError("no models: give --model NAME=PATH (repeatable) or --models FILE")
    seen: dict[str, ModelSpec] = {}
    for spec in plan.models:
        if spec.name in seen:
            raise UserError(f"model name {spec.name!r} is given twice ({seen[spec.name].origin} "
                            f"and {spec.origin}): every model needs its own name")
        seen[spec.name] = spec
    for spec in plan.models:
        check_sleep_after(spec, plan.common)
    for spec in plan.models:
        if check_model is not None:
            try:
                check_model(spec.path)
            except UserError as exc:
                raise UserError(f"model {spec.name!r}: {exc}") from None
    endpoint = plan.port if plan.port is not None else 8000
    ports: dict[int, str] = {}
    for spec in plan.models:
        if spec.port is None:
            continue
        if spec.port == endpoint:
            raise UserError(f"model {spec.name!r}: port {spec.port} is the endpoint's port: give "
                            f"the engine another port (or none: one is picked)")
        if spec.port in ports:
            raise UserError(f"models {ports[spec.port]!r} and {spec.name!r} are both given port "
                            f"{spec.port}: every engine needs its own port (or none: one is picked)")
        ports[spec.port] = spec.name


# -- what each engine is started with -------------------------------------------------------
ENGINE_HOST = "127.0.0.1"


def free_port(host: str = ENGINE_HOST, avoid: set[int] = frozenset()) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def engine_command(spec: ModelSpec, port: int, plan: MultiPlan) -> list[str]:
    """The single-model ``proxima serve`` of one model: local, elastic, named."""
    return [sys.executable, "-m", "proxima.cli", "serve", spec.path, "--host", ENGINE_HOST,
            "--port", str(port), "--served-model-name", spec.name, "--elastic",
            *(["--compaction"] if plan.compaction else []),
            *(["--gpu-memory-bytes", str(plan.gpu_bytes)] if plan.gpu_bytes else []),
            *plan.common, *spec.args, *spec.elastic_args()]


# vLLM's workers meet on a torch.distributed port that vLLM takes as the first free one from
# VLLM_PORT up (or, unset, one the OS picks). Engines started side by side all look before any
# binds: on the H100 two of them both took VLLM_PORT=20000 and one failed (EADDRINUSE). Each
# engine searches from its own base instead.
VLLM_PORT_STRIDE = 100


def engine_env(index: int, count: int, environ=os.environ) -> dict:
    """Engine ``index`` (of ``count``)'s environment: the parent's, less its stats file, and
    where VLLM_PORT is set, ``index`` strides above it."""
    env = dict(environ)
    env.pop("PROXIMA_STATS_FILE", None)     # each engine writes its own (a temporary file)
    base = environ.get("VLLM_PORT")
    if not base:
        return env
    highest = 65535 - VLLM_PORT_STRIDE * count
    try:
        first = int(base)
    except ValueError:
        raise UserError(f"VLLM_PORT must be a port number, got {base!r}: unset it (vLLM then "
                        f"asks the OS) or give one from 1 to {highest}") from None
    if not 1 <= first <= highest:
        raise UserError(f"VLLM_PORT must leave {VLLM_PORT_STRIDE} ports to each of the "
                        f"{count} models (from 1 to {highest}), got {base!r}: unset it or give "
                        f"one in that range")
    env["VLLM_PORT"] = str(first + index * VLLM_PORT_STRIDE)
    return env
