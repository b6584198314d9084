"""The docs hold what the tree holds: docs/architecture.md names every module of the package
("Every module") and its picture every module of the base and the application, and every
relative link of the docs and the README finds its file (docs/architecture.md once left out
six of the sidecar's modules, over 1,000 lines, the default routing among them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The package's own folder and the folders it reaches through links (weighbridge/sidecar ->
# ../sidecar): each module is named by its path from the repository's root.
FOLDERS = ("weighbridge", "sidecar", "emulator", "loadgen", "scenarios", "exporters",
           "analysis", "dashboards")
LINKED = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def modules(folder: str) -> set[str]:
    """The modules under ``folder``, as paths from the root (links not followed: a part is
    listed under its own folder)."""
    found = set()
    for directory, _subdirectories, files in os.walk(ROOT / folder):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                found.add((Path(directory) / name).relative_to(ROOT).as_posix())
    return found


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def subgraph(text: str, name: str) -> str:
    picture = text[text.index("```mermaid"):]
    start = picture.index("\n", picture.index(f"subgraph {name}["))  # past its title
    return picture[start:picture.index("\n    end", start)]


def test_architecture_names_every_module() -> None:
    named = re.findall(r"^\| `([\w/]+\.py)` \|", section(ARCHITECTURE.read_text(),
                                                         "Every module"), re.MULTILINE)
    tree = set().union(*(modules(folder) for folder in FOLDERS))
    assert len(named) == len(set(named)), "a module is named twice"
    assert sorted(tree - set(named)) == [], (
        "modules without a row in docs/architecture.md's \"Every module\": add one each")
    assert sorted(set(named) - tree) == [], (
        "rows of docs/architecture.md's \"Every module\" for modules the tree lacks")


def test_the_picture_names_the_base_and_the_application() -> None:
    text = ARCHITECTURE.read_text()
    base = set(re.findall(r"(\w+)\[\"", subgraph(text, "base")))
    assert base == {Path(m).stem for m in modules("weighbridge")
                    if m.count("/") == 1 and m != "weighbridge/__main__.py"}
    app = set(re.findall(r"\w+\[\"(\w+)\"\]", subgraph(text, "app")))
    packages = {p.name for p in (ROOT / "weighbridge" / "app").iterdir()
                if (p / "__init__.py").exists()}
    assert app == ({"__main__"} | packages
                   | {Path(m).stem for m in modules("weighbridge/app") if m.count("/") == 2})


@pytest.mark.parametrize("page", sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md",
     *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "decisions").glob("*.md")]),
    ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_finds_its_file(page: Path) -> None:
    broken = [target for target in LINKED.findall(page.read_text())
              if "://" not in target and not target.startswith("mailto:")
              and not (page.parent / target).exists()]
    assert broken == []
