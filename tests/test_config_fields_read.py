"""Every field of the training config is read somewhere: a field nothing reads is a setting users set in vain (as
model.grouping_backend was before the trainer, SFT, eval and the bench read it).

A field counts as read when mmpg/ (outside the config's own modules) or scripts/ holds its attribute access
`.<section>.<name>` (e.g. `cfg.model.grouping_backend`), `<alias>.<name>` where the same file binds the alias to the
section (`d = cfg.data`), or its dotted name (an override a script passes on, or a key a module reads by name).
ALLOWED lists the fields read another way, each with where."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mmpg.config import Config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_MODULES = {f"mmpg/config/{name}.py" for name in ("__init__", "tree", "checks", "reference")}

ALLOWED = {
    # the section is handed to a function as an argument, which reads the field under its own parameter name
    "model.lora.alpha": "mmpg/models/lora.py apply_lora: lora_cfg.alpha",
    "reward.function": "mmpg/rl/rewards.py make_scorer: reward_cfg.function",
    "reward.accuracy": "mmpg/rl/rewards.py make_scorer: reward_cfg.accuracy",
    "reward.format_weight": "mmpg/rl/rewards.py make_scorer: reward_cfg.format_weight",
    "reward.accuracy_weight": "mmpg/rl/rewards.py make_scorer: reward_cfg.accuracy_weight",
    "reward.swap_reversed": "mmpg/rl/rewards.py make_scorer: reward_cfg.swap_reversed",
}


def _fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), name + ".")
        else:
            yield name


def _sources() -> list[str]:
    texts = []
    for folder, pattern in (("mmpg", "*.py"), ("scripts", "*")):
        for path in sorted((ROOT / folder).rglob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            if path.is_file() and rel not in CONFIG_MODULES and "__pycache__" not in rel:
                texts.append(path.read_text(errors="replace"))
    return texts


def _read(name: str, texts: list[str]) -> bool:
    parts = name.split(".")
    section, field = parts[-2], parts[-1]
    for text in texts:
        if re.search(rf"\.{section}\.{field}\b", text) or name in text:
            return True
        aliases = re.findall(rf"\b(\w+)\s*=\s*[\w.]*\.{section}\b(?![.\w])", text)
        tuples = re.findall(rf"^\s*([\w, ]+?)\s*=\s*([\w., ]*\.{section}\b[\w., ]*)$", text, re.M)
        for names, values in tuples:  # `cfg, alg = self.cfg, self.cfg.algorithm`
            for alias, value in zip(names.split(","), values.split(",")):
                if re.search(rf"\.{section}$", value.strip()):
                    aliases.append(alias.strip())
        if any(re.search(rf"\b{a}\.{field}\b", text) for a in aliases):
            return True
    return False


def test_every_config_field_is_read():
    texts = _sources()
    unread = [name for name in _fields(Config) if name not in ALLOWED and not _read(name, texts)]
    assert not unread, f"config fields nothing in mmpg/ or scripts/ reads: {unread}"


def test_the_allow_list_names_real_fields():
    assert set(ALLOWED) <= set(_fields(Config))
