"""The nested [data.cache] / [data.augment] tables: TOML, --data.cache.key overrides,
round trip through the resolved config, and errors that name the key."""

from __future__ import annotations

import pytest

from trainforge.cli import main as cli_main
from trainforge.config import config_to_toml, load_config
from trainforge.errors import ConfigError

TOML = '''
[data]
prefetch_depth = 3
on_corrupt = "skip"

[data.cache]
dir = "/tmp/tf-cache"
memory_mb = 256

[data.augment]
seed = 7
transforms = [{name = "span_corruption", p = 0.5, rate = 0.15}, {name = "token_replace", p = 0.1}]
'''


def test_nested_tables_load_override_and_round_trip(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    cfg = load_config(path, ["--data.cache.memory_mb", "64", "--data.augment.seed=9"])
    d = cfg.data
    assert (d.prefetch_depth, d.on_corrupt, d.cache.dir, d.cache.memory_mb, d.cache.disk_mb) == \
        (3, "skip", "/tmp/tf-cache", 64, 20480)
    assert d.augment.seed == 9 and [t["name"] for t in d.augment.transforms] == ["span_corruption", "token_replace"]
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(config_to_toml(cfg))
    assert load_config(resolved) == cfg
    # A resumed run's saved config is the base; a file's [data.cache] changes only its own keys.
    import tomllib

    over = tmp_path / "over.toml"
    over.write_text("[data.cache]\ndisk_mb = 5\n")
    again = load_config(over, base=tomllib.loads(resolved.read_text()))
    assert (again.data.cache.dir, again.data.cache.memory_mb, again.data.cache.disk_mb) == ("/tmp/tf-cache", 64, 5)
    # train --help lists the sub-table's keys with their defaults
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    block = out[out.index("  --data.cache.memory_mb INT"):out.index("  --data.cache.disk_mb")]
    assert "default: 1024)" in block


@pytest.mark.parametrize("overrides, needle", [
    (["--data.cache.memroy_mb", "1"], "unknown config key 'data.cache.memroy_mb'"),
    (["--data.cache.memory_mb", "-1"], "data.cache.memory_mb"),
    (["--data.cache", "5"], "'data.cache' = '5': it is a table"),
    (["--data.prefetch_depth.x", "1"], "'data.prefetch_depth' is a value"),
    (["--data.on_corrupt", "ignore"], "data.on_corrupt"),
    (["--data.timeout_s", "0"], "data.timeout_s"),
    (["--parallel.pp", "2", "--data.augment.transforms", '[{name = "seq_curriculum"}]'], "parallel.pp > 1"),
])
def test_bad_nested_keys_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, overrides)


def test_bad_nested_toml_names_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[data.cache]\nmemory_mb = '64'\n")
    with pytest.raises(ConfigError, match="data.cache.memory_mb.*wrong type"):
        load_config(path)
    path.write_text("[data]\naugment = 3\n")
    with pytest.raises(ConfigError, match="'data.augment' = 3: it is a table"):
        load_config(path)
