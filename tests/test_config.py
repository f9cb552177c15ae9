"""The config tree: defaults <- YAML <- overrides, one-line errors that name the key, and `mmpg train --fields`.

Everything here is CPU-only and touches no model, data or video: loading a config must not look at the paths it names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mmpg.cli import main
from mmpg.config import CHOICES, GROUPS, Config, all_keys, describe, load_config, to_yaml
from mmpg.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path=None, overrides=()) -> str:
    with pytest.raises(UserError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# ---------------------------------------------------------------- defaults, precedence, help texts


def test_defaults_load_without_a_file():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.rollout.n == 8 and cfg.optim.lr == 1e-6 and cfg.optim.betas == [0.9, 0.999]


def test_file_then_overrides_take_precedence(tmp_path):
    path = _write(tmp_path, "rollout: {n: 4, temperature: 0.7}\noptim: {lr: 1.0e-4}\n")
    cfg = load_config(path, ["rollout.n=16", "trainer.total_steps=3"])
    assert cfg.rollout.n == 16              # override beats the file
    assert cfg.rollout.temperature == 0.7   # file beats the default
    assert cfg.optim.lr == 1e-4
    assert cfg.trainer.total_steps == 3     # override of a key the file leaves alone
    assert cfg.data.batch_size == 8         # untouched default
    # Later overrides beat earlier ones.
    assert load_config(path, ["rollout.n=2", "rollout.n=6"]).rollout.n == 6


def test_int_given_to_a_float_field_becomes_a_float():
    cfg = load_config(None, ["rollout.temperature=1", "optim.lr=3e-6"])
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.optim.lr == 3e-6


def test_empty_file_and_empty_group_keep_the_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()
    # A group whose fields are all commented out.
    assert load_config(_write(tmp_path, "rollout:\n  # n: 4\n", "group.yaml")) == Config()


def test_every_field_has_help_and_a_default():
    assert GROUPS == [f.name for f in dataclasses.fields(Config)]
    for group in dataclasses.fields(Config):
        assert dataclasses.is_dataclass(group.default_factory), group.name
        fields = [(f"{group.name}.{f.name}", f) for f in dataclasses.fields(group.default_factory)]
        for key, f in fields:
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                fields += [(f"{key}.{sub.name}", sub) for sub in dataclasses.fields(f.default_factory)]
        for key, f in fields:
            assert f.metadata.get("help", "").strip(), f"{key} has no help text"
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            assert has_default, f"{key} has no default"


def test_all_keys_and_choices_agree_with_the_tree():
    keys = all_keys()
    assert len(keys) == len(set(keys))
    # group.field, or group.sub.field for the one nested group (model.lora)
    assert all((k.count(".") == 1 or k.startswith("model.lora.")) and k.split(".")[0] in GROUPS for k in keys)
    assert "model.lora.r" in keys and "model.lora" not in keys
    assert "rollout.n" in keys and "algorithm.epsilon_high" in keys
    defaults = Config()
    for key, allowed in CHOICES.items():
        assert key in keys, key
        group, name = key.split(".")
        assert getattr(getattr(defaults, group), name) in allowed, f"default of {key} is not one of its choices"


def test_describe_lists_each_key_with_its_help():
    assert "model.lora.r = 0" in describe("model") and "LoRA rank" in describe("model")
    text = describe("rollout")
    assert "rollout.temperature = 1.0" in text
    assert "Group size G" in text
    assert "optim." not in text
    with pytest.raises(UserError, match="groups are model, data"):
        describe("nosuchgroup")


# ---------------------------------------------------------------- errors: unknown keys, types, choices, syntax


@pytest.mark.parametrize("override, key, suggestion", [
    ("rollout.temprature=1", "rollout.temprature", "rollout.temperature"),
    ("trainer.total_step=3", "trainer.total_step", "trainer.total_steps"),
    ("rolout.n=2", "rolout.n", "rollout.n"),            # unknown group: the same field in the nearest group
    ("lr=1e-5", "lr", "optim.lr"),                       # no group: the field of that name
    ("rollout.lr=1e-5", "rollout.lr", "optim.lr"),       # right field, wrong group
])
def test_unknown_override_names_the_full_key_and_the_nearest(override, key, suggestion):
    msg = _error(overrides=[override])
    assert f"unknown config key '{key}'" in msg
    assert f"did you mean {suggestion}" in msg          # the best guess comes first
    assert "\n" not in msg


def test_unknown_key_suggestion_is_not_padded_with_noise():
    # Only the close field of the same group, not every rollout.* key that shares a few letters.
    assert "did you mean rollout.temperature?" in _error(overrides=["rollout.temprature=1"])


def test_unknown_key_far_from_everything_lists_the_groups():
    msg = _error(overrides=["zzzz.qqqq=1"])
    assert "unknown config key 'zzzz.qqqq'" in msg and "groups are model, data, rollout" in msg


@pytest.mark.parametrize("text, key, suggestion", [
    ("rollout: {temprature: 1}\n", "rollout.temprature", "rollout.temperature"),
    ("trainer:\n  total_step: 3\n", "trainer.total_step", "trainer.total_steps"),
    ("rolout:\n  n: 2\n", "rolout.n", "rollout.n"),
])
def test_unknown_yaml_key_names_the_file_the_full_key_and_the_nearest(tmp_path, text, key, suggestion):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert str(path) in msg
    assert f"unknown config key '{key}'" in msg and f"did you mean {suggestion}" in msg


@pytest.mark.parametrize("override, key, type_name", [
    ("rollout.n=abc", "rollout.n", "int"),
    ("rollout.n=2.5", "rollout.n", "int"),
    ("optim.lr=fast", "optim.lr", "float"),
    ("data.shuffle=maybe", "data.shuffle", "bool"),
    ("data.min_pixels=abc", "data.min_pixels", "Optional[int]"),
])
def test_wrong_type_names_the_key_and_the_expected_type(override, key, type_name):
    msg = _error(overrides=[override])
    assert f"config key '{key}'" in msg and f"not a valid {type_name}" in msg
    assert "Config" not in msg   # not the enclosing dataclass (RolloutConfig) as the expected type


def test_wrong_type_in_yaml_names_the_file_and_the_key(tmp_path):
    path = _write(tmp_path, "data: {batch_size: [1]}\n")
    msg = _error(path)
    assert str(path) in msg and "config key 'data.batch_size'" in msg and "[1]" in msg and "int" in msg


def test_group_given_a_value_names_the_group(tmp_path):
    assert "config key 'model' is a group" in _error(overrides=["model=3"])
    assert "config key 'rollout' is a group" in _error(_write(tmp_path, "rollout: 3\n"))


def test_bad_choice_names_the_allowed_values():
    msg = _error(overrides=["algorithm.loss_type=ppo"])
    assert "algorithm.loss_type" in msg and "'ppo'" in msg
    assert all(v in msg for v in CHOICES["algorithm.loss_type"])


def test_out_of_range_value_names_the_key():
    assert "rollout.temperature" in _error(overrides=["rollout.temperature=0"])
    assert "deepspeed.zero_stage" in _error(overrides=["deepspeed.zero_stage=4"])


@pytest.mark.parametrize("override", ["rollout.n", "=3", "rollout"])
def test_override_without_key_value_shape(override):
    msg = _error(overrides=[override])
    assert "must look like key=value" in msg and repr(override) in msg


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = _error(path)
    assert str(path) in msg and "not found" in msg


@pytest.mark.parametrize("text, what", [
    ("rollout: {n: [\n", "not a valid YAML"),
    ("rollout:\n  n: 4\n n: 5\n", "not a valid YAML"),
    ("3\n", "not a valid YAML"),
    ("- 1\n- 2\n", "must be a mapping"),
])
def test_invalid_yaml(tmp_path, text, what):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert str(path) in msg and what in msg and "\n" not in msg


# ---------------------------------------------------------------- to_yaml and the shipped configs


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.n=3", "optim.betas=[0.8,0.95]", "data.min_pixels=3136",
                             "model.path=some/dir", "algorithm.loss_type=dapo", "trainer.run_name=x"])
    path = _write(tmp_path, to_yaml(cfg), "resolved.yaml")
    assert load_config(path) == cfg
    assert load_config(_write(tmp_path, to_yaml(Config()), "defaults.yaml")) == Config()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_without_touching_their_paths(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the relative data and model paths they name do not exist here
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert load_config(_write(tmp_path, to_yaml(cfg))) == cfg
    assert list(tmp_path.iterdir()) == [tmp_path / "cfg.yaml"]


def test_there_are_shipped_configs():
    assert list((REPO / "configs").glob("*.yaml"))


# ---------------------------------------------------------------- through the CLI


@pytest.mark.parametrize("write, overrides, key", [
    ("rollout: {temprature: 1}\n", [], "rollout.temprature"),
    ("", ["trainer.total_step=3"], "trainer.total_step"),
    ("data: {batch_size: [1]}\n", [], "data.batch_size"),
    ("", ["algorithm.loss_type=ppo"], "algorithm.loss_type"),
    ("", ["rollout.n=abc"], "rollout.n"),
])
def test_cli_bad_config_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, write, overrides, key):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = _write(tmp_path, write)
    runs = tmp_path / "runs"
    status = main(["train", "--config", str(path), f"trainer.output_dir={runs}"] + overrides)
    out, err = capsys.readouterr()
    assert status == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmpg: error:") and key in lines[0], err
    assert not runs.exists()
    assert list(work.iterdir()) == []


def test_cli_missing_config_file(tmp_path, capsys):
    status = main(["train", "--config", str(tmp_path / "nope.yaml"), f"trainer.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("mmpg: error:") and "nope.yaml" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_cli_fields_prints_every_key(capsys):
    assert main(["train", "--fields"]) == 0
    out = capsys.readouterr().out
    for key in all_keys():
        assert f"{key} = " in out, key


def test_cli_fields_of_one_group(capsys):
    assert main(["train", "--fields", "rollout"]) == 0
    out = capsys.readouterr().out
    printed = {k for k in all_keys() if f"{k} = " in out}
    assert printed == {k for k in all_keys() if k.startswith("rollout.")}


def test_cli_fields_of_an_unknown_group(capsys):
    assert main(["train", "--fields", "nosuchgroup"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmpg: error:") and "nosuchgroup" in err and len(err.splitlines()) == 1


def test_cli_train_help_names_every_group(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())   # argparse rewraps the epilog
    assert "config groups: " + ", ".join(GROUPS) in out
    assert "--fields" in out


def test_format_choices_are_the_loaders():
    from mmpg.data.formats import FORMAT_CHOICES

    assert set(CHOICES["data.format"]) == set(FORMAT_CHOICES)


def test_text_fields_keep_the_override_as_written():
    cfg = load_config(None, ["trainer.run_name=off", "reward.function=", "data.template=time_r1",
                             "model.path=models/it's-here", "sft.think=The shape is: visible"])
    assert cfg.trainer.run_name == "off" and cfg.reward.function == "" and cfg.model.path == "models/it's-here"
    assert cfg.sft.think == "The shape is: visible"
    assert load_config(None, ["trainer.run_name=1e3"]).trainer.run_name == "1e3"


def test_video_budget_is_checked_against_the_family():
    """data.* frame and pixel budgets the frame sizing cannot meet: one line naming the keys and the range (the
    trainer checks this before anything loads, tests/test_train_grpo.py)."""
    from mmpg.data.video import VideoSpec

    def q25(**kw):
        return VideoSpec.for_family("qwen2_5_vl", **kw)

    def q3(**kw):
        return VideoSpec.for_family("qwen3_vl", **kw)

    assert q25().budget_problem() is None and q3(min_pixels=1024, max_pixels=1024).budget_problem() is None
    assert "max_pixels=3136 (the default)" not in (q25(max_pixels=3136).budget_problem("data.") or "")
    assert q25(max_pixels=3136).budget_problem("data.").startswith(
        "data.max_pixels=3136 is below data.min_pixels=12544 (the default, 16 tokens of 784 pixels)")
    assert "one visual token per frame (32x32 = 1024 pixels" in q3(min_pixels=784, max_pixels=784).budget_problem()
    assert "need 2 <= min_frames <= max_frames" in q25(min_frames=8, max_frames=4).budget_problem()


def test_training_and_evaluation_share_one_video_block():
    """data.fps, ... and `mmpg eval`'s fps, ... are one VideoSettings block: the same fields, defaults and help texts,
    the same checks (each naming its own key), and held-out evaluation during training takes data.* as it is."""
    from mmpg.config import DataConfig, VideoSettings
    from mmpg.eval.settings import EvalSettings, load_settings
    from mmpg.train.heldout import heldout_settings

    video = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(VideoSettings)}
    assert list(video) == ["fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"]
    for cls in (DataConfig, EvalSettings):
        assert {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls) if f.name in video} == video
    assert "data.fps" in all_keys() and "fps" in [f.name for f in dataclasses.fields(EvalSettings)]
    for override, what in [("fps=0", "must be > 0"), ("min_frames=1", "must be >= 2"),
                           ("max_frames=3", "must be >= min_frames"), ("total_pixels=0", "must be > 0 or null")]:
        assert f"config key 'data.{override.split('=')[0]}'" in _error(overrides=[f"data.{override}"])
        assert what in _error(overrides=[f"data.{override}"])
        with pytest.raises(UserError, match=f"eval setting '{override.split('=')[0]}' .*{what}"):
            load_settings("default", [override])
    cfg = load_config(None, ["data.fps=1", "data.max_frames=8", "data.max_pixels=3136"])
    assert heldout_settings(cfg).video_values() == cfg.data.video_values() == {
        "fps": 1.0, "min_frames": 4, "max_frames": 8, "min_pixels": None, "max_pixels": 3136, "total_pixels": None}
