"""The `peerd` command: start, status, keygen, export, config validate/show, swarm.

Flags are few and stable; anything else is set in YAML, in ``PEERD_*`` env variables, or with
``-o section.key=value``. Every PeerdError becomes one readable message on stderr and exit code 1
(2 for usage errors, as click does).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from peerd.config import PeerdConfig, dump_config, load_config, parse_overrides, set_dotted
from peerd.errors import PeerdError

F = TypeVar("F", bound=Callable[..., Any])


def _overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Turns the CLI flags that were actually given into a nested override mapping."""
    result = parse_overrides(options.get("override") or ())
    flag_fields = {
        "run_name": "run_name",
        "initial_peers": "swarm.initial_peers",
        "identity": "swarm.identity_path",
        "swarm_secret": "swarm.secret_path",
        "allowlist": "swarm.allowlist_path",
        "host_maddrs": "swarm.host_maddrs",
        "announce_maddrs": "swarm.announce_maddrs",
        "control_host": "control.host",
        "control_port": "control.port",
        "log_level": "logging.level",
        "log_format": "logging.format",
        "resume": "training.resume",
    }
    for option, dotted in flag_fields.items():
        value = options.get(option)
        if value is None or value == ():
            continue
        set_dotted(result, dotted, list(value) if isinstance(value, tuple) else value)
    return result


def config_options(func: F) -> F:
    """The flags shared by every command that builds a config."""
    decorators = [
        click.option("--config", "config_path", type=click.Path(path_type=Path), help="YAML config file."),
        click.option("--run-name", help="Swarm name (run_name)."),
        click.option("--initial-peers", multiple=True,
                     help="Multiaddr of a peer to join through, ending in /p2p/<peer id>. Repeatable."),
        click.option("--identity", type=click.Path(path_type=Path), help="Identity key file from `peerd keygen`."),
        click.option("--swarm-secret", type=click.Path(path_type=Path),
                     help="Swarm secret file from `peerd keygen --swarm-secret`: a private swarm of its holders."),
        click.option("--allowlist", type=click.Path(path_type=Path),
                     help="File of admitted peer ids, one per line: a private swarm of those peers."),
        click.option("--host-maddrs", multiple=True, help="Multiaddr to listen on. Repeatable."),
        click.option("--announce-maddrs", multiple=True, help="Multiaddr to announce to others. Repeatable."),
        click.option("--control-host", help="Control endpoint bind address (loopback unless control.expose)."),
        click.option("--control-port", type=int, help="Control endpoint port; 0 picks a free one."),
        click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"])),
        click.option("--log-format", type=click.Choice(["text", "json"])),
        click.option("-o", "--override", multiple=True, metavar="KEY=VALUE",
                     help="Set any option by its dotted YAML path, e.g. -o swarm.record_ttl=30. Repeatable."),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def _build_config(options: dict[str, Any]) -> PeerdConfig:
    return load_config(options.get("config_path"), _overrides(options))


def _fail(error: PeerdError) -> None:
    click.echo(f"peerd: error: {error}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="peerd")
def cli() -> None:
    """peerd: pool machines over the internet to train one model together."""


@cli.command()
@config_options
@click.option("--resume", is_flag=True, default=None,
              help="Resume training from the newest usable checkpoint in training.checkpoint.directory.")
def start(**options: Any) -> None:
    """Start a peer daemon. Prints one JSON ready line on stdout, then logs on stderr."""
    try:
        config = _build_config(options)
        from peerd.footprint import lean_hivemind
        from peerd.log import route_hivemind_logs, setup_logging

        # before the first hivemind import (route_hivemind_logs)
        lean_hivemind(light=config.light)

        setup_logging(config.logging)
        route_hivemind_logs(config.logging)
        from peerd.daemon import run_daemon

        sys.exit(run_daemon(config))
    except PeerdError as e:
        _fail(e)


@cli.command()
@click.option("--control", help="Control address of the daemon (its ready line's `control`).")
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="Use this config's control address when --control is not given.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for the daemon.")
def status(control: str | None, config_path: Path | None, as_json: bool, timeout: float) -> None:
    """Show a running daemon's identity, state and the peers it sees."""
    from peerd.control.client import fetch_status
    from peerd.tables import format_status

    try:
        address = control or load_config(config_path).control.url
        data = fetch_status(address, timeout=timeout)
    except PeerdError as e:
        _fail(e)
    click.echo(json.dumps(data, indent=2) if as_json else format_status(data))


@cli.command()
@click.argument("path", type=click.Path(path_type=Path), required=False)
@click.option("--swarm-secret", "secret_path", type=click.Path(path_type=Path),
              help="Also (or only) write a new random swarm secret here (mode 0600), for a private swarm.")
@click.option("--force", is_flag=True, help="Replace existing files (an old peer id or secret is lost).")
def keygen(path: Path | None, secret_path: Path | None, force: bool) -> None:
    """Write a new persistent identity to PATH and print its peer id; with --swarm-secret, a swarm secret."""
    from peerd.swarm.identity import generate_identity
    from peerd.wire.membership import generate_secret

    if path is None and secret_path is None:
        raise click.UsageError("give a PATH for an identity, --swarm-secret PATH for a swarm secret, or both")
    try:
        if path is not None:
            click.echo(generate_identity(path, overwrite=force))
        if secret_path is not None:
            generate_secret(secret_path, overwrite=force)
            click.echo(f"wrote a new swarm secret to {secret_path}: give it to the swarm's members (privately) "
                       f"and start each peer with --swarm-secret {secret_path}", err=True)
    except PeerdError as e:
        _fail(e)


@cli.command("export")
@click.option("--checkpoint", "checkpoint_dir", type=click.Path(path_type=Path), required=True,
              help="A peer's checkpoint directory (training.checkpoint.directory).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="A new or empty directory to write.")
@click.option("--step", type=click.IntRange(min=0), help="Export this step's checkpoint instead of the newest.")
@click.option("--merge", is_flag=True,
              help="LoRA runs: write the base model with the adapters merged in (the adapters under adapter/).")
def export(checkpoint_dir: Path, out: Path, step: int | None, merge: bool) -> None:
    """Write the trained model of a checkpoint where other tools load it: for the hf task a directory that
    transformers' from_pretrained loads (a LoRA run: the adapter peft loads), for other tasks model.safetensors
    and task.json. A diloco run exports the swarm's shared parameters."""
    try:
        from peerd.training.export import export_checkpoint

        source = export_checkpoint(checkpoint_dir, out, step, merge)
    except PeerdError as e:
        _fail(e)
    click.echo(f"exported {source} to {out}")


@cli.group()
def config() -> None:
    """Check or print configuration."""


@config.command("validate")
@click.argument("path", type=click.Path(path_type=Path))
def config_validate(path: Path) -> None:
    """Validate a YAML config file (env variables apply too, as at start)."""
    try:
        load_config(path)
    except PeerdError as e:
        _fail(e)
    click.echo(f"{path}: OK")


@config.command("show")
@config_options
def config_show(**options: Any) -> None:
    """Print the effective config after defaults < YAML < env < flags."""
    try:
        click.echo(dump_config(_build_config(options)), nl=False)
    except PeerdError as e:
        _fail(e)


@cli.command("swarm")
@click.option("--peers", "n_peers", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=Path("configs/lm.yaml"),
              show_default=True, help="Config every local peer starts from.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for the swarm.")
@click.option("--duration", type=float, default=120.0, show_default=True,
              help="Seconds to train before stopping (when the config trains).")
@click.option("--interval", type=float, default=10.0, show_default=True, help="Seconds between progress tables.")
@click.option("--open", "open_swarm", is_flag=True,
              help="Run an open swarm; by default the local peers share a fresh swarm secret.")
@click.option("-o", "--override", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Set any option of every peer by its dotted YAML path, e.g. -o training.mode=diloco.")
def swarm(n_peers: int, config_path: Path, timeout: float, duration: float, interval: float,
          open_swarm: bool, overrides: tuple[str, ...]) -> None:
    """Start N local peers on loopback, show the swarm, train together (if the config trains), stop them."""
    from peerd.demo import run_local_swarm

    try:
        sys.exit(run_local_swarm(n_peers, config_path, timeout=timeout, duration=duration, interval=interval,
                                 private=not open_swarm, overrides=overrides))
    except PeerdError as e:
        _fail(e)


def main() -> None:
    cli(prog_name="peerd")
