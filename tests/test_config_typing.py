"""One typing rule for config files, and labels that say where each key came from.

Command-line text is parsed (`--num-envs 8`, `--anneal-lr no`); a file's values are already typed, so they
must match the key's type: a quoted number or a word where a bool is wanted is refused, naming the key, in
YAML, TOML and JSON alike. A plugin factory's options take their types from its signature.
"""

import json
import textwrap

import pytest

from phalanx import config
from phalanx.cli import main, typed_env_options
from phalanx.config import Config, load_file, resolve, sources
from phalanx.envs import registry
from phalanx.errors import ConfigError

PLUGIN = "typing_plugin_env"
PLUGIN_SOURCE = '''
from __future__ import annotations  # annotations arrive as strings: typed all the same

from tests.contract_envs import GoodEnv


def make(num_envs: int = 4, device="cpu", seed: int | None = 0, max_steps: int = 50, scale=0.5, greedy: bool = False,
         label="x", extra=None, rate: float = 1):
    """A contract-keeping env whose options are typed only by its signature."""
    env = GoodEnv(num_envs, device, seed)
    env.options = dict(max_steps=max_steps, scale=scale, greedy=greedy, label=label, extra=extra, rate=rate)
    return env
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{PLUGIN}:make"


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# -- files: typed values must match ------------------------------------------------------------------
@pytest.mark.parametrize("name, text, key", [
    ("c.toml", 'num_envs = "8"\n', "num_envs"),
    ("c.toml", 'anneal_lr = "no"\n', "anneal_lr"),
    ("c.toml", 'lr = "3e-4"\n', "lr"),
    ("c.toml", 'hidden_sizes = "64,64"\n', "hidden_sizes"),
    ("c.toml", "num_envs = true\n", "num_envs"),
    ("c.toml", "num_envs = 8.5\n", "num_envs"),
    ("c.yaml", 'num_envs: "8"\n', "num_envs"),
    ("c.yaml", "anneal_lr: 1\n", "anneal_lr"),
    ("c.yaml", 'anneal_lr: "yes"\n', "anneal_lr"),
    ("c.yaml", 'lr: "3e-4"\n', "lr"),
    ("c.yaml", "device: 0\n", "device"),
    ("c.json", '{"num_envs": "8"}', "num_envs"),
    ("c.json", '{"anneal_lr": "false"}', "anneal_lr"),
])
def test_a_file_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, name, text, key):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=f"config key '{key}' in '{path}' must be ") as e:
        resolve(load_file(path))
    assert "\n" not in str(e.value)


def test_the_refusal_says_how_to_write_the_value(tmp_path):
    with pytest.raises(ConfigError, match="write 8 without quotes"):
        resolve(load_file(write(tmp_path, "c.toml", 'num_envs = "8"\n')))
    with pytest.raises(ConfigError, match="write false without quotes"):
        resolve(load_file(write(tmp_path, "c.toml", 'anneal_lr = "no"\n')))


@pytest.mark.parametrize("name, text", [
    ("c.yaml", "lr: 3e-4\nnum_envs: 8\nanneal_lr: false\ngamma: 1\ntotal_steps: 1e6\nhidden_sizes: [32, 32]\n"),
    ("c.toml", "lr = 3e-4\nnum_envs = 8\nanneal_lr = false\ngamma = 1\ntotal_steps = 1e6\nhidden_sizes = [32, 32]\n"),
    ("c.json", '{"lr": 3e-4, "num_envs": 8, "anneal_lr": false, "gamma": 1, "total_steps": 1e6, "hidden_sizes": [32, 32]}'),
])
def test_typed_file_values_load_in_every_format(tmp_path, name, text):
    cfg = resolve(load_file(write(tmp_path, name, text)))
    assert (cfg.lr, cfg.num_envs, cfg.anneal_lr, cfg.gamma, cfg.total_steps, cfg.hidden_sizes) == (
        3e-4, 8, False, 1.0, 1_000_000, [32, 32])
    assert type(cfg.gamma) is float and type(cfg.total_steps) is int


def test_yaml_reads_unquoted_exponents_as_numbers(tmp_path):
    """PyYAML follows YAML 1.1, where `3e-4` (no dot, no exponent sign) is text; YAML 1.2 reads a number."""
    data = load_file(write(tmp_path, "c.yaml", """\
        a: 3e-4
        b: 1e6
        c: -2.5E+3
        d: .5
        e: 8
        f: 1_000
        g: "3e-4"
        h: 2.5
        i: no
        j: 1.0e-3
    """))
    assert data == {"a": 3e-4, "b": 1e6, "c": -2500.0, "d": 0.5, "e": 8, "f": 1000, "g": "3e-4", "h": 2.5, "i": False,
                    "j": 1e-3}
    assert [type(data[k]) for k in "abcdefghij"] == [float, float, float, float, int, int, str, float, bool, float]


def test_command_line_text_is_still_parsed(tmp_path, capsys):
    path = write(tmp_path, "c.toml", "num_envs = 8\nanneal_lr = true\n")
    assert main(["train", "--config", str(path), "--num-envs", "16", "--anneal-lr", "no", "--lr", "3e-4",
                 "--print-config"]) == 0
    rows = print_config_rows(capsys.readouterr().out)
    assert rows["num_envs"] == (16, "command line") and rows["anneal_lr"] == (False, "command line")
    assert rows["lr"] == (3e-4, "command line")


def test_a_file_refusal_through_the_cli_is_one_line_and_exit_2(tmp_path, capsys):
    path = write(tmp_path, "c.toml", 'num_envs = "8"\n')
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config key 'num_envs' in '{path}' must be int" in err


def test_a_files_env_options_follow_the_declared_types(tmp_path):
    with pytest.raises(ConfigError, match="env option 'max_steps' of 'cartpole' in '.*c.toml' must be int"):
        resolve(load_file(write(tmp_path, "c.toml", 'env = "cartpole"\n[env_options]\nmax_steps = "100"\n')))
    cfg = resolve(load_file(write(tmp_path, "d.toml", 'env = "cartpole"\n[env_options]\nmax_steps = 100\n')))
    assert cfg.env_options["max_steps"] == 100
    with pytest.raises(ConfigError, match="env option 'legacy_phase_order' of 'bucket_brigade' in .* must be bool"):
        resolve(load_file(write(tmp_path, "e.yaml", "env: bucket_brigade\nenv_options: {legacy_phase_order: 'no'}\n")))
    # The env named on the command line types the file's options too.
    with pytest.raises(ConfigError, match="env option 'max_steps' of 'cartpole'"):
        resolve(load_file(write(tmp_path, "f.yaml", "env_options: {max_steps: '100'}\n")), {"env": "cartpole"})


def test_a_files_env_options_follow_a_plugin_factorys_signature(tmp_path, plugin):
    with pytest.raises(ConfigError, match=f"env option 'max_steps' of '{plugin}' in .* must be int"):
        resolve(load_file(write(tmp_path, "c.yaml", f"env: '{plugin}'\nenv_options: {{max_steps: 'abc'}}\n")))
    cfg = resolve(load_file(write(tmp_path, "d.yaml", f"env: '{plugin}'\nenv_options: {{max_steps: 9, extra: 'x'}}\n")))
    assert cfg.env_options == {"max_steps": 9, "extra": "x"}


# -- plugin factories: options typed from the signature ------------------------------------------------
def test_a_plugin_factorys_options_are_typed_from_its_signature(plugin):
    assert registry.option_types(plugin) == {"max_steps": int, "scale": float, "greedy": bool, "label": str,
                                              "rate": float}
    text = {"max_steps": "7", "scale": "2", "greedy": "no", "label": "3", "extra": "[1, 2]", "rate": "1e-2"}
    options = registry.resolve_options(plugin, typed_env_options(plugin, text))
    assert options == {"max_steps": 7, "scale": 2.0, "greedy": False, "label": "3", "extra": [1, 2], "rate": 0.01}
    assert type(options["scale"]) is float
    env = registry.make(plugin, num_envs=2, **options)
    assert env.options["max_steps"] == 7 and env.options["greedy"] is False


@pytest.mark.parametrize("option, text, want", [("max_steps", "abc", "int"), ("greedy", "maybe", "bool"),
                                                ("scale", "big", "float")])
def test_a_plugin_option_that_does_not_convert_is_refused(plugin, option, text, want):
    with pytest.raises(ConfigError, match=f"env option '{option}' of '{plugin}' must be {want}, got '{text}'"):
        registry.resolve_options(plugin, typed_env_options(plugin, {option: text}))


def test_check_env_refuses_a_bad_plugin_option_at_the_command_line(plugin, capsys):
    assert main(["check-env", plugin, "--max-steps", "abc", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err == f"phalanx: error: env option 'max_steps' of '{plugin}' must be int, got 'abc'\n"
    assert main(["check-env", plugin, "--max-steps", "9", "--steps", "4"]) == 0


# -- --print-config: derived keys are labelled as derived ---------------------------------------------
def print_config_rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        key, rest = line.split("=", 1)
        value, source = rest.rsplit("  # ", 1)
        rows[key.strip()] = (json.loads(value), source)
    return rows


def test_print_config_labels_every_derived_key(capsys):
    assert main(["train", "--env", "bucket_brigade", "--critic", "mappo", "--print-config"]) == 0
    rows = print_config_rows(capsys.readouterr().out)
    assert rows["mappo_values"][0] == "per_world" and rows["mappo_values"][1].startswith("derived (critic mappo")
    assert rows["norm_value"] == (True, "derived (critic mappo)")


def test_a_derivation_that_does_not_apply_leaves_the_schema_label(capsys):
    assert main(["train", "--env", "bucket_brigade", "--critic", "mappo", "--param-sharing", "per_role",
                 "--print-config"]) == 0
    assert print_config_rows(capsys.readouterr().out)["mappo_values"] == ("per_agent", "schema")


@pytest.mark.parametrize("layer", [
    {"critic": "mappo"}, {"critic": "mappo", "model": "lstm"}, {"critic": "mappo", "param_sharing": "per_role"},
    {"critic": "mappo", "norm_value": False}, {"critic": "mappo", "mappo_values": "per_agent"}, {"critic": "ippo"},
    {"env": "bucket_brigade", "critic": "mappo"}, {"env": "drone_swarm", "critic": "mappo", "model": "role_attention"},
])
def test_each_label_names_where_the_value_came_from(layer):
    """A key labelled schema holds the schema's default; one labelled derived holds what `derive` gave."""
    cfg = resolve(layer)
    where = sources(cfg, None, layer)
    schema = Config()
    spec = registry.spec(cfg.env)
    derived = config.derive({k: getattr(cfg, k) for k in {*layer, *spec.train_defaults}})
    for key, label in where.items():
        if label == "schema":
            assert getattr(cfg, key) == getattr(schema, key), key
        elif label.startswith("derived"):
            assert label == f"derived ({derived[key][1]})" and getattr(cfg, key) == derived[key][0], key
        elif label.startswith("env "):
            assert getattr(cfg, key) == spec.train_defaults[key] or key == "env_options", key
        else:
            assert label == "command line" and key in layer, key


def test_a_python_caller_is_held_to_the_types_a_config_file_is():
    """`phalanx.train(num_envs="8", anneal_lr="no")` was accepted (its text parsed as the command line's) where a
    config file's "8" and "no" are refused: the same one line now, naming the key (issue 63; failed on main first)."""
    from phalanx import train

    for key, value, want in (("num_envs", "8", "int"), ("anneal_lr", "no", "bool"), ("hidden_sizes", "64,64", "list")):
        with pytest.raises(ConfigError, match=f"config key '{key}' must be (a )?{want}.*got the text"):
            train(env="cartpole", total_steps=64, **{key: value})
        with pytest.raises(ConfigError, match=f"config key '{key}' must be"):
            resolve({"env": "cartpole", key: value})
    with pytest.raises(ConfigError, match="env option 'max_steps' of 'cartpole' must be int"):
        resolve({"env": "cartpole", "env_options": {"max_steps": "30"}})
    assert resolve({"env": "cartpole", "num_envs": 8, "anneal_lr": False}).num_envs == 8


def test_a_number_outside_a_keys_int_choices_is_refused_naming_them():
    """Int choices (play_outcome_plies: 0, 2-6) are named in the one-line error: joined as text, they raised a
    TypeError instead (found by test_faults' random configs with play_outcome_plies 1)."""
    with pytest.raises(ConfigError, match=r"config key 'play_outcome_plies' must be one of 0, 2, 3, 4, 5, 6; got 1"):
        resolve({"env": "connect_four"}, {"play_outcome_plies": 1})
