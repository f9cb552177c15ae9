"""Loading the config tree: defaults <- YAML file <- `key=value` overrides, each refusal one `UserError` line.

    cfg = load_config("configs/cpu_demo.yaml", ["rollout.n=4", "optim.lr=1e-5"])   # -> Config (mmpg.config.tree)

Unknown keys are refused before OmegaConf sees them, named in full with the nearest valid names; OmegaConf's own
errors (a value of the wrong type) are reworded the same way (`omegaconf_error`). `quote_text` keeps a string field's
value as written. Both serve any flat or nested dataclass schema: `mmpg.eval.settings` loads EvalSettings with them.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from mmpg.config.checks import validate
from mmpg.config.tree import Config, all_keys
from mmpg.errors import UserError


def _nearest(key: str, schema=Config) -> str:
    """'; did you mean a, b?' for an unknown dotted key, from the first of these that finds anything:
    close field names in the same group (rollout.temprature), the same field in a close group (rolout.n), close
    field names in any group (lr -> optim.lr), close full keys."""
    keys = all_keys(schema)
    groups = [f.name for f in dataclasses.fields(schema)]
    group, _, rest = key.partition(".")
    leaf = key.rsplit(".", 1)[-1]
    in_group = [k.partition(".")[2] for k in keys if k.startswith(group + ".")]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    tiers = [
        [f"{group}.{m}" for m in difflib.get_close_matches(rest, in_group, n=3, cutoff=0.6)] if rest else [],
        [f"{g}.{rest}" if rest else g for g in difflib.get_close_matches(group, groups, n=3, cutoff=0.6)
         if not rest or f"{g}.{rest}" in keys] if group not in groups else [],
        [k for m in difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.6) for k in by_leaf[m]],
        difflib.get_close_matches(key, keys, n=3, cutoff=0.6),
    ]
    close = next((t for t in tiers if t), [])
    return f"; did you mean {', '.join(close[:3])}?" if close else f"; groups are {', '.join(groups)}"


def config_field(key: str, schema=Config):
    """The dataclass field behind a dotted key, or None."""
    node, found = schema, None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        found = next((f for f in dataclasses.fields(node) if f.name == part), None)
        if found is None:
            return None
        node = found.default_factory if found.default_factory is not dataclasses.MISSING else None
    return found


def quote_text(item: str, schema=Config) -> str:
    """`key=value` with the value taken as written when the field is a string: YAML would turn `run_name=off` into
    False and `run_name=1e3` into 1000.0. An empty value is the empty string (null is spelled null)."""
    key, _, value = item.partition("=")
    f = config_field(key.strip(), schema)
    if f is None or f.type not in (str, "str") or value == "null" or value[:1] in ("'", '"'):
        return item if value else item + "''"
    return f"{key}='" + value.replace("'", "''") + "'"


def _check_keys(data: dict, source: str, schema=Config, prefix: str = "", root=None) -> None:
    """Refuse unknown keys (named in full: 'rolout.n', not 'rolout') and groups given a plain value, before
    OmegaConf sees them; OmegaConf names only the first unknown part and reports a group set to 3 as key ''."""
    root = root or schema
    names = {f.name: f for f in dataclasses.fields(schema)}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            while isinstance(value, dict) and value:  # name the first leaf under an unknown group
                name, value = next(iter(value.items()))
                key = f"{key}.{name}"
            raise UserError(f"{source}: unknown config key '{key}'{_nearest(key, root)} (mmpg train --fields "
                            "lists them)")
        sub = names[name].default_factory
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, dict):
                example = all_keys(sub, key + ".")[0]
                raise UserError(f"{source}: config key '{key}' is a group of fields, not a value (got {value!r}); "
                                f"set its fields instead, e.g. {example}=...")
            _check_keys(value, source, sub, key + ".", root)


def omegaconf_error(err, source: str, schema=Config) -> UserError:
    """An OmegaConf merge error as one UserError line: the unknown key and the nearest names, or the key, its value
    and the type it needed (also for the eval settings, schema=EvalSettings)."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError):
        return UserError(f"{source}: unknown config key '{key}'{_nearest(key, schema)} (mmpg train --fields "
                         "lists them)")
    if isinstance(err, ValidationError):
        # err.object_type is the enclosing dataclass (RolloutConfig), not the field's type: look the field up.
        found = config_field(key, schema)
        expected = getattr(found.type, "__name__", found.type) if found else "value"
        return UserError(f"{source}: config key '{key}' got {getattr(err, 'value', None)!r}, which is not a valid "
                         f"{expected}".replace("typing.", ""))
    return UserError(f"{source}: {str(err).splitlines()[0]}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                schema=Config) -> Config:
    """defaults <- YAML at `path` <- `key=value` overrides; returns the typed tree or raises UserError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(schema)
    if path:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{path}: config file not found")
        try:
            loaded = OmegaConf.load(p)
        except Exception as e:  # YAML syntax errors, a file holding a bare number
            raise UserError(f"{path}: not a valid YAML config ({str(e).splitlines()[0]})") from None
        if not OmegaConf.is_dict(loaded):
            raise UserError(f"{path}: a config file must be a mapping of groups (model:, data:, rollout:, ...), "
                            f"not a list")
        for group in [g for g, v in loaded.items_ex(resolve=False) if v is None]:
            loaded.pop(group)  # a group whose fields are all commented out: keep the defaults
        _check_keys(OmegaConf.to_container(loaded, resolve=False), str(path), schema)
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as e:
            raise omegaconf_error(e, str(path), schema) from None
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise UserError(f"override {item!r} must look like key=value, e.g. rollout.n=8")
        item = quote_text(item, schema)
        try:
            dotlist = OmegaConf.from_dotlist([item])
            _check_keys(OmegaConf.to_container(dotlist, resolve=False), f"override {item!r}", schema)
            merged = OmegaConf.merge(merged, dotlist)
        except OmegaConfBaseException as e:
            raise omegaconf_error(e, f"override {item!r}", schema) from None
    cfg = OmegaConf.to_object(merged)
    if isinstance(cfg, Config):  # the training tree's value checks; other schemas check themselves
        validate(cfg)
    return cfg


def to_yaml(cfg) -> str:
    """The resolved config as YAML (what `config.yaml` in the run directory holds)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe(group: str | None = None, schema=Config) -> str:
    """Every field of one group (or of all), with its default and help text."""
    lines = []
    for g in dataclasses.fields(schema):
        if group and g.name != group:
            continue
        lines.append(f"{g.name}:")
        lines += _describe_fields(g.default_factory, g.name)
    if not lines:
        names = [g.name for g in dataclasses.fields(schema)]
        raise UserError(f"unknown config group {group!r}; groups are {', '.join(names)}")
    return "\n".join(lines)


def _describe_fields(cls, prefix: str) -> list[str]:
    """`  prefix.name = default` and its help per field; a nested group (model.lora) field by field."""
    lines = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            lines += _describe_fields(f.default_factory, f"{prefix}.{f.name}")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"  {prefix}.{f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    return lines
