from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from peerd.cli import cli
from peerd.config import PeerdConfig, load_config
from peerd.errors import AddressError, ConfigError

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"
OTHER = "/dns/bootstrap/tcp/4000/p2p/12D3KooWMaTSuVuheoHUBtyu5rhcR8eQuYEhNzVauVBWThp1dhkY"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_reach_other_hosts_and_keep_control_local() -> None:
    config = load_config()
    assert config.swarm.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert config.control.host == "127.0.0.1"
    assert config.swarm.initial_peers == []


def test_precedence_defaults_yaml_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "run_name: from-yaml\nswarm:\n  record_ttl: 30\n  record_refresh_period: 3\n")
    config = load_config(path)
    assert (config.run_name, config.swarm.record_ttl, config.swarm.record_refresh_period) == ("from-yaml", 30, 3)
    assert config.control.port == 7710  # untouched default

    monkeypatch.setenv("PEERD_RUN_NAME", "from-env")
    monkeypatch.setenv("PEERD_SWARM__RECORD_TTL", "40")
    config = load_config(path)
    assert (config.run_name, config.swarm.record_ttl, config.swarm.record_refresh_period) == ("from-env", 40, 3)

    config = load_config(path, {"run_name": "from-cli", "swarm": {"initial_peers": [PEER]}})
    assert config.run_name == "from-cli"
    assert config.swarm.record_ttl == 40  # env still beats YAML for fields the CLI did not set
    assert config.swarm.record_refresh_period == 3
    assert config.swarm.initial_peers == [PEER]


def test_env_list_of_initial_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERD_SWARM__INITIAL_PEERS", f'["{PEER}", "{OTHER}"]')
    assert load_config().swarm.initial_peers == [PEER, OTHER]


@pytest.mark.parametrize(
    "text, field",
    [
        ("swarm:\n  initial_peer: []\n", "swarm.initial_peer"),
        ("colour: blue\n", "colour"),
        ("control:\n  port: 70000\n", "control.port"),
        ("swarm:\n  record_ttl: 1\n  record_refresh_period: 5\n", "swarm"),
        ("control:\n  host: 0.0.0.0\n", "control"),
        ("run_name: 'has spaces'\n", "run_name"),
    ],
)
def test_invalid_yaml_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.field == field
    assert field in str(info.value)


def test_cross_field_error_names_the_option_to_change(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="raise swarm.record_ttl"):
        load_config(write(tmp_path, "swarm:\n  record_ttl: 1\n  record_refresh_period: 5\n"))


def test_exposed_control_endpoint_is_explicit() -> None:
    config = load_config(overrides={"control": {"host": "0.0.0.0", "expose": True}})
    assert config.control.host == "0.0.0.0"


def test_bad_multiaddr_in_yaml_is_an_address_error(tmp_path: Path) -> None:
    with pytest.raises(AddressError) as info:
        load_config(write(tmp_path, "swarm:\n  initial_peers: ['/ip4/1.2.3/tcp/1/p2p/x']\n"))
    assert "swarm.initial_peers[0]" in str(info.value)
    assert "/ip4/1.2.3/tcp/1/p2p/x" in str(info.value)


def test_unreadable_and_non_mapping_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "swarm: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_example_configs_are_valid() -> None:
    for path in sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml")):
        assert isinstance(load_config(path), PeerdConfig), path


def test_cli_config_validate_and_show(tmp_path: Path) -> None:
    runner = CliRunner()
    good = write(tmp_path, "run_name: abc\n")
    result = runner.invoke(cli, ["config", "validate", str(good)])
    assert result.exit_code == 0 and "OK" in result.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("swarm:\n  ttl: 3\n")
    result = runner.invoke(cli, ["config", "validate", str(bad)])
    assert result.exit_code == 1
    assert "swarm.ttl" in result.output and "unknown option" in result.output

    result = runner.invoke(
        cli, ["config", "show", "--config", str(good), "--initial-peers", PEER, "-o", "swarm.record_ttl=33"]
    )
    assert result.exit_code == 0, result.output
    assert "run_name: abc" in result.output and PEER in result.output and "record_ttl: 33.0" in result.output


def test_cli_bad_initial_peer_is_a_readable_error() -> None:
    result = CliRunner().invoke(cli, ["config", "show", "--initial-peers", "/ip4/1.2.3.4/tcp/1"])
    assert result.exit_code == 1
    assert "swarm.initial_peers[0]" in result.output and "/p2p/" in result.output
    assert "Traceback" not in result.output


def test_the_dht_runs_on_the_daemons_loop_for_a_light_peer_unless_told_otherwise() -> None:
    light, trainer = PeerdConfig(), PeerdConfig(training={"enabled": True})
    assert light.light and light.dht_in_process
    assert not trainer.light and not trainer.dht_in_process  # its answers must not wait on a training step
    assert PeerdConfig(training={"enabled": True}, swarm={"dht_host": "daemon"}).dht_in_process
    assert not PeerdConfig(swarm={"dht_host": "child"}).dht_in_process
    with pytest.raises(ValueError, match="dht_host"):
        PeerdConfig(swarm={"dht_host": "thread"})


def test_top_k_pseudo_gradients_take_no_outer_momentum_unless_one_is_set(tmp_path: Path) -> None:
    """Top-k's error-feedback residual carries what each round leaves out, as an outer momentum would."""
    topk = {"averaging": {"codec": {"scheme": "topk"}}, "training": {"mode": "diloco"}}
    assert load_config(overrides={"training": {"mode": "diloco"}}).training.diloco.outer_momentum == 0.9
    assert load_config(overrides=topk).training.diloco.outer_momentum == 0.0
    config = tmp_path / "momentum.yaml"
    config.write_text("training: {mode: diloco, diloco: {outer_momentum: 0.9}}\n")  # set, even to the default
    explicit = load_config(config, overrides={"averaging": {"codec": {"scheme": "topk"}}})
    assert explicit.training.diloco.outer_momentum == 0.9
