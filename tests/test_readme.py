"""The README's reference parts follow the tree: its layout names every module and tool there
is (and nothing that is not), its marker and ``GYRE_REQUIRE`` lists are the configured ones, and
its golden-file command names every test that keeps golden files."""

from __future__ import annotations

import configparser
import re

from conftest import CAPABILITIES, REPO

README = (REPO / "README.md").read_text()


def layout() -> dict[str, str]:
    """Entry → its description, from the README's layout block (continuation lines joined)."""
    block = README.split("\n## Layout\n", 1)[1].split("```\n", 2)[1]
    entries: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        if m := re.match(r"^(  )?(\S+)\s+(.*)$", line):
            key = ("gyre_hpc/" if m.group(1) else "") + m.group(2)
            entries[key] = m.group(3)
        elif line.strip() and key:
            entries[key] += " " + line.strip()
    return entries


def words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][\w.]*", text))


def test_the_layout_names_every_module_and_tool_there_is() -> None:
    entries = layout()
    package = REPO / "gyre_hpc"
    top = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir() if not p.name.startswith("__")}
    top = {t for t in top if t.endswith((".py", "/")) and t != "py.typed"}
    listed = {k.removeprefix("gyre_hpc/") for k in entries if k.startswith("gyre_hpc/")}
    assert listed - {"gyre_hpc/"} == top, "README layout: listed ≠ gyre_hpc's modules and packages"
    for pkg in (p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        modules = {p.stem for p in pkg.glob("*.py") if not p.name.startswith("__")}
        missing = modules - words(entries[f"gyre_hpc/{pkg.name}/"])
        assert not missing, f"README layout: gyre_hpc/{pkg.name}/ does not mention {sorted(missing)}"
    tools = {p.name + ("/" if p.is_dir() else "") for p in (REPO / "tools").iterdir()}
    said = entries["tools/"]
    assert {t for t in tools if t.rstrip("/") not in words(said)} == set()
    assert {w for w in words(said) if re.search(r"\.(py|sh)$", w)} <= tools  # no tool that is gone


def test_the_marker_and_require_lists_are_the_configured_ones() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    markers = {line.split(":")[0].strip() for line in cfg["tool:pytest"]["markers"].strip().splitlines()}
    said = README.split("carry a marker (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`(\w+)`", said)) == markers == {*CAPABILITIES, "slow"}
    test_sh = (REPO / "tools" / "test.sh").read_text()
    required = re.search(r'GYRE_REQUIRE="\$\{GYRE_REQUIRE-([\w,]+)\}"', test_sh).group(1)  # type: ignore[union-attr]
    assert f"`GYRE_REQUIRE={required}`" in README


def test_the_golden_command_names_every_test_with_golden_files() -> None:
    keeping = sorted(
        f"tests/{p.name}"
        for p in (REPO / "tests").glob("test_*.py")
        if re.search(r"\bassert_golden\(", p.read_text())
    )
    command = re.search(r"`GYRE_UPDATE_GOLDEN=1 pytest ([^`]+)`", README).group(1)  # type: ignore[union-attr]
    assert command.split() == keeping
