"""What the GPUs ran at during a device call: one line per GPU from run.sh's samples.

    python3 tools/gpu/gpu_clocks.py $OUT/gpu-clocks.csv

run.sh samples ``nvidia-smi --query-gpu=`` FIELDS (below) every 2 s while its lanes run.
Why: two H100 machines of the same name ran the same schedule (the elastic engine's 784
steps of 979.3 tokens on the short bursts) at 50.4 ms a step in session 30 and 41.4 ms in
session 31, while small steps differed by ~3 %. A ratio is only measured within one
machine; across machines, clocks, power and the reasons the driver gives for slowing them
are what can tell a slower GPU from a slower setup.

A sample counts as under load when its power is above ``LOAD_W``; the line gives, over those
samples, the mean SM clock, the mean and the limit of power, the highest temperature, and
each reason the driver gave for holding the clocks down (``clocks_event_reasons.active``,
a bit mask; idle is not counted) with how many samples it was active in.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

FIELDS = ("timestamp,index,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,"
          "clocks_event_reasons.active")
LOAD_W = 200.0
# nvidia-smi's clocks event reasons (nvml.h), the bits that say why clocks are held down
REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown",
           0x10: "sync-boost", 0x20: "sw-thermal", 0x40: "hw-thermal",
           0x80: "hw-power-brake", 0x100: "display-clocks"}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:          # "[N/A]", "[Not Supported]"
        return None


def summary(lines) -> list[str]:
    """One line per GPU index seen in ``lines`` (csv, noheader, nounits, FIELDS' order)."""
    load: dict[str, list[tuple]] = defaultdict(list)
    seen: Counter = Counter()
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7:      # the reasons' field may be missing (run.sh's fallback)
            continue
        gpu = cells[1]
        seen[gpu] += 1
        sm, power, limit, temp = (_number(cells[i]) for i in (2, 4, 5, 6))
        if power is not None and power > LOAD_W:
            try:
                mask = int(cells[7], 16) if len(cells) > 7 else 0
            except ValueError:
                mask = 0
            load[gpu].append((sm, power, limit, temp, mask))
    out = []
    for gpu in sorted(seen, key=lambda g: int(g) if g.isdigit() else 0):
        rows = load.get(gpu, [])
        if not rows:
            out.append(f"GPU {gpu}: {seen[gpu]} samples, none under load (power above "
                       f"{LOAD_W:.0f} W)")
            continue
        def mean(i):
            values = [r[i] for r in rows if r[i] is not None]
            return sum(values) / len(values) if values else float("nan")
        reasons: Counter = Counter()
        for *_, mask in rows:
            for bit, name in REASONS.items():
                if mask & bit and name != "idle":
                    reasons[name] += 1
        said = ", ".join(f"{name} in {n}" for name, n in reasons.most_common()) or "none"
        temps = [r[3] for r in rows if r[3] is not None]
        out.append(f"GPU {gpu} under load ({len(rows)} of {seen[gpu]} samples above "
                   f"{LOAD_W:.0f} W): SM clock mean {mean(0):.0f} MHz, power mean "
                   f"{mean(1):.0f} W of a {mean(2):.0f} W limit, temperature max "
                   f"{max(temps) if temps else float('nan'):.0f} C, clocks held down: {said}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_clocks.py FILE (run.sh's gpu-clocks.csv)", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            lines = summary(f)
    except OSError as exc:
        print(f"gpu_clocks: cannot read {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 1
    print("\n".join(lines) if lines else f"gpu_clocks: no samples in {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
