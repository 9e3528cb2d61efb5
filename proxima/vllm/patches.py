"""Every attribute Proxima replaces in vLLM, applied and restored in one place.

A :class:`Patch` names one attribute of a vLLM module or class and what replaces it. The
adapters hand their patches to :func:`apply` as a :class:`PatchSet`: a name (what
``deactivate()`` undoes), the engine generation its patches are written for (``"v1"``: vLLM
0.8 and later, ``"v0"``: the card stack's 0.6.x; :mod:`proxima.vllm.activation` says
which releases are tested), and a function that builds the patches. :func:`apply` asks the
version policy once (:func:`gate`: an untested vLLM is refused unless
``PROXIMA_ALLOW_UNTESTED_VLLM=1``, a vLLM of the other generation always), only then builds
the patches (so an adapter imports vLLM's modules and makes its wrappers after the gate),
and applies them all, recording for each the target's own original object (absent when the
attribute was inherited or missing). :func:`restore` puts back the identical objects, the
last applied first, and removes what was absent before.

The sets in use: ``v1`` (:mod:`proxima.vllm.vllm_v1`: the coordinator's ``BlockPool``,
``Scheduler.add_request``, ``KVCacheManager.free`` / ``new_step_starts``, each manager's
``allocate_new_blocks``), ``v0`` (:mod:`proxima.vllm.vllm_v0`:
``vllm.core.block_manager.SelfAttnBlockSpaceManager``), ``observe``
(:mod:`proxima.vllm.observe_v1`), ``elastic`` (:mod:`proxima.vllm.elastic_v1`:
``EngineArgs.create_engine_config``, ``EngineCore.proxima_kv``, the V2 runner's
``_allocate_kv_cache``) and ``compaction-worker`` (:mod:`proxima.vllm.compaction_worker`:
``GPUModelRunner.update_requests``).

Imports nothing of vLLM itself (the builders do).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from proxima.vllm import activation

#: The original of an attribute the target did not have itself (inherited or missing).
ABSENT = object()


@dataclass(frozen=True)
class Patch:
    """``target.attribute = replacement`` (``target``: a module or a class)."""

    target: Any
    attribute: str
    replacement: Any


@dataclass(frozen=True)
class PatchSet:
    """The patches one adapter applies together.

    ``name``: what :func:`restore` undoes; ``versions``: the engine generation ("v1" or
    "v0") whose vLLM releases the patches are written for, the version gate's question;
    ``build``: makes the patches, called only once the gate said yes."""

    name: str
    versions: str
    build: Callable[[], Iterable[Patch]]


@dataclass(frozen=True)
class Applied:
    """One patch in force: the set it belongs to and the target's own original."""

    name: str
    patch: Patch
    original: Any


_applied: list[Applied] = []


def own(target, attribute: str):
    """``target``'s own ``attribute`` (its ``__dict__`` entry, not an inherited one), or
    :data:`ABSENT`."""
    return vars(target).get(attribute, ABSENT)


def gate(versions: str) -> activation.Verdict:
    """The version gate: the installed vLLM (and torch) against the policy
    (:func:`proxima.vllm.activation.require`); ActivationError when it says no."""
    import vllm

    return activation.require(versions, vllm.__version__, activation.installed_version("torch"))


def apply(patch_set: PatchSet) -> list[Patch]:
    """Gate once, build the set's patches and apply those not in force already (a patch
    of this set on the same target and attribute): returns those applied. A builder that
    raises (ActivationError) leaves everything as it was."""
    gate(patch_set.versions)
    patches = list(patch_set.build())
    done = []
    for patch in patches:
        if any(a.name == patch_set.name and a.patch.target is patch.target
               and a.patch.attribute == patch.attribute for a in _applied):
            continue
        _applied.append(Applied(patch_set.name, patch, own(patch.target, patch.attribute)))
        setattr(patch.target, patch.attribute, patch.replacement)
        done.append(patch)
    return done


def _put_back(target, attribute: str, original) -> None:
    if original is ABSENT:
        if attribute in vars(target):
            delattr(target, attribute)
    else:
        setattr(target, attribute, original)


def restore(name: str) -> None:
    """Undo every patch of set ``name``, the last applied first (no-op when none is in
    force): each attribute is again the identical object it was, or absent."""
    for i in range(len(_applied) - 1, -1, -1):
        entry = _applied[i]
        if entry.name == name:
            del _applied[i]
            _put_back(entry.patch.target, entry.patch.attribute, entry.original)


def is_applied(name: str, attribute: str | None = None) -> bool:
    """Whether a patch of set ``name`` (on ``attribute``, when given) is in force."""
    return any(a.name == name and (attribute is None or a.patch.attribute == attribute)
               for a in _applied)


def applied(name: str | None = None) -> list[Applied]:
    """The patches in force (of set ``name``, or all), in the order they were applied."""
    return [a for a in _applied if name is None or a.name == name]


def original(target, attribute: str):
    """What ``target.attribute`` was before Proxima's patches (the first recorded original
    of a patch in force on it: :data:`ABSENT` when the target did not have it itself),
    else what it is now."""
    for entry in _applied:
        if entry.patch.target is target and entry.patch.attribute == attribute:
            return entry.original
    return getattr(target, attribute)


@contextmanager
def swapped(target, attribute: str, value) -> Iterator[Any]:
    """Within the block ``target.attribute`` is ``value``; afterwards it is the identical
    object it was (or absent again), whatever the registry holds (the replay builds one
    stock and one Proxima engine this way in one process)."""
    saved = own(target, attribute)
    setattr(target, attribute, value)
    try:
        yield value
    finally:
        _put_back(target, attribute, saved)
