"""One options system: an option is defined once, as a frozen-dataclass field.

An :func:`option` field carries the option's type (its annotation), default,
help, flag spelling, TOML key (the field's name, under its :func:`section`'s
table) and declared validation (``minimum``, ``choices``); the class's
``__post_init__`` adds the rules that tie several options together. From those
classes this module gives every command the same four things:

- :func:`load_toml` reads a ``--config`` file (one-line errors naming the file);
- :func:`build` turns a TOML-shaped mapping into the frozen object, rejecting an
  unknown key or a wrong type with one line that names the key;
- :func:`add_flags` generates the argparse flags (``--section-name``), and
  :func:`merge_flags` lays the given ones over the file's values;
- :func:`check` enforces the declared bounds and choices, with one wording.

``cloud-service``, ``edge-agent``, the Ray Serve ingress (``serve run`` key=value
arguments) and ``partition`` all define their options this way; the CLI turns
every :class:`~splitinfer.shared.errors.ConfigError` into one line and exit 2
(:func:`splitinfer.shared.cli.run_cli`). :func:`markdown_table` renders the
reference tables of docs/edge-agent.md and docs/cloud-service.md from the same
fields (a test keeps the docs equal to it), so one definition shows in
``--help``, in the TOML schema and in the docs.

Why not a library. pydantic 2 (installed here) validates dataclasses, but it
coerces ``"3"`` to ``3`` from a TOML file silently in lax mode, its errors are
multi-line ``ValidationError`` reports in its own words, and it generates no
argparse flags; tyro generates a CLI from dataclasses, but spells flags its own
way (``--uplink.timeout-s``) and would rename every documented flag; cattrs
structures data and does neither flags nor help. What is needed is small on
top of the standard library (dataclasses, argparse, tomllib), keeps every
existing flag and message, and adds no dependency to a lean edge install.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from splitinfer.shared.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = dataclasses.MISSING
_SCALARS = (bool, int, float, str, Path)


@dataclass(frozen=True)
class Spec:
    """What an :func:`option` field declares beyond its type and default."""

    help: str
    flag: str | None = None  # the flag's own name if not the field's; "" = no flag
    short: str | None = None  # e.g. "-o"
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    positional: bool = False
    repeat: bool = False  # a repeatable flag collecting a tuple
    group: str | None = None  # argparse group title for a top-level option
    parse: Callable[[Any, str], Any] | None = None  # TOML value -> field value (tables)


def option(
    default: Any = _MISSING,
    help: str = "",
    *,
    default_factory: Any = _MISSING,
    flag: str | None = None,
    short: str | None = None,
    metavar: str | None = None,
    choices: Iterable[str] = (),
    minimum: float | None = None,
    positional: bool = False,
    repeat: bool = False,
    group: str | None = None,
    parse: Callable[[Any, str], Any] | None = None,
) -> Any:
    """A dataclass field that is an option: a TOML key and (unless ``flag=""``) a flag."""
    spec = Spec(
        help, flag, short, metavar, tuple(choices), minimum, positional, repeat, group, parse
    )
    meta = {"option": spec}
    if default_factory is not _MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, *, prefix: str | None = None) -> Any:
    """A field holding a ``[table]`` of options, flags spelled ``--{prefix}-{name}``
    (``prefix``: the field's name unless given; ``""``: no prefix)."""
    return field(default_factory=cls, metadata={"section": prefix})


@dataclass(frozen=True)
class Opt:
    """One option, resolved: where it sits and how it is typed."""

    key: str  # TOML key path, e.g. "uplink.timeout_s" (also the argparse dest)
    name: str
    base: Any  # bool, int, float, str, Path, tuple (of str) or, with spec.parse, anything
    optional: bool  # ``X | None``
    default: Any  # dataclasses.MISSING when required
    spec: Spec
    flag: str | None  # "--uplink-timeout-s"; None: no flag
    section: str | None

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    @property
    def kind(self) -> str:
        return "list of strings" if self.base is tuple else getattr(self.base, "__name__", "?")

    @property
    def metavar(self) -> str:
        if self.spec.metavar:
            return self.spec.metavar
        if self.spec.choices:
            return "|".join(self.spec.choices)
        if self.base is tuple:
            return "A,B,..."
        return {int: "N", float: "X", Path: "PATH"}.get(self.base, "TEXT")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not _MISSING:
        return f.default
    factory: Any = f.default_factory
    if factory is not _MISSING:
        return factory()
    return _MISSING


@functools.cache
def sections(cls: Any) -> dict[str, tuple[type, str]]:
    """``{field: (section class, flag prefix)}`` of ``cls``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, str]] = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            prefix = f.metadata["section"]
            out[f.name] = (hints[f.name], f.name if prefix is None else prefix)
    return out


@functools.cache
def own_options(cls: Any, section: str | None = None, prefix: str = "") -> tuple[Opt, ...]:
    """The options declared directly on ``cls`` (sections excluded)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        base, optional = _unwrap(hints[f.name])
        if typing.get_origin(base) is tuple:
            base = tuple
        if base not in (*_SCALARS, tuple) and spec.parse is None:
            raise TypeError(f"{cls.__name__}.{f.name}: {base} needs parse= to be an option")
        flag: str | None = None
        if spec.flag != "" and spec.parse is None:
            name = spec.flag or f.name
            if spec.positional:
                flag = name
            else:
                flag = "--" + "-".join(p.replace("_", "-") for p in (prefix, name) if p)
        key = f"{section}.{f.name}" if section else f.name
        out.append(Opt(key, f.name, base, optional, _field_default(f), spec, flag, section))
    return tuple(out)


@functools.cache
def options(cls: Any) -> tuple[Opt, ...]:
    """Every option of ``cls`` and of its sections, in definition order."""
    found = list(own_options(cls))
    for name, (sub, prefix) in sections(cls).items():
        found.extend(own_options(sub, name, prefix))
    return tuple(found)


# -- values -----------------------------------------------------------------------------


def coerce(value: Any, opt: Opt, where: str) -> Any:
    """A TOML (or already parsed) value as the option's type; ConfigError naming ``where``."""
    if value is None and opt.optional:
        return None
    base = opt.base
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is Path:
        if isinstance(value, Path) or (isinstance(value, str) and value):
            return Path(value)
    elif base is tuple:
        if isinstance(value, str) and not opt.spec.repeat:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
    raise ConfigError(f"{where}: {value!r} is not a {opt.kind}")


def from_text(text: str, opt: Opt) -> Any:
    """A command-line (or ``key=value``) string as the option's type."""
    base = opt.base
    if base is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{opt.key}={text!r}: give true or false")
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"invalid int value: {text!r} is not an integer") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"invalid float value: {text!r} is not a number") from None
    if base is Path:
        if not text:
            raise ConfigError("an empty path; give a file or folder")
        return Path(text)
    if base is tuple and not opt.spec.repeat:
        return tuple(v.strip() for v in text.split(",") if v.strip())
    return text


def check(obj: object, prefix: str = "") -> None:
    """Enforce the declared ``minimum`` and ``choices`` of ``obj``'s own options
    (call it from ``__post_init__``); the message names the value and the bound."""
    kind: Any = type(obj)
    for opt in own_options(kind):
        spec = opt.spec
        if spec.minimum is None and not spec.choices:
            continue
        value = getattr(obj, opt.name)
        if value is None and opt.optional:
            continue
        name = f"{prefix}{opt.name}"
        if spec.choices:
            values = value if opt.base is tuple else (value,)
            if not values or any(v not in spec.choices for v in values):
                shown = list(value) if opt.base is tuple else value
                raise ConfigError(f"{name}={shown!r}: give one of {', '.join(spec.choices)}")
        if spec.minimum is not None:
            if opt.base is int:
                bad = not isinstance(value, int) or isinstance(value, bool) or value < spec.minimum
                if bad:
                    raise ConfigError(f"{name}={value!r}: must be an integer >= {spec.minimum:g}")
            elif (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < spec.minimum
            ):
                raise ConfigError(f"{name}={value!r}: must be a finite number >= {spec.minimum:g}")


def at_least(obj: object, name: str, minimum: float) -> None:
    """``check``'s bound for a minimum only known at run time (another option's value)."""
    value = getattr(obj, name)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < minimum:
            raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum:g}")
    elif not isinstance(value, float) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be a finite number >= {minimum:g}")


# -- TOML -------------------------------------------------------------------------------


def load_toml(path: Path | str, what: str = "config file") -> dict[str, Any]:
    """Read a TOML file (a daemon's ``--config``, a credential file, a scenario); any
    problem is a one-line ConfigError that starts with the file and names ``what`` it is."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror}") from exc
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: the {what} is not valid TOML: {exc}") from exc


def set_key(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``KEY.PATH=VALUE`` (VALUE in TOML syntax, a bare word is a string)."""
    path, sep, text = assignment.partition("=")
    keys = [k.strip() for k in path.split(".")]
    if not sep or not all(keys):
        raise ConfigError(
            f"--set {assignment!r}: expected KEY.PATH=VALUE, e.g. models.resnet.latest=2"
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: a string
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {key} is not a table")
        node = child
    node[keys[-1]] = value


def build(cls: type[T], data: Mapping[str, Any], where: str | None = "config") -> T:
    """``cls`` from a TOML-shaped mapping: top-level keys plus ``[section]`` tables.

    An unknown key, a wrong type or a missing required option is a ConfigError of
    one line prefixed with ``where`` (the file, or "options" for flags); a value its
    class refuses is the class's own message, which names the option and the value.
    """
    try:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table, not {data!r}")
        return _build(cls, data, None)
    except _Refused as exc:
        raise ConfigError(str(exc)) from exc.__cause__
    except ConfigError as exc:
        if where is None:
            raise
        raise ConfigError(f"{where}: {exc}") from exc


class _Refused(ConfigError):
    """A value the class itself refused (its message is already complete)."""


def _build(cls: type[T], data: Mapping[str, Any], section: str | None) -> T:
    key: Any = cls
    subs = sections(key) if section is None else {}
    known = {o.name: o for o in (own_options(key, section) if section else own_options(key))}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{section}.{key}" if section else key
        if key in subs:
            if not isinstance(value, Mapping):
                raise ConfigError(f"[{key}] must be a table")
            kwargs[key] = _build(subs[key][0], value, key)
        elif key in known:
            opt = known[key]
            kwargs[key] = (
                opt.spec.parse(value, path) if opt.spec.parse else coerce(value, opt, path)
            )
        else:
            names = ", ".join([*known, *subs])
            raise ConfigError(f"{path}: unknown option (known: {names})")
    for opt in known.values():
        if opt.required and opt.name not in kwargs:
            give = f"give {opt.flag} {opt.metavar}" if opt.flag else "give it"
            raise ConfigError(f"{opt.key}: missing; {give}")
    try:
        return cls(**kwargs)
    except _Refused:
        raise
    except ConfigError as exc:
        if section and not str(exc).startswith(f"{section}."):
            raise _Refused(f"[{section}] {exc}") from exc
        raise _Refused(str(exc)) from exc


# -- flags ------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _converter(opt: Opt) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return from_text(text, opt)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = opt.kind
    return convert


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str | None = None,
    *,
    negatable: bool = True,
) -> None:
    """One flag per option of ``cls`` (and its sections), dest = the TOML key; a flag
    not given leaves no attribute, so it never hides the file's value.

    Booleans get ``--x/--no-x`` (``negatable``; a default-False one only ``--x``
    when not), except names that already say ``no_``.
    """
    groups: dict[str | None, Any] = {}

    def group_for(opt: Opt) -> Any:
        name = opt.section or opt.spec.group or title
        if name is None:
            return parser
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        return groups[name]

    for opt in options(cls):
        if opt.flag is None:
            continue
        spec = opt.spec
        text = spec.help[:-1] if spec.help.endswith(".") and spec.help[-2:] != ".." else spec.help
        if opt.base is bool:
            text += " (default on)" if opt.default is True else ""
        elif opt.default not in (None, (), "", _MISSING):
            text += f" (default {_shown(opt.default)})"
        text = text.replace("%", "%%")
        target = group_for(opt)
        names = [opt.flag] if spec.short is None else [spec.short, opt.flag]
        if spec.positional:
            target.add_argument(opt.key, type=_converter(opt), metavar=spec.metavar, help=text)
            continue
        kw: dict[str, Any] = {"dest": opt.key, "default": argparse.SUPPRESS, "help": text}
        if opt.base is bool:
            plain = opt.name.startswith("no_") or (not negatable and opt.default is False)
            action = "store_true" if plain else argparse.BooleanOptionalAction
            target.add_argument(*names, action=action, **kw)
        elif spec.repeat:
            target.add_argument(*names, action="append", metavar=opt.metavar, **kw)
        else:
            if spec.choices and opt.base is not tuple:  # a list is checked by check()
                kw["choices"] = spec.choices
            target.add_argument(*names, type=_converter(opt), metavar=opt.metavar, **kw)


def merge_flags(data: dict[str, Any], args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Lay the flags given in ``args`` over ``data`` (TOML-shaped); returns ``data``."""
    given = vars(args)
    for opt in options(cls):
        if opt.key not in given:
            continue
        value = given[opt.key]
        if opt.spec.repeat:
            value = tuple(value)
        if opt.section is None:
            data[opt.name] = value
        else:
            table = data.setdefault(opt.section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"[{opt.section}] must be a table")
            table[opt.name] = value
    return data


# -- docs -------------------------------------------------------------------------------


def markdown_table(cls: type) -> str:
    """The reference table of ``cls``'s options: TOML key, flag, default, meaning."""
    rows = ["| key | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for opt in options(cls):
        if opt.required:
            default = "required"
        elif opt.default is None or opt.default in ((), ""):
            default = "unset"
        elif isinstance(opt.default, bool):
            default = "on" if opt.default else "off"
        else:
            default = f"`{_shown(opt.default)}`"
        flag = f"`{opt.flag}`" if opt.flag else ""
        meaning = opt.spec.help.replace("|", "\\|")
        rows.append(f"| `{opt.key}` | {flag} | {default} | {meaning} |")
    return "\n".join(rows)


def markdown_block(cls: type, doc_text: str, name: str) -> tuple[str, str]:
    """(the block between ``<!-- options:NAME -->`` markers in ``doc_text``, the
    block :func:`markdown_table` makes now): a docs test compares them."""
    begin, end = f"<!-- options:{name} begin -->", f"<!-- options:{name} end -->"
    start, stop = doc_text.find(begin), doc_text.find(end)
    found = doc_text[start + len(begin) : stop].strip() if 0 <= start < stop else ""
    return found, markdown_table(cls)


def _print_table(argv: list[str]) -> int:
    """``python -m splitinfer.shared.options MODULE:CLASS``: print its docs table."""
    import importlib

    module, _, name = argv[0].partition(":")
    print(markdown_table(getattr(importlib.import_module(module), name)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_print_table(sys.argv[1:]))
