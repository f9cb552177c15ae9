"""docs/ARCHITECTURE.md's glossary holds one name per concept: each code name it gives (in backticks in the "what it
is" cell) is defined once in mmpg/ (a module-level class, function or assignment), in the file the row names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def glossary_rows(text: str) -> list[tuple[str, list[str], str]]:
    """(name, code names in backticks, file) of each row of the glossary table."""
    section = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`mmpg/"):
            rows.append((cells[0], re.findall(r"`(\w+)`", cells[1]), cells[2].strip("`")))
    return rows


def definitions(root: Path = ROOT / "mmpg") -> dict[str, list[str]]:
    """{name: [files defining it at module level]} over mmpg/."""
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, (ast.ClassDef, ast.FunctionDef)) else \
                [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for name in names:
                out.setdefault(name, []).append(path.relative_to(root.parent).as_posix())
    return out


def test_the_reader_sees_every_row_and_a_second_definition(tmp_path):
    rows = glossary_rows((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert len(rows) >= 12 and ("slice", ["packed_slices"], "mmpg/train/data.py") in rows
    (tmp_path / "mmpg").mkdir()
    (tmp_path / "mmpg" / "a.py").write_text("class Session:\n    pass\n")
    (tmp_path / "mmpg" / "b.py").write_text("Session = 1\n")
    assert definitions(tmp_path / "mmpg")["Session"] == ["mmpg/a.py", "mmpg/b.py"]


def test_each_glossary_name_is_defined_once_where_the_glossary_says():
    defined = definitions()
    bad = []
    for name, codes, where in glossary_rows((ROOT / "docs" / "ARCHITECTURE.md").read_text()):
        assert codes, f"glossary row {name!r} names no code name"
        for code in codes:
            if defined.get(code) != [where]:
                bad.append(f"{name}: `{code}` defined in {defined.get(code, [])}, the glossary says {where}")
    assert not bad, "\n".join(bad)
