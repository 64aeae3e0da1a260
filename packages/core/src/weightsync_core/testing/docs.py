"""Engine options as the docs write them, so that a backend's tests can build every one.

A page of the docs site (``docs/``) or a README documents a backend's options in three ways,
all found here:

- a Python dict keyed by backend: ``engine_kwargs={"nixl": {"device": "cuda"}}``;
- a dotted override: ``rollout.checkpoint_engine.engine_kwargs.nixl.ucx_transports=tcp``
  (verl's longer path, ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs...``, too);
- a table whose first column is headed ``engine kwarg``, one option name per row.

Fenced ``text`` blocks (shown output, such as an error for a bad config) are left out.
A test then builds a :class:`~weightsync_core.CheckpointEngineConfig` from each documented
config (which checks it against the backend's typed options) and compares the tables with
the options' fields, so a renamed or misspelt option in the docs fails a test.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DocumentedOptions",
    "check_documented_options",
    "documented_engine_kwargs",
    "documented_option_names",
]

_DICT_START = re.compile(r"engine_kwargs\s*=\s*\{")
_OVERRIDE = re.compile(r"engine_kwargs\.(\w+)\.(\w+)=([^\s`]+)")
_TABLE_HEADER = re.compile(r"^\|\s*engine kwarg\s*\|")
_TABLE_NAME = re.compile(r"^\|\s*`(\w+)`")
_TEXT_BLOCK = re.compile(r"^```text\n.*?^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class DocumentedOptions:
    """One backend's options as one place of a document writes them."""

    backend: str
    options: dict[str, Any]
    line: int
    """1-based line of the document where they are written."""


def documented_engine_kwargs(text: str) -> list[DocumentedOptions]:
    """Every backend-keyed ``engine_kwargs`` dict and every dotted override in ``text``.

    A dict whose values are not all dicts (options of a backend named elsewhere) is left
    out; a dict that is not a Python literal raises, so the docs stay checkable.
    """
    text = _TEXT_BLOCK.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    found = [*_dicts(text), *_overrides(text)]
    return sorted(found, key=lambda item: item.line)


def check_documented_options(path: Path, table_backend: str | None = None) -> list[str]:
    """Build a config from every documented ``engine_kwargs`` in the document at ``path``
    (each is checked against its backend's typed options), and check that every name in its
    ``engine kwarg`` tables is an option of ``table_backend``. Returns what was checked, as
    ``"file:line backend"`` strings.

    Raises:
        AssertionError: naming the file, line, backend and the refusal.
    """
    from weightsync_core.api.config import CheckpointEngineConfig
    from weightsync_core.api.errors import WeightSyncError
    from weightsync_core.api.registry import CheckpointEngineRegistry

    text = path.read_text()
    checked = []
    for documented in documented_engine_kwargs(text):
        where = f"{path.name}:{documented.line} {documented.backend}"
        try:
            CheckpointEngineConfig(backend=documented.backend,
                                   engine_kwargs={documented.backend: documented.options})
        except WeightSyncError as exc:
            raise AssertionError(f"{where}: the documented options are refused: {exc}") from exc
        checked.append(where)
    names = documented_option_names(text)
    if table_backend is not None and names:
        options_class = CheckpointEngineRegistry.get(table_backend).options_class
        fields = {field.name for field in dataclasses.fields(options_class)}
        unknown = sorted(set(names) - fields)
        assert not unknown, (
            f"{path.name}: the engine kwarg table names {unknown}, which {table_backend!r} "
            f"does not take (its options: {sorted(fields)})"
        )
        checked.append(f"{path.name} table {table_backend}")
    return checked


def documented_option_names(text: str) -> list[str]:
    """The option names in the first column of every ``| engine kwarg | ...`` table."""
    names: list[str] = []
    in_table = False
    for line in text.splitlines():
        if _TABLE_HEADER.match(line):
            in_table = True
        elif in_table and not line.startswith("|"):
            in_table = False
        elif in_table and (match := _TABLE_NAME.match(line)):
            names.append(match.group(1))
    return names


def _dicts(text: str) -> list[DocumentedOptions]:
    found = []
    for match in _DICT_START.finditer(text):
        start = match.end() - 1
        literal = _strip_comments(text[start:_closing_brace(text, start) + 1])
        line = text.count("\n", 0, start) + 1
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"line {line}: engine_kwargs is not a Python literal: {exc}") from exc
        if value and all(isinstance(options, dict) for options in value.values()):
            found += [DocumentedOptions(backend, options, line)
                      for backend, options in value.items()]
    return found


def _overrides(text: str) -> list[DocumentedOptions]:
    return [
        DocumentedOptions(match.group(1), {match.group(2): _override_value(match.group(3))},
                          text.count("\n", 0, match.start()) + 1)
        for match in _OVERRIDE.finditer(text)
    ]


def _override_value(raw: str) -> Any:
    """A dotted override's value as the trainer's loader reads it (YAML scalars)."""
    words = {"true": True, "false": False, "null": None}
    if raw.lower() in words:
        return words[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _closing_brace(text: str, start: int) -> int:
    depth = 0
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index
    raise ValueError(f"engine_kwargs at offset {start}: no closing brace")


def _strip_comments(literal: str) -> str:
    """Drop ``# ...`` comments (outside strings) from a multi-line Python literal."""
    return "\n".join(re.sub(r"""#[^"'\n]*$""", "", line) for line in literal.splitlines())
