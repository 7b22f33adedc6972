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

Units and names (docs/options.md). A field whose name ends in a unit (``_s``,
``_seconds``, ``_ms``, ``_bytes``, ``_mb``) holds that unit in code, but its TOML
key and flag drop it and its value carries units (``timeout_s`` is ``--uplink-timeout
5s`` and ``timeout = "5s"``; sizes also take bare bytes). A renamed option keeps its
former spellings for one release (``old=`` names, a section's ``old_prefix``, and the
field's own unit-suffixed name): the former flag still parses, hidden from ``--help``,
with one ``PROG: warning: --old is deprecated; use --new`` line, and the former TOML
key still loads, in its former unit, through :func:`build`'s ``warn``.

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
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from splitinfer.shared.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = dataclasses.MISSING
_SCALARS = (bool, int, float, str, Path)
#: a field-name suffix -> the unit the field holds (its value in code)
UNIT_SUFFIXES = {"_seconds": "s", "_s": "s", "_ms": "ms", "_bytes": "B", "_mb": "MiB"}
#: each unit in seconds or bytes, and whether it is a duration (else a size)
_UNITS: dict[str, tuple[float, bool]] = {
    "s": (1.0, True),
    "ms": (1e-3, True),
    "B": (1.0, False),
    "MiB": (float(2**20), False),
}


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
    name: str | None = None  # the TOML key (and flag stem) if not derived from the field's
    old: tuple[str, ...] = ()  # former names in its table, kept for one release (deprecated)


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
    name: str | None = None,
    old: Iterable[str] = (),
) -> Any:
    """A dataclass field that is an option: a TOML key and (unless ``flag=""``) a flag.

    ``name``: the key when not the field's name less its unit suffix; ``old``: names it
    had before, still read (deprecated) for one release."""
    spec = Spec(
        help,
        flag,
        short,
        metavar,
        tuple(choices),
        minimum,
        positional,
        repeat,
        group,
        parse,
        name,
        tuple(old),
    )
    meta = {"option": spec}
    if default_factory is not _MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(
    cls: type,
    *,
    prefix: str | None = None,
    old_prefix: str | None = None,
    old: Mapping[str, Iterable[str]] | None = None,
) -> Any:
    """A field holding a ``[table]`` of options, flags spelled ``--{prefix}-{name}``
    (``prefix``: the field's name unless given; ``""``: no prefix). Kept for one release
    (deprecated): ``old_prefix``, the prefix its flags had before, and ``old``, the
    former names of its options in this table (``{"threads": ["intra_op_threads"]}``),
    for a section class more than one table shares."""
    former = tuple((k, tuple(v)) for k, v in (old or {}).items())
    meta = {"section": prefix, "old_prefix": old_prefix, "old": former}
    return field(default_factory=cls, metadata=meta)


@dataclass(frozen=True)
class Opt:
    """One option, resolved: where it sits and how it is typed."""

    key: str  # TOML key path, e.g. "uplink.timeout_s" (also the argparse dest)
    name: str
    base: Any  # bool, int, float, str, Path, tuple (of str) or, with spec.parse, anything
    optional: bool  # ``X | None``
    default: Any  # dataclasses.MISSING when required
    spec: Spec
    flag: str | None  # "--uplink-timeout"; None: no flag
    section: str | None
    public: str = ""  # the TOML key in its table: "timeout"
    unit: str | None = None  # the unit the field holds ("s" for timeout_s); None: none
    old_keys: tuple[str, ...] = ()  # former TOML keys in its table (deprecated)
    old_flags: tuple[str, ...] = ()  # former flags (deprecated, hidden from --help)

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
        if self.unit is not None:
            return "DURATION" if _UNITS[self.unit][1] else "SIZE"
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


Former = tuple[tuple[str, tuple[str, ...]], ...]


@functools.cache
def sections(cls: Any) -> dict[str, tuple[type, str, str | None, Former]]:
    """``{field: (section class, flag prefix, former flag prefix, former names)}``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, str, str | None, Former]] = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            prefix = f.metadata["section"]
            meta = f.metadata
            out[f.name] = (
                hints[f.name],
                f.name if prefix is None else prefix,
                meta.get("old_prefix"),
                meta.get("old", ()),
            )
    return out


def unit_of(name: str) -> tuple[str, str | None]:
    """``(name less its unit suffix, the unit)`` of a field name: ``("timeout", "s")``
    for ``timeout_s``; ``(name, None)`` when it names no unit."""
    for suffix, unit in UNIT_SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return name.removesuffix(suffix), unit
    return name, None


def _flag_of(prefix: str | None, name: str) -> str:
    return "--" + "-".join(p.replace("_", "-") for p in (prefix, name) if p)


@functools.cache
def own_options(
    cls: Any,
    section: str | None = None,
    prefix: str = "",
    old_prefix: str | None = None,
    former: Former = (),
) -> tuple[Opt, ...]:
    """The options declared directly on ``cls`` (sections excluded)."""
    hints = typing.get_type_hints(cls)
    renamed = dict(former)
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
        stem, unit = unit_of(f.name) if base in (int, float) else (f.name, None)
        public = spec.name or stem
        olds = (*spec.old, *renamed.get(f.name, ()), f.name)
        old_keys = tuple(n for n in dict.fromkeys(olds) if n != public)
        flag: str | None = None
        old_flags: list[str] = []
        if spec.flag != "" and spec.parse is None:
            name = spec.flag or public
            if spec.positional:
                flag = name
            elif old_prefix is None:
                flag = _flag_of(prefix, name)
                old_flags = [_flag_of(prefix, n) for n in old_keys]
            else:  # every former flag had the former prefix
                flag = _flag_of(prefix, name)
                old_flags = [_flag_of(old_prefix, n) for n in (*old_keys, spec.flag or f.name)]
        key = f"{section}.{public}" if section else public
        old_flags = [o for o in dict.fromkeys(old_flags) if o != flag]
        out.append(
            Opt(
                key,
                f.name,
                base,
                optional,
                _field_default(f),
                spec,
                flag,
                section,
                public,
                unit,
                old_keys,
                tuple(old_flags),
            )
        )
    return tuple(out)


@functools.cache
def options(cls: Any) -> tuple[Opt, ...]:
    """Every option of ``cls`` and of its sections, in definition order."""
    found = list(own_options(cls))
    for name, (sub, prefix, old_prefix, former) in sections(cls).items():
        found.extend(own_options(sub, name, prefix, old_prefix, former))
    return tuple(found)


def unit_text(value: float, unit: str) -> str:
    """A value held in ``unit`` as the text the user writes: ``2.0`` ms -> ``2ms``."""
    from splitinfer.shared.units import format_duration, format_size

    scale, duration = _UNITS[unit]
    return format_duration(value * scale) if duration else format_size(value * scale)


def shown(opt: Opt, value: Any) -> str:
    """``value`` of ``opt`` as ``--help`` and the docs show it (units included)."""
    if opt.unit is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return unit_text(value, opt.unit)
    return _shown(value)


def from_units(text: str, opt: Opt, where: str | None) -> int | float:
    """A value with units (``"5s"``, ``"64MiB"``; a size may be bare bytes, any quantity
    ``0``) in the unit ``opt``'s field holds; ConfigError naming ``where`` (if given)."""
    from splitinfer.shared.links import parse_duration
    from splitinfer.shared.units import parse_size

    assert opt.unit is not None
    scale, duration = _UNITS[opt.unit]
    if text.strip() == "0":
        amount = 0.0
    elif duration:
        amount = parse_duration(text, where)
    else:
        amount = float(parse_size(text, where or "size"))
    value = amount / scale
    if opt.base is int:
        if abs(value - round(value)) > 1e-9 * max(1.0, abs(value)):
            lead = f"{where}=" if where else ""
            raise ConfigError(f"{lead}{text!r}: give a whole number of {opt.unit}")
        return round(value)
    return value


# -- values -----------------------------------------------------------------------------


def coerce(value: Any, opt: Opt, where: str) -> Any:
    """A TOML (or already parsed) value as the option's type; ConfigError naming ``where``.

    An option with a unit takes a number in the unit its field holds, or a text with
    units (``"5ms"``)."""
    if value is None and opt.optional:
        return None
    if opt.unit is not None and isinstance(value, str):
        return from_units(value, opt, where)
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
    """A command-line (or ``key=value``) string as the option's type (an option with a
    unit: a value with units, or a bare number in the unit its field holds)."""
    base = opt.base
    if opt.unit is not None and any(c.isalpha() for c in text):
        return from_units(text, opt, opt.key)
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
        name = f"{prefix}{opt.public}"
        if spec.choices:
            values = value if opt.base is tuple else (value,)
            if not values or any(v not in spec.choices for v in values):
                given = list(value) if opt.base is tuple else value
                raise ConfigError(f"{name}={given!r}: give one of {', '.join(spec.choices)}")
        if spec.minimum is not None:
            if opt.base is int:
                bad = not isinstance(value, int) or isinstance(value, bool) or value < spec.minimum
                what = "an integer"
            else:
                bad = (
                    not isinstance(value, (int, float))
                    or isinstance(value, bool)
                    or not math.isfinite(value)
                    or value < spec.minimum
                )
                what = "a finite number"
            if bad and opt.unit is not None and isinstance(value, (int, float)):
                low = unit_text(spec.minimum, opt.unit)
                raise ConfigError(f"{name}={shown(opt, value)}: must be at least {low}")
            if bad:
                raise ConfigError(f"{name}={value!r}: must be {what} >= {spec.minimum:g}")


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


def build(
    cls: type[T],
    data: Mapping[str, Any],
    where: str | None = "config",
    warn: Callable[[str], None] | None = None,
) -> T:
    """``cls`` from a TOML-shaped mapping: top-level keys plus ``[section]`` tables.

    An unknown key, a wrong type or a missing required option is a ConfigError of
    one line prefixed with ``where`` (the file, or "options" for flags); a value its
    class refuses is the class's own message, which names the option and the value.
    A former key (deprecated) is read in its former unit and told to ``warn`` (one
    line each, prefixed with ``where``).
    """

    def told(message: str) -> None:
        if warn is not None:
            warn(f"{where}: {message}" if where else message)

    try:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table, not {data!r}")
        return _build(cls, data, None, told)
    except _Refused as exc:
        raise ConfigError(str(exc)) from exc.__cause__
    except ConfigError as exc:
        if where is None:
            raise
        raise ConfigError(f"{where}: {exc}") from exc


class _Refused(ConfigError):
    """A value the class itself refused (its message is already complete)."""


def _with_units(value: Any, opt: Opt, path: str) -> Any:
    """A value under an option's key: one with a unit takes units (``"5ms"``), a bare
    number only where it cannot be misread (0, or bytes of a size)."""
    if opt.unit is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return coerce(value, opt, path)
    if value == 0:
        return coerce(0, opt, path)
    if not _UNITS[opt.unit][1] and float(value).is_integer() and value > 0:
        return from_units(str(int(value)), opt, path)
    guess = unit_text(float(value), opt.unit)
    raise ConfigError(f'{path}={value!r}: give it with units, e.g. "{guess}"')


def _build(
    cls: type[T],
    data: Mapping[str, Any],
    section: str | None,
    warn: Callable[[str], None],
    former: Former = (),
) -> T:
    kind: Any = cls
    subs = sections(kind) if section is None else {}
    opts = own_options(kind, section, "", None, former) if section else own_options(kind)
    known = {o.public: o for o in opts}
    renamed = {old: o for o in opts for old in o.old_keys}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{section}.{key}" if section else key
        if key in subs:
            if not isinstance(value, Mapping):
                raise ConfigError(f"[{key}] must be a table")
            kwargs[key] = _build(subs[key][0], value, key, warn, subs[key][3])
            continue
        opt = known.get(key) or renamed.get(key)
        if opt is None:
            names = ", ".join([*known, *subs])
            raise ConfigError(f"{path}: unknown option (known: {names})")
        new = f"{section}.{opt.public}" if section else opt.public
        if opt.name in kwargs:
            raise ConfigError(f"{path}: given twice, under its former and its new name; keep {new}")
        if opt.spec.parse:
            kwargs[opt.name] = opt.spec.parse(value, path)
        elif key in known:
            kwargs[opt.name] = _with_units(value, opt, path)
        else:  # a former name: its former meaning (a number in the unit it named)
            kwargs[opt.name] = coerce(value, opt, path)
            hint = ""
            if opt.unit is not None and isinstance(value, (int, float)):
                hint = f' = "{shown(opt, kwargs[opt.name])}"'
            warn(f"{path} is deprecated; use {new}{hint}")
    for opt in opts:
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


def _converter(opt: Opt, former: bool = False) -> Callable[[str], Any]:
    """The flag's ``type``. With a unit it checks the value and keeps its text
    (:func:`build` reads it): the flag takes units (``5ms``), its ``former`` spelling
    a bare number in the unit it named (``--max-queue-delay-ms 5`` is ``5ms``)."""

    def convert(text: str) -> Any:
        try:
            if opt.unit is None:
                return from_text(text, opt)
            if former:
                from_text(text.strip(), dataclasses.replace(opt, unit=None))
                return f"{text.strip()}{opt.unit}"
            from_units(text, opt, None)
            return text.strip()
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = opt.kind
    return convert


#: what an option's help ends with when it shows its default (or that it has none)
DEFAULT_SHOWN = "(default: "
REQUIRED_SHOWN = "(required)"


def default_text(opt: Opt, negatable: bool = True) -> str:
    """`` (default: X)`` for ``opt``'s help, `` (required)`` for one without a default
    ('' for a plain switch, or help that already says it)."""
    if DEFAULT_SHOWN in opt.spec.help:
        return ""
    if opt.required:
        return f" {REQUIRED_SHOWN}"
    if opt.base is bool:
        plain = opt.name.startswith("no_") or (not negatable and opt.default is False)
        return "" if plain else f" {DEFAULT_SHOWN}{'on' if opt.default else 'off'})"
    if opt.default is None or opt.default in ((), ""):
        return f" {DEFAULT_SHOWN}unset)"
    return f" {DEFAULT_SHOWN}{shown(opt, opt.default)})"


class Deprecated(argparse.Action):
    """A former flag: parsed as before into the new one's ``dest``, hidden from
    ``--help``, and told once on stderr: ``PROG: warning: --old is deprecated; use --new``."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        new: str,
        value: Any = None,
        **kw: Any,
    ) -> None:
        kw.setdefault("nargs", 0 if "type" not in kw else None)
        kw["default"] = argparse.SUPPRESS
        kw["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kw)
        self.new = new
        self.value = value
        self.told = False

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if not self.told:
            self.told = True
            prog = parser.prog.split()[0]
            print(
                f"{prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr
            )
        setattr(namespace, self.dest, self.value if self.nargs == 0 else values)


def _add_former(target: Any, opt: Opt, names: Sequence[str], plain: bool) -> None:
    """The hidden, deprecated flags of ``opt`` (its :attr:`Opt.old_flags`)."""
    assert opt.flag is not None
    for old in opt.old_flags:
        if opt.base is bool:
            target.add_argument(old, action=Deprecated, dest=opt.key, new=opt.flag, value=True)
            if not plain:
                no_old, no_new = "--no-" + old[2:], "--no-" + opt.flag[2:]
                target.add_argument(
                    no_old, action=Deprecated, dest=opt.key, new=no_new, value=False
                )
        elif not opt.spec.repeat:
            former = opt.unit is not None and unit_of(old.replace("-", "_"))[1] is not None
            target.add_argument(
                old,
                action=Deprecated,
                dest=opt.key,
                new=names[-1],
                type=_converter(opt, former=former),
                metavar=opt.metavar,
            )


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
        if not spec.positional:
            text += default_text(opt, negatable)
        text = text.replace("%", "%%")
        target = group_for(opt)
        names = [opt.flag] if spec.short is None else [spec.short, opt.flag]
        if spec.positional:
            target.add_argument(opt.key, type=_converter(opt), metavar=spec.metavar, help=text)
            continue
        kw: dict[str, Any] = {"dest": opt.key, "default": argparse.SUPPRESS, "help": text}
        plain = opt.name.startswith("no_") or (not negatable and opt.default is False)
        _add_former(target, opt, names, plain)
        if opt.base is bool:
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
        table = data
        if opt.section is not None:
            table = data.setdefault(opt.section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"[{opt.section}] must be a table")
        for old in opt.old_keys:  # the flag overrides the file, under either name
            table.pop(old, None)
        table[opt.public] = value
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
            default = f"`{shown(opt, opt.default)}`"
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
