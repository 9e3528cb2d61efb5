"""Self-check results: one check is one line, ``name: ok|failed|skipped: detail — fix``."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

OK, FAILED, SKIPPED = "ok", "failed", "skipped"

# The order every report uses (pre-flight first, then what needs a running engine).
CHECK_ORDER = ("gpu", "cuda", "versions", "engine", "proxima-active",
               "allocator-invariants", "elastic-kv", "canary")


@dataclass
class Check:
    """The outcome of one check. ``fix`` says what to do; empty when there is nothing to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    def line(self) -> str:
        text = f"{self.name}: {self.status}: {self.detail}"
        return f"{text} — {self.fix}" if self.fix else text


def ok(name: str, detail: str) -> Check:
    return Check(name, OK, detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name, FAILED, detail, fix)


def skipped(name: str, detail: str) -> Check:
    return Check(name, SKIPPED, detail)


@dataclass
class Report:
    """Checks so far, in ``CHECK_ORDER``. ``passed`` is None until the last check has run."""

    checks: list[Check] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def add(self, check: Check) -> Check:
        self.checks = [c for c in self.checks if c.name != check.name] + [check]
        rank = {name: i for i, name in enumerate(CHECK_ORDER)}
        self.checks.sort(key=lambda c: rank.get(c.name, len(rank)))
        return check

    def extend(self, checks: list[Check]) -> None:
        for check in checks:
            self.add(check)

    @property
    def any_failed(self) -> bool:
        return any(c.failed for c in self.checks)

    @property
    def passed(self) -> bool | None:
        if self.any_failed:
            return False
        return True if self.finished is not None else None

    def finish(self) -> None:
        self.finished = time.time()

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]

    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if c.failed), None)

    def to_json(self) -> dict:
        return {"passed": self.passed, "started": self.started, "finished": self.finished,
                "checks": [asdict(c) for c in self.checks]}
