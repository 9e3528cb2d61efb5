"""The stand-in OpenAI server of conftest.py in its own process, so that a test can watch
it die: ``python -m tests.bench.standin_server --die-after K [--delay S]`` prints its URL
on one line, serves until the K-th generation request is half streamed, then SIGKILLs
itself (open connections are cut, later ones refused), as a crashed server does."""

from __future__ import annotations

import argparse
import sys
import time

from tests.bench.conftest import FakeOpenAIServer, ServerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.001)
    args = parser.parse_args()
    server = FakeOpenAIServer(ServerConfig(delay=args.delay, die_after=args.die_after)).start()
    print(server.url, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
