"""mkdocs hook (mkdocs.yml `hooks:`): pages generated from the code and files they describe, at build time.

- ``reference/config.md``: every option of the pydantic config tree (``peerd.config.PeerdConfig``), with its
  type, default, bounds and description, and the options of each built-in task (``TASK_OPTIONS``).
- ``reference/cli.md``: every command and flag of the click group ``peerd.cli.cli``.
- ``protocols/<name>.md``: the wire schemas of ``protocols/`` as they are in the repository.
- ``changelog.md``: ``CHANGELOG.md``.

Nothing is written into docs/; tests/unit/test_docs.py imports this module to check that the references cover
every option and flag. ``python scripts/docs_hooks.py config|cli`` prints a reference.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from peerd.tasks.registry import BUILTIN_OPTIONS

ROOT = Path(__file__).resolve().parents[1]

# The options model of each built-in task (training.task.name -> its training.task.options), as
# "module:Class", from the task registry; tests/unit/test_docs.py checks that every built-in task has one.
TASK_OPTIONS: list[tuple[str, str]] = sorted(BUILTIN_OPTIONS.items())

# Titles of the wire schemas in protocols/; every *.proto and *.schema.json there becomes a page
# protocols/<stem>.md (a new file needs a line in mkdocs.yml's nav, or the strict build fails).
PROTOCOL_TITLES: dict[str, str] = {
    "peerd_membership.proto": "Membership handshake",
    "peerd_averaging.proto": "All-reduce",
    "peerd_training.proto": "Training-state transfer",
    "peerd_experts.proto": "Remote expert calls",
    "peer_record.v1.schema.json": "Peer record (JSON schema)",
}


# ---------------------------------------------------------------------------------------------- config


def load_object(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def task_options() -> list[tuple[str, type[BaseModel]]]:
    return [(name, load_object(path)) for name, path in TASK_OPTIONS]


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (also through ``X | None``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [m for m in (section_model(a) for a in get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "min. length"),
           ("max_length", "max. length"))


def bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for attr, symbol in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}{size_text(value) if value >= 2**20 else ''}")
        if getattr(item, "allow_inf_nan", None) is False:
            parts.append("finite")
        if getattr(item, "pattern", None):
            parts.append(f"matches `{item.pattern}`")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return "`" + json.dumps(to_jsonable_python(value), ensure_ascii=False) + "`" + size_text(value)


def cell(text: str) -> str:
    """One table cell: one line; outside code spans, pipes escaped and ``<`` shown as text, not HTML."""
    parts = " ".join(text.split()).replace("``", "`").split("`")
    for i in range(0, len(parts), 2):  # outside code spans (Markdown's tables leave pipes in code spans alone)
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "`".join(parts)


def size_text(value: Any) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if isinstance(value, int) and value >= scale and value % scale == 0:
            return f" ({value // scale} {unit})"
    return ""


def anchor(dotted: str) -> str:
    return dotted.replace(".", "-").replace("_", "-")


def doc_of(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if doc and doc != BaseModel.__doc__:
        return inspect.cleandoc(doc)
    return ""


def walk_models(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """``(dotted path, model)`` for ``model`` and every section below it, depth first."""
    yield prefix, model
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        if sub is not None:
            yield from walk_models(sub, f"{prefix}.{name}" if prefix else name)


def model_table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| option | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        sub = section_model(field.annotation)
        description = field.description or ""
        kind = type_name(field.annotation)
        if sub is not None:
            first_line = doc_of(sub).split("\n\n")[0]
            description = description or first_line
            description += f" See [{dotted}](#{anchor(dotted)})."
            kind = "section | null" if "null" in kind else "section"
        if dotted == "training.task.options":
            description += " See [task options](#task-options)."
        lines.append(f"| `{dotted}` | {cell(kind)} | {cell(default_text(field))} | {cell(bounds(field))} | "
                     f"{cell(description)} |")
    return lines


def model_sections(root: type[BaseModel], prefix: str, level: str) -> list[str]:
    out: list[str] = []
    for dotted, model in walk_models(root, prefix):
        title = dotted or "top level"
        out += ["", f"{level} {title} {{#{anchor(dotted) or 'top-level'}}}", ""]
        doc = doc_of(model)
        if doc:
            out += [doc.replace("``", "`"), ""]
        out += model_table(model, dotted)
    return out


def config_reference() -> str:
    from peerd.config import ENV_PREFIX, PeerdConfig

    out = [
        "# Configuration reference",
        "",
        ("Generated from the pydantic models in `peerd/config/` (and, for task options, the task's own options "
        "model) when the site is built, so it always matches the code. How the sources combine is on the "
        "[configuration page](../configuration.md)."),
        "",
        (f"Every option is a YAML key (its dotted path: `swarm.record_ttl` is `record_ttl` under `swarm:`), an "
        f"environment variable (`{ENV_PREFIX}` and the path with `__`: `{ENV_PREFIX}SWARM__RECORD_TTL=30`; "
        "lists and mappings as JSON) and a command-line override (`-o swarm.record_ttl=30`). Unknown keys are "
        "errors at every level."),
    ]
    out += model_sections(PeerdConfig, "", "##")
    out += ["", "## Task options {#task-options}", "",
            ("`training.task.options` is validated by the task that `training.task.name` names. The built-in "
            "tasks accept these options (unknown keys are errors); a custom `package.module:function` task "
            "validates its own.")]
    for name, options in task_options():
        prefix = "training.task.options"
        out += ["", f"### Task `{name}` {{#task-{anchor(name)}}}", "",
                f"With `training.task.name: {name}`."]
        for dotted, model in walk_models(options, prefix):
            if dotted != prefix:
                out += ["", f"#### {dotted} (task `{name}`) {{#task-{anchor(name)}-{anchor(dotted)}}}"]
            doc = doc_of(model)
            out += [""] + ([doc.replace("``", "`"), ""] if doc else [])
            out += [line.replace(f"(#{anchor(prefix)}", f"(#task-{anchor(name)}-{anchor(prefix)}")
                    for line in model_table(model, dotted)]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------- cli


def walk_commands(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from walk_commands(command.commands[name], (*path, name))


def _context(path: tuple[str, ...], root: click.Group) -> click.Context:
    ctx = click.Context(root, info_name=path[0])
    command: click.Command = root
    for name in path[1:]:
        assert isinstance(command, click.Group)
        command = command.commands[name]
        ctx = click.Context(command, info_name=name, parent=ctx)
    return ctx


def param_row(param: click.Parameter, ctx: click.Context) -> str:
    if isinstance(param, click.Argument):
        name = f"`{param.human_readable_name}`"
        required = "required" if param.required else "optional"
        return f"| {name} | argument | {cell(_type_text(param))} | {required} | |"
    assert isinstance(param, click.Option)
    names = ", ".join(f"`{opt}`" for opt in (*param.opts, *param.secondary_opts))
    kind = "flag" if param.is_flag else _type_text(param)
    if param.multiple:
        kind += ", repeatable"
    default = param.get_default(ctx, call=False)
    unset = default is None or default == () or callable(default) or type(default).__name__ == "Sentinel"
    if param.is_flag and (unset or not default):
        shown = "off"
    elif unset:
        shown = ""
    else:
        shown = f"`{default}`"
    return f"| {names} | option | {cell(kind)} | {cell(shown)} | {cell(param.help or '')} |"


def _type_text(param: click.Parameter) -> str:
    if isinstance(param.type, click.Choice):
        return " | ".join(str(c) for c in param.type.choices)
    if isinstance(param.type, click.Path):
        return "path"
    if isinstance(param.type, click.types.IntRange):
        return f"integer {param.type.min}..{param.type.max}"
    return str(param.type.name)


def cli_reference() -> str:
    from peerd.cli import cli

    out = ["# CLI reference", "",
           ("Generated from the click commands in `peerd/cli.py` when the site is built, so it always matches "
           "`peerd --help`. Options that set configuration override YAML and the environment; any other "
           "option is set with `-o section.key=value` (see the [configuration reference](config.md)).")]
    for path, command in walk_commands(cli, ("peerd",)):
        ctx = _context(path, cli)
        title = " ".join(path)
        out += ["", f"## {title} {{#{anchor('-'.join(path))}}}", ""]
        out += [inspect.cleandoc(command.help or ""), "", "```", command.get_usage(ctx), "```", ""]
        if isinstance(command, click.Group):
            out += ["Commands: " + ", ".join(f"[`{title} {name}`](#{anchor('-'.join((*path, name)))})"
                                             for name in sorted(command.commands)), ""]
        params = list(command.get_params(ctx))
        out += ["| name | kind | type | default | description |", "|---|---|---|---|---|"]
        out += [param_row(param, ctx) for param in params]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------- pages


def protocol_page(source: Path) -> str:
    text = source.read_text()
    title = PROTOCOL_TITLES.get(source.name, source.name)
    language = "protobuf" if source.suffix == ".proto" else "json"
    fence = "````" if "```" in text else "```"
    return (f"# {title}: `{source.name}`\n\nThe schema as it is in `protocols/{source.name}` (generated into the "
            f"site when it is built). What it is for: [protocols](../protocols.md).\n\n{fence}{language}\n{text}"
            f"{'' if text.endswith(chr(10)) else chr(10)}{fence}\n")


def generated_pages() -> dict[str, str]:
    pages = {"reference/config.md": config_reference(), "reference/cli.md": cli_reference(),
             "changelog.md": (ROOT / "CHANGELOG.md").read_text()}
    protocols = ROOT / "protocols"
    for source in sorted(protocols.glob("*.md")):
        pages[f"protocols/{source.name}"] = source.read_text()
    for source in sorted([*protocols.glob("*.proto"), *protocols.glob("*.schema.json")]):
        stem = source.name.removesuffix(".schema.json").removesuffix(".proto")
        pages[f"protocols/{stem}.md"] = protocol_page(source)
    return pages


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page, content in generated_pages().items():
        files.append(File.generated(config, page, content=content))
    return files


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("config", "cli"):
        sys.exit("usage: python scripts/docs_hooks.py config|cli")
    print(config_reference() if which == "config" else cli_reference(), end="")
