"""A CPU stand-in for ``proxima serve --models FILE`` (``three_models.py --dry-run``): the
REAL multi-model endpoint (proxima.serve.multi's Endpoint: the router and the supervisor),
over one ``fake_server.py --elastic`` per model in place of each model's ``proxima serve
PATH`` (no GPU probe, no vLLM, no sizing). It reads the same models file (JSON: ``port``,
``models`` with ``name``); the rest of each model's options is ignored. It checks the
driver's orchestration and the routing by "model", nothing about memory."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from proxima.serve import multi  # noqa: E402
from proxima.serve.router import Backend  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--models", required=True)
    args = ap.parse_args()
    plan = json.loads(Path(args.models).read_text())
    engines, taken = [], {args.port}
    for spec in plan["models"]:
        port = spec.get("port") or multi.free_port(avoid=taken)   # the file's, as serve
        taken.add(port)
        engines.append(multi.Engine(
            backend=Backend(name=spec["name"], url=f"http://127.0.0.1:{port}",
                            path=spec.get("path")),
            command=[sys.executable, str(ROOT / "tools" / "gpu" / "fake_server.py"),
                     "--port", str(port), "--served-model-name", spec["name"], "--elastic",
                     "--delay", "0.5"],
            env={**os.environ, "PYTHONPATH": str(ROOT)}))
    print(f"fake multi-model endpoint on 127.0.0.1:{args.port}: "
          f"{', '.join(s['name'] for s in plan['models'])}", flush=True)
    return asyncio.run(multi.serve(engines, "127.0.0.1", args.port, health_interval=0.2))


if __name__ == "__main__":
    sys.exit(main())
