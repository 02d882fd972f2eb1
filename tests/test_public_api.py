"""The public API is a snapshot (``tests/public_api.txt``): a change to it is deliberate, not an accident.

The snapshot lists every name in ``__all__`` of the package and of its namespaces, with its signature (or its
kind), and the renamed or moved names that still work with a ``DeprecationWarning``. When a change is meant,
regenerate it (``python tests/test_public_api.py``), review the diff, and add a CHANGELOG entry under
"Unreleased" (a removed or renamed name: keep the old one working for a release, through ``_MOVED`` in
``src/torchckpt/__init__.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("public_api.txt")
NAMESPACES = ("torchckpt", "torchckpt.policies", "torchckpt.executor", "torchckpt.planner", "torchckpt.loops",
              "torchckpt.state", "torchckpt.memory", "torchckpt.models", "torchckpt.train")
# integration -> the library it needs (its lines are checked where that library is installed)
INTEGRATIONS = {"torchckpt.integrations.hf": "transformers", "torchckpt.integrations.hf_trainer": "transformers",
                "torchckpt.integrations.lightning": "lightning"}
HOW = ("regenerate it with `python tests/test_public_api.py`, review the diff, and add a CHANGELOG.md entry under "
       "'Unreleased'; a renamed or removed name keeps working for a release through _MOVED in "
       "src/torchckpt/__init__.py")


def _namespace(name: str) -> object:
    import torchckpt

    return torchckpt.policies if name == "torchckpt.policies" else importlib.import_module(name)


def _describe(value: object) -> str:
    if inspect.ismodule(value):
        return "module"
    kind = ("class" if inspect.isclass(value) else "function" if inspect.isroutine(value)
            else type(value).__name__)
    if not callable(value):
        return kind
    try:
        signature = str(inspect.signature(value))
    except (TypeError, ValueError):  # a builtin without one
        signature = "(...)"
    return kind + re.sub(r" at 0x[0-9a-f]+", "", signature)


def api_lines(integrations: bool = True) -> list[str]:
    """One line per public name, ``namespace.name: kind(signature)``, then the moved names; the integrations'
    names only where their libraries are installed, unless ``integrations`` is False."""
    import torchckpt

    available = [name for name, library in INTEGRATIONS.items()
                 if integrations and importlib.util.find_spec(library) is not None]
    lines = []
    for name in (*NAMESPACES, *available):
        module = _namespace(name)
        lines += [f"{name}.{attribute}: {_describe(getattr(module, attribute))}" for attribute in module.__all__]
    lines += [f"moved: torchckpt.{old} -> {new}" for old, new in sorted(torchckpt._MOVED.items())]
    return lines


def _check(integrations: bool) -> None:
    lines = api_lines(integrations)
    available = {line.split(":")[0].rsplit(".", 1)[0] for line in lines}
    recorded = [line for line in SNAPSHOT.read_text().splitlines()
                if line.startswith("moved:") or line.split(":")[0].rsplit(".", 1)[0] in available]
    added, removed = sorted(set(lines) - set(recorded)), sorted(set(recorded) - set(lines))
    assert not added and not removed, f"the public API changed: added {added}, removed {removed}. If meant, {HOW}"


def test_the_public_api_is_the_snapshot() -> None:
    _check(integrations=False)


@pytest.mark.slow  # imports transformers and lightning (tens of seconds); the test above checks the rest
def test_the_integrations_api_is_the_snapshot() -> None:
    _check(integrations=True)


def test_a_moved_name_works_and_warns_naming_the_new_one() -> None:
    import torchckpt

    for old, new in torchckpt._MOVED.items():
        with pytest.warns(DeprecationWarning, match=re.escape(f"torchckpt.{old} is deprecated") + ".*" +
                          re.escape(new)):
            value = getattr(torchckpt, old)
        owner, _, attribute = new.rpartition(".")
        assert value is getattr(_namespace(owner), attribute)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torchckpt.verify_plan is torchckpt.planner.verify_plan  # the new names do not warn
    with pytest.raises(AttributeError, match="no attribute 'verfy_plan'"):
        torchckpt.verfy_plan  # noqa: B018 - the lookup is the test


def test_the_snapshot_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchckpt.loops

    monkeypatch.setattr(torchckpt.loops, "__all__", [*torchckpt.loops.__all__, "revolve_schedule_renamed"])
    monkeypatch.setattr(torchckpt.loops, "revolve_schedule_renamed", lambda steps: steps, raising=False)
    with pytest.raises(AssertionError, match="regenerate it with"):
        test_the_public_api_is_the_snapshot()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    everything = api_lines()
    missing = [library for library in INTEGRATIONS.values() if importlib.util.find_spec(library) is None]
    assert not missing, f"install {missing} first: the snapshot records every integration"
    SNAPSHOT.write_text("\n".join(everything) + "\n")
    print(f"wrote {SNAPSHOT} ({len(everything)} lines); review `git diff {SNAPSHOT.name}` and add a CHANGELOG entry")
