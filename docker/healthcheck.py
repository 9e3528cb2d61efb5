"""The health check of every Proxima image: exit 0 when `proxima serve` answers GET /health
with 200, else exit 1 with one line saying what was seen.

/health answers 503 until the start-up self-check (canary included) has passed and whenever
the engine is down, so a container is healthy exactly when it serves. The URL is
PROXIMA_HEALTH_URL, default http://127.0.0.1:8000/health (the images' port). Standard library
only: it runs with the image's own Python (no curl, no shell in the images).

    Nix image:        HEALTHCHECK CMD <env>/bin/python <store>/healthcheck.py
    docker/Dockerfile HEALTHCHECK CMD python3 /usr/local/bin/proxima-healthcheck
    build-oci.sh:     the same, with /usr/bin/python3.11
"""

import os
import sys
import urllib.error
import urllib.request

URL = os.environ.get("PROXIMA_HEALTH_URL", "http://127.0.0.1:8000/health")
TIMEOUT_S = float(os.environ.get("PROXIMA_HEALTH_TIMEOUT", "5"))


def main() -> int:
    try:
        with urllib.request.urlopen(URL, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"proxima-healthcheck: {URL}: no answer ({reason})", file=sys.stderr)
        return 1
    if status != 200:
        print(f"proxima-healthcheck: {URL} answered {status} (503: self-check not passed yet, "
              "or the engine is down)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
