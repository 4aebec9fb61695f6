"""MkDocs hook: pages generated from the code at build time, so they cannot drift.

Two markers are replaced in the Markdown of any page that holds them:

* ``<!-- outcore:config-reference -->``: every key of ``outcore.config.Config``, walked
  recursively through ``model_fields``, with its type, default and description.
* ``<!-- outcore:notes-index -->``: every ``[Note: ...]`` block defined under ``outcore/``,
  with the file that holds it, grouped by package.

Only ``outcore.config`` is imported (it stays where it is when modules move); the notes are
found by reading the files, so the index follows them wherever they go.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.outcore_docs")

CONFIG_MARKER = "<!-- outcore:config-reference -->"
NOTES_MARKER = "<!-- outcore:notes-index -->"

# A note is *defined* on a line that starts (after indentation and an optional "#") with
# "[Note: title]" and either ends there or goes on with a sentence ("] One Parameter, ...").
# Lines that *cite* a note ("param.py's [Note: ...]", "[Note: x]).") do not match.
NOTE_LINE = re.compile(r"^\s*(?:#\s*)?\[Note: (?P<title>[^\]]+)\](?P<rest>(?:\s+[A-Z`].*)?)\s*$")


# -- shared helpers ---------------------------------------------------------------------------
def repo_root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


# -- the configuration reference --------------------------------------------------------------
def _is_section(annotation: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or `null`" if type(None) in args else "")
    if origin is tuple:
        return "`[" + ", ".join(_type_name(a).strip("`") for a in args) + "]`"
    if annotation is type(None):
        return "`null`"
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def _bounds(field: Any) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    parts = []
    for item in field.metadata:
        for attr, sign in signs.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return ", ".join(parts)


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def default_text(value: Any) -> str:
    """A default as it is written in a JSON or YAML config (the test uses the same form)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def config_fields(model: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, field, owning model) for every field, sections included, depth first."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append((key, field, model))
        if _is_section(field.annotation):
            out.extend(config_fields(field.annotation, key + "."))
    return out


def config_reference() -> str:
    from outcore.config import Config

    lines: list[str] = []
    undocumented: list[str] = []

    def table(model: Any, prefix: str) -> None:
        lines.append("| key | type | default | meaning |")
        lines.append("| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            if _is_section(field.annotation):
                continue
            key = f"{prefix}{name}"
            kind = _type_name(field.annotation)
            bounds = _bounds(field)
            if bounds:
                kind += f", {bounds}"
            value = field.get_default(call_default_factory=True)
            default = f"`{default_text(value)}`"
            if name.endswith("_bytes") and isinstance(value, int) and value > 0:
                default += f" ({_human_bytes(value)})"
            if not field.description:
                undocumented.append(key)
            meaning = _cell(field.description or "—")
            lines.append(f"| `{key}` | {kind} | {default} | {meaning} |")
        lines.append("")

    def section(model: Any, prefix: str, title: str) -> None:
        lines.append(f"## {title}")
        lines.append("")
        doc = " ".join((model.__doc__ or "").split())
        if doc:
            lines.append(doc)
            lines.append("")
        table(model, prefix)
        for name, field in model.model_fields.items():
            if _is_section(field.annotation):
                section(field.annotation, f"{prefix}{name}.", f"`{prefix}{name}`")

    section(Config, "", "Top-level keys")
    defaults = json.dumps(Config().model_dump(mode="json"), indent=2)
    lines += ["## Every default, in one file", "",
              "The configuration `outcore.Config()` builds when given nothing, as JSON "
              "(YAML takes the same keys):", "", "```json", defaults, "```", ""]
    if undocumented:
        log.info("config keys without a description: %s", ", ".join(undocumented))
    return "\n".join(lines)


# -- the index of [Note: ...] blocks -----------------------------------------------------------
def find_notes(root: Path) -> list[dict[str, Any]]:
    """Every note defined under ``root/outcore``: title, path (relative to root), line, summary."""
    notes = []
    for path in sorted((root / "outcore").rglob("*.py")):
        text = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(text, 1):
            m = NOTE_LINE.match(line)
            if not m:
                continue
            body = [m.group("rest").strip()] if m.group("rest").strip() else []
            for following in text[number:]:
                stripped = following.strip()
                if stripped.startswith("#"):
                    stripped = stripped.lstrip("#").strip()
                if not stripped or stripped.startswith('"""') or NOTE_LINE.match(following):
                    break
                body.append(stripped.replace('"""', ""))
            notes.append({"title": m.group("title"), "path": path.relative_to(root).as_posix(),
                          "line": number, "summary": _first_sentence(" ".join(body))})
    return notes


def _first_sentence(text: str, limit: int = 220) -> str:
    m = re.search(r"(?<=\.)\s+(?=[A-Z(`])", text)  # "sec. 5" or "e.g. x" go on
    sentence = text[: m.start()] if m else text
    if len(sentence) > limit:
        sentence = sentence[:limit].rsplit(" ", 1)[0] + " …"
    return sentence


def _package(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[:-1]) + "/"


def notes_index(root: Path) -> str:
    notes = find_notes(root)
    packages: dict[str, list[dict[str, Any]]] = {}
    for note in notes:
        packages.setdefault(_package(note["path"]), []).append(note)
    lines = [f"{len(notes)} notes in {len(packages)} packages, read from the source files "
             "when this site was built.", ""]
    for package in sorted(packages, key=lambda p: (p != "outcore/", p)):
        lines += [f"### `{package}`", "", "| note | where | what it says first |",
                  "| --- | --- | --- |"]
        for note in packages[package]:
            title = _cell(note["title"]).replace("``", "`")
            lines.append(f"| {title} | `{note['path']}:{note['line']}` | "
                         f"{_cell(note['summary'])} |")
        lines.append("")
    return "\n".join(lines)


# -- MkDocs events -----------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    root = str(repo_root(config))
    if root not in sys.path:  # outcore from this checkout, installed or not
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if NOTES_MARKER in markdown:
        markdown = markdown.replace(NOTES_MARKER, notes_index(repo_root(config)))
    return markdown
