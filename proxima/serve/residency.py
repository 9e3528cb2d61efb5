"""More models than fit at once, as long as the active ones fit (issue 36, item 3): which
models of the several-models ``proxima serve`` are awake on the GPU. Pure Python.

Each model's place on the GPU is counted as the engines' own sizing counts it
(:func:`proxima.serve.sizing.plan`, from the GPU's ledger; bytes estimated from each
config.json): **awake**, its non-KV memory plus its ``--kv-min``; **asleep** (a model given
``--sleep-after``), that less its weights: vLLM's sleep frees the weights, and the sleeping
engine's ledger record counts the rest (CUDA context, activations' estimate) and its
minimum still. ``capacity``: the GPU's memory less what the engines already on it when
``proxima serve`` started keep.

- :func:`check`: before anything starts, the models that never sleep, every sleeper as it
  sleeps, and the largest sleeper's weights (the one that wakes) must fit; else one line.
- :func:`start_plan`: engines start one after another; when the next would not fit, the
  least recently used awake sleeper is put to sleep first (at start-up: the first started).
- :func:`victim`: the same choice at run time (:mod:`proxima.serve.sleepwake`), among the
  awake sleepers that are ready and have no request in flight.
- :func:`side_by_side`: whether the engines may start all at once instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.errors import UserError

GiB = 2**30


@dataclass(frozen=True)
class Place:
    """One model's bytes on the GPU: awake, and asleep (None: it never sleeps)."""

    name: str
    awake: int
    asleep: int | None = None

    @property
    def sleeps(self) -> bool:
        return self.asleep is not None

    @property
    def freed(self) -> int:
        """What its sleep gives back (0: it never sleeps)."""
        return self.awake - self.asleep if self.asleep is not None else 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def check(places: list[Place], gpu_total: int, others_claim: int = 0, others: int = 0, *,
          source: str = "the GPU", unknown=()) -> int:
    """The models with sleepers among them fit: those that never sleep awake, every sleeper
    asleep, and the largest sleeper's weights on top (the one woken). Returns the bytes
    needed; UserError (one line: the figures, what to do) when they do not fit."""
    never = [p for p in places if not p.sleeps]
    sleepers = [p for p in places if p.sleeps]
    largest = max(sleepers, key=lambda p: p.freed)
    need = (others_claim + sum(p.awake for p in never) + sum(p.asleep for p in sleepers)
            + largest.freed)
    if need <= gpu_total:
        return need
    parts = [f"{p.name} {_gib(p.awake)}" for p in never]
    parts.append(f"{largest.name} {_gib(largest.awake)} (the largest that may sleep)")
    rest = [p for p in sleepers if p is not largest]
    if rest:
        parts.append(f"{', '.join(p.name for p in rest)} asleep "
                     f"{_gib(sum(p.asleep for p in rest))}")
    if others:
        parts.append(f"{others} engine(s) already on it {_gib(others_claim)}")
    left = f" ({', '.join(unknown)}: no local config.json, weights not counted)" if unknown else ""
    raise UserError(
        f"the models that never sleep and the largest that may sleep do not fit on one GPU "
        f"even at their minimums: {' + '.join(parts)} = {_gib(need)} > {source}'s "
        f"{_gib(gpu_total)} (weights estimated from each config.json, plus activations and "
        f"--kv-min){left}: give more models --sleep-after, serve fewer or smaller models, "
        f"lower their --kv-min, or give --gpu-memory-bytes for a larger GPU")


def used(places, awake) -> int:
    """What ``places`` hold, each awake when ``awake(place)`` else asleep."""
    return sum(p.awake if awake(p) or not p.sleeps else p.asleep for p in places)


def start_plan(places: list[Place], capacity: int) -> list[tuple[str, str]]:
    """Engines started in order, each once the one before is ready: ``(sleeper, model)``
    for each sleeper put to sleep to make room for the model starting next, in order. The
    least recently used goes first: at start-up, the one started (and ready) first."""
    started: list[Place] = []               # least recently used first
    asleep: set[str] = set()
    plan = []
    for place in places:
        while used(started, lambda p: p.name not in asleep) + place.awake > capacity:
            chosen = victim([p for p in started if p.sleeps and p.name not in asleep])
            if chosen is None:
                break                       # check() refused this already
            asleep.add(chosen.name)
            plan.append((chosen.name, place.name))
        started.append(place)
    return plan


def victim(candidates, last_used=None):
    """The one to put to sleep: the least recently used of ``candidates`` (``last_used``:
    its time of use; None: the order given, first the least recent), or None."""
    if not candidates:
        return None
    return min(candidates, key=last_used) if last_used is not None else candidates[0]


def plan_lines(places: list[Place], capacity: int, source: str = "the GPU") -> list[str]:
    """The start-up log's lines: what is awake and what sleeps to make room."""
    awake_all = used(places, lambda p: True)
    if awake_all <= capacity:
        return []
    lines = [f"the models need {_gib(awake_all)} all awake at their minimums and "
             f"{source} has {_gib(capacity)} for them: the models that may sleep take turns "
             f"(awake / asleep: "
             + ", ".join(f"{p.name} {_gib(p.awake)} / "
                         f"{_gib(p.asleep) if p.sleeps else 'never'}" for p in places) + ")"]
    for sleeper, model in start_plan(places, capacity):
        lines.append(f"at start-up, model {sleeper} sleeps to make room for {model} "
                     f"(it wakes on its first request)")
    lines.append("a request for a sleeping model puts the least recently used idle one to "
                 "sleep when the GPU has no room for both")
    return lines


#: engines start side by side when the models' need at their minimums is at most this share
#: of the GPU's free memory: room for each engine's start-up beyond its minimum (vLLM's
#: warm-up maps, then a grow to twice what the warm-up wrote) while the others start. On one
#: H100 (s27) three engines (8B, 3B, 1B; 31.91 GiB at their minimums) held 1.05x that after
#: their start-up, and about 1.35x with their start-up grows (KV grown to 5, 4.4 and 1.5 GiB
#: against minimums of 0.5 GiB each).
SIDE_BY_SIDE_SHARE = 0.5


def side_by_side(needs: dict, free: int | None, sleepers: bool) -> tuple[bool, str]:
    """Whether the engines start all at once (each start-up, 75-85 s on an H100, then
    overlaps the others') or one after another, and why (one line for the log). ``needs``:
    each model's non-KV memory and minimum (None: not known, no local config.json);
    ``free``: the GPU's free memory as probed (None: not probed); ``sleepers``: some model
    may sleep. All at once only where the start-ups cannot get in each other's way: no model
    sleeps (one may need room made by another's sleep: :func:`start_plan`), the free memory
    and every size are known, and the models need at most :data:`SIDE_BY_SIDE_SHARE` of it."""
    if len(needs) < 2:
        return False, "one model"
    if sleepers:
        return False, "models that may sleep take turns on the GPU"
    if not free:
        return False, "the GPU's free memory is not known"
    unknown = [name for name, need in needs.items() if need is None]
    if unknown:
        return False, f"the size of {', '.join(unknown)} is not known (no local config.json)"
    need = sum(needs.values())
    figures = f"the models need {_gib(need)} at their minimums, the GPU has {_gib(free)} free"
    if need > SIDE_BY_SIDE_SHARE * free:
        return False, f"{figures}: over {SIDE_BY_SIDE_SHARE:.0%} of it"
    return True, figures
