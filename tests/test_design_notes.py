"""Every rule is written once and every citation of one resolves.

Design notes (``### Note: [name]``) live in docs/design.md; the rules a module keeps live in its own docstring,
each as a bold ``**[name]**``. Code cites a note as ``Note: [name]`` and another module's rule as
``module.py's [name]`` (the file's path, as short as is unambiguous). docs/design.md's "Rules kept in modules"
is an index of rule names, one line per module, and must list exactly the rules each docstring states.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "torchckpt"
DESIGN = ROOT / "docs" / "design.md"

_RULE = re.compile(r"\*\*\[([^\]\n]+)\]\*\*")
_NOTE_CITED = re.compile(r"Note: \[([^\]\n<][^\]\n]*)\]")  # ``Note: [<name>]`` is the form, in prose
_RULE_CITED = re.compile(r"([A-Za-z_][\w/]*\.py)'s \[([^\]\n]+)\]")
_INDEX_LINE = re.compile(r"^- `([\w/]+\.py)`: (.*)$")


def _flat(text: str) -> str:
    """Lines joined, comment markers dropped, so that a citation broken over two lines reads as one."""
    text = re.sub(r'"[ \t]*\n[ \t]*f?"', "", text)  # a string literal continued on the next line
    return re.sub(r"[ \t]*\n[ \t]*(#[ \t]*)?", " ", text)


def _sources() -> dict[str, str]:
    """Path -> text, for every module: relative to src/torchckpt, or ``bench/...`` for the benchmark code."""
    out = {path.relative_to(SRC).as_posix(): path.read_text() for path in sorted(SRC.rglob("*.py"))}
    out.update({path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted((ROOT / "bench").rglob("*.py"))})
    return out


def rules_by_module(sources: dict[str, str]) -> dict[str, list[str]]:
    """The rules each module states in its docstring (bold names), in order."""
    out = {}
    for name, text in sources.items():
        doc = ast.get_docstring(ast.parse(text)) or ""
        found = _RULE.findall(doc)
        if found:
            out[name] = found
    return out


def notes(design: str) -> set[str]:
    return set(re.findall(r"^### Note: \[([^\]\n]+)\]", design, flags=re.MULTILINE))


def resolve(cited_path: str, modules: list[str]) -> list[str]:
    """The modules whose path ends with ``cited_path`` (``costs.py``, ``storage/local.py``)."""
    return [m for m in modules if m == cited_path or m.endswith("/" + cited_path)]


def broken_citations(sources: dict[str, str], design: str, prose: dict[str, str] | None = None) -> list[str]:
    """Each citation in the source, in docs/design.md or in ``prose`` (other Markdown) that names no note, no
    module, or no rule of it."""
    rules = rules_by_module(sources)
    known_notes = notes(design)
    problems = []
    texts = {**sources, **(prose or {})}
    texts["docs/design.md"] = design
    for where, text in texts.items():
        text = _flat(text)
        for note in _NOTE_CITED.findall(text):
            if note not in known_notes and where != "docs/design.md":
                problems.append(f"{where}: Note: [{note}] is not a note of docs/design.md")
        for cited, rule in _RULE_CITED.findall(text):
            owners = resolve(cited, list(sources))
            if len(owners) != 1:
                problems.append(f"{where}: {cited}'s [{rule}]: {cited} names {len(owners)} modules ({owners})")
            elif rule not in rules.get(owners[0], []):
                problems.append(f"{where}: {cited}'s [{rule}]: {owners[0]} states no rule [{rule}]")
    return problems


def index_mismatches(sources: dict[str, str], design: str) -> list[str]:
    """Where docs/design.md's index of module rules differs from what the docstrings state."""
    rules = rules_by_module(sources)
    section = design.split("## Rules kept in modules", 1)[1]
    listed: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = _INDEX_LINE.match(line)
        if match:
            listed[match.group(1)] = re.findall(r"\[([^\]\n]+)\]", match.group(2))
    problems = []
    for module in sorted(set(rules) | set(listed)):
        if rules.get(module) != listed.get(module):
            problems.append(f"{module}: the docstring states {rules.get(module)}, docs/design.md lists "
                            f"{listed.get(module)}")
    return problems


def _prose() -> dict[str, str]:
    """The Markdown that cites notes and rules too: docs/, README.md, CONTRIBUTING.md, bench/README.md."""
    paths = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
             ROOT / "bench" / "README.md"]
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in paths if path != DESIGN}


def test_every_citation_resolves() -> None:
    assert broken_citations(_sources(), DESIGN.read_text(), _prose()) == []


def test_the_index_lists_each_modules_rules() -> None:
    assert index_mismatches(_sources(), DESIGN.read_text()) == []


def test_a_rule_is_stated_once() -> None:
    """No rule name is stated by two modules, and no module rule repeats a design note's name."""
    seen: dict[str, str] = {}
    twice = []
    known_notes = notes(DESIGN.read_text())
    for module, names in rules_by_module(_sources()).items():
        for name in names:
            if name in seen or name in known_notes:
                twice.append(f"[{name}]: {module} and {seen.get(name, 'docs/design.md')}")
            seen[name] = module
    assert twice == []


def test_the_checks_can_fail() -> None:
    sources = {"a/costs.py": '"""Rules.\n\n1. **[x rule]** text (Note: [a note])."""\n',
               "b.py": "# costs.py's [x rule], costs.py's [y\n# rule], missing.py's [z] and Note: [no such]\n"}
    design = "### Note: [a note]\n\n## Rules kept in modules\n\n- `a/costs.py`: [x rule]\n- `b.py`: [w]\n"
    assert broken_citations(sources, design) == [
        "b.py: Note: [no such] is not a note of docs/design.md",
        "b.py: costs.py's [y rule]: a/costs.py states no rule [y rule]",
        "b.py: missing.py's [z]: missing.py names 0 modules ([])",
    ]
    assert index_mismatches(sources, design) == ["b.py: the docstring states None, docs/design.md lists ['w']"]
    assert broken_citations(sources, design, {"docs/x.md": "see Note: [a note] and costs.py's\n[no rule]"}) == [
        *broken_citations(sources, design), "docs/x.md: costs.py's [no rule]: a/costs.py states no rule [no rule]"]
