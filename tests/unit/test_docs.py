"""The docs: the site builds with --strict (a broken link or anchor fails), fetches nothing from elsewhere, and its
generated references cover every config option, task option, command and flag; the README stays short and its
links resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import click
from pydantic import BaseModel

from peerd.cli import cli
from peerd.config import PeerdConfig
from peerd.tasks.registry import BUILTIN_TASKS

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200


def load_hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("peerd_docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()


def models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """Every pydantic model an annotation holds, however nested (``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from models_in(arg)


def option_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every option's dotted path; an option that is not a section must describe itself."""
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        keys.append(dotted)
        subs = list(models_in(field.annotation))
        assert subs or field.description, f"{dotted} has no description (Field(description=...))"
        for sub in subs:
            keys += option_keys(sub, dotted)
    return keys


def sections(markdown: str, level: str) -> dict[str, str]:
    """Heading text (without its {#id}) -> the text up to the next heading of the same level."""
    parts = re.split(rf"^{level} (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"\s*\{#[^}]*\}$", "", title): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_config_reference_lists_every_option() -> None:
    reference = hooks.config_reference()
    keys = option_keys(PeerdConfig)
    assert len(keys) > 100
    missing = [key for key in keys if f"| `{key}` |" not in reference]
    assert not missing, f"options missing from the generated configuration reference: {missing}"


def test_config_reference_lists_every_task_option() -> None:
    listed = [name for name, _ in hooks.TASK_OPTIONS]
    assert sorted(listed) == sorted(BUILTIN_TASKS), \
        "every built-in task needs its options model in BUILTIN_OPTIONS (peerd/tasks/registry.py)"
    tasks = sections(hooks.config_reference(), "###")
    for name, options in hooks.task_options():
        text = tasks[f"Task `{name}`"]
        keys = option_keys(options, "training.task.options")
        missing = [key for key in keys if f"| `{key}` |" not in text]
        assert not missing, f"options of task {name} missing from the configuration reference: {missing}"


def commands(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def test_cli_reference_lists_every_command_and_flag() -> None:
    listed = sections(hooks.cli_reference(), "##")
    checked = 0
    for path, command in commands(cli, ("peerd",)):
        title = " ".join(path)
        assert title in listed, f"command `{title}` is missing from the CLI reference"
        text = listed[title]
        for param in command.params:
            names = [param.human_readable_name] if isinstance(param, click.Argument) else \
                [*param.opts, *param.secondary_opts]
            for name in names:
                assert f"`{name}`" in text, f"`{title}`: {name} is missing from the CLI reference"
                checked += 1
    assert checked > 30


def test_site_builds_strict_and_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "reference/config.html", "reference/cli.html", "benchmarks.html",
                 "your-model.html", "changelog.html", "protocols/peerd_averaging.html"):
        assert (site / page).is_file(), page
    # Nothing loads from elsewhere: no font service, CDN script or stylesheet, analytics, or repository API
    # (the pages may name this machine's own addresses, as examples of a daemon's endpoints).
    allowed = {"http://www.w3.org/2000/svg", "http://www.sitemaps.org/schemas/sitemap/0.9"}
    for path in site.rglob("*"):
        if path.suffix in (".html", ".xml"):
            urls = {url for url in re.findall(r"https?://[^\s\"'<>)]+", path.read_text())
                    if url not in allowed and not re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", url)}
            assert not urls, f"{path.relative_to(site)} refers to {sorted(urls)}"
            assert 'class="mermaid"' not in path.read_text(), "mermaid diagrams load their renderer from a CDN"
        elif path.suffix == ".css":
            assert not re.search(r"url\(\s*['\"]?https?:|@import", path.read_text()), path


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    broken = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
