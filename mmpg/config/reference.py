"""The configuration reference, docs/config.md, generated from the config tree (`mmpg.config`): every field of every
group with its type, default and help text, in the order the dataclasses declare them.

    python -m mmpg.config.reference > docs/config.md

tests/test_docs.py regenerates it and fails, naming this command, when docs/config.md is out of date.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from mmpg.config import tree as config_module
from mmpg.config.tree import Config

COMMAND = "python -m mmpg.config.reference > docs/config.md"


def _subgroup(f: dataclasses.Field):
    """The dataclass of a nested group field (model.lora), or None for a plain field."""
    factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return factory if dataclasses.is_dataclass(factory) else None


def _value(f: dataclasses.Field) -> str:
    """A field's default as YAML-like text: null, true, 8, "time_r1", ["q_proj", ...]."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return json.dumps(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _rows(cls, prefix: str) -> list[str]:
    """One table row per field; a nested group's fields follow under their own dotted prefix."""
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        sub = _subgroup(f)
        if sub is not None:
            nested.append((f, sub))
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `{prefix}.{f.name}` | {kind} | `{_value(f)}` | {_cell(f.metadata.get('help', ''))} |")
    for f, sub in nested:
        rows += [f"| **`{prefix}.{f.name}`** | group | | {_cell(f.metadata.get('help', ''))} |"]
        rows += _rows(sub, f"{prefix}.{f.name}")
    return rows


def render(schema=Config) -> str:
    """The whole page, ending with one newline."""
    groups = [f.name for f in dataclasses.fields(schema)]
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from mmpg/config/tree.py by `{COMMAND}`; edit the help texts there, not this page. -->",
        "",
        " ".join(config_module.__doc__.split("\n\n")[0].split()),
        "",
        "On the command line: `mmpg train --config FILE.yaml key=value ...` (and `mmpg sft`, the same tree). "
        "`mmpg train --fields [GROUP]` prints the same fields in the terminal. `mmpg eval` has its own settings: "
        "`mmpg eval --fields`.",
        "",
        "Groups: " + ", ".join(f"[`{g}`](#{g})" for g in groups) + ".",
    ]
    for g in dataclasses.fields(schema):
        lines += ["", f"## {g.name}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        lines += _rows(_subgroup(g), g.name)
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
