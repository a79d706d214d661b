"""The config schema's value rules: each normalises an accepted value or rejects it, and a
section is a frozen dataclass whose fields carry a default and a rule (``_key``).

Types follow YAML, not Python's truthiness: in a file ``comm_fusion: "true"`` is a string and an
error. Overrides come from a shell, where quoting is easy to get wrong, so there (and only there,
``lenient``) the strings ``true``/``false``/``yes``/``no``/``on``/``off`` are accepted for bool keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from gradpool.app.errors import ConfigValueError


# --------------------------------------------------------------------------------------------
# Value rules: each one normalises an accepted value or raises _Reject; the caller adds the
# key path and the source, so every rule's error names key, given value and allowed values.
# --------------------------------------------------------------------------------------------
class _Reject(Exception):
    """Internal: a rule refused a value; ``why`` optionally sharpens the message."""

    def __init__(self, why: str = ""):
        super().__init__(why)
        self.why = why


_TRUE_WORDS = {"true", "yes", "on"}
_FALSE_WORDS = {"false", "no", "off"}


@dataclass(frozen=True)
class Bool:
    nullable: bool = False

    def describe(self) -> str:
        return "a bool (true or false)" + (" or null" if self.nullable else "")

    def coerce(self, value: Any, lenient: bool) -> Optional[bool]:
        if value is None and self.nullable:
            return None
        if isinstance(value, bool):
            return value
        if lenient and isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
        raise _Reject()


@dataclass(frozen=True)
class BoolOr:
    """A bool, or one of ``words``: a mode beyond on and off (``check_unit_order: strict``)."""

    words: Tuple[str, ...]

    def describe(self) -> str:
        return "a bool (true or false) or " + " or ".join(repr(w) for w in self.words)

    def coerce(self, value: Any, lenient: bool):
        if isinstance(value, str) and value.strip().lower() in self.words:
            return value.strip().lower()
        return Bool().coerce(value, lenient)


@dataclass(frozen=True)
class Choice:
    options: Tuple[str, ...]
    nullable: bool = False

    def describe(self) -> str:
        text = "one of " + ", ".join(repr(o) for o in self.options)
        return text + " or null" if self.nullable else text

    def coerce(self, value: Any, lenient: bool) -> Optional[str]:
        if value is None and self.nullable:
            return None
        if isinstance(value, str):
            # Case-insensitive so "cpu" or "AVG" work; stored in the canonical spelling.
            for option in self.options:
                if value.lower() == option.lower():
                    return option
            close = difflib.get_close_matches(value, self.options, n=1)
            raise _Reject(f"did you mean {close[0]!r}?" if close else "")
        raise _Reject()


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python; `steps: true` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Int:
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    multiple_of: Optional[int] = None
    nullable: bool = False

    def describe(self) -> str:
        parts = ["an integer"]
        if self.minimum is not None:
            parts.append(f">= {self.minimum}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum}")
        if self.multiple_of is not None:
            parts.append(f"and a multiple of {self.multiple_of}")
        text = " ".join(parts)
        return text + " or null" if self.nullable else text

    def coerce(self, value: Any, lenient: bool) -> Optional[int]:
        if value is None and self.nullable:
            return None
        if not _is_int(value):
            raise _Reject()
        if self.minimum is not None and value < self.minimum:
            raise _Reject()
        if self.maximum is not None and value > self.maximum:
            raise _Reject()
        if self.multiple_of is not None and value % self.multiple_of:
            raise _Reject()
        return value


@dataclass(frozen=True)
class PositiveNumber:
    nullable: bool = False

    def describe(self) -> str:
        text = "a finite number > 0"
        return text + " or null" if self.nullable else text

    def coerce(self, value: Any, lenient: bool) -> Optional[float]:
        if value is None and self.nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Reject()
        if not math.isfinite(value) or value <= 0:
            raise _Reject()
        return float(value)


@dataclass(frozen=True)
class Text:
    nullable: bool = False

    def describe(self) -> str:
        text = "a non-empty string"
        return text + " or null" if self.nullable else text

    def coerce(self, value: Any, lenient: bool) -> Optional[str]:
        if value is None and self.nullable:
            return None
        if isinstance(value, str) and value:
            return value
        raise _Reject()


@dataclass(frozen=True)
class ListOf:
    """A non-empty YAML list whose every item obeys ``item``; stored as a tuple (hashable)."""

    item: Any
    nullable: bool = False
    unique: bool = False

    def describe(self) -> str:
        text = f"a non-empty list of {self.item.describe().replace('a ', '', 1)}s"
        if self.unique:
            text += ", each once"
        return text + " or null" if self.nullable else text

    def coerce(self, value: Any, lenient: bool) -> Optional[tuple]:
        if value is None and self.nullable:
            return None
        if not isinstance(value, (list, tuple)) or not value:
            raise _Reject()
        items = tuple(self.item.coerce(v, lenient) for v in value)
        if self.unique and len(set(items)) != len(items):
            raise _Reject("an item repeats")
        return items


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvValue:
    """An environment variable's value: a string, or a number written without quotes (YAML reads
    ``HCCL_BUFFSIZE: 200`` as an int). Bools and null are refused: YAML 1.1 turns ``on``/``no``
    into bools, and the process would see ``True``."""

    def describe(self) -> str:
        return "a string (without NUL bytes) or a number"

    def coerce(self, value: Any, lenient: bool) -> str:
        if isinstance(value, str):
            if "\0" in value:          # no process environment can hold it
                raise _Reject()
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return str(value)
        raise _Reject()


@dataclass(frozen=True)
class EnvMapping:
    """A YAML mapping of environment variable names to values; stored as a tuple of
    ``(name, value)`` pairs (hashable, in the order written)."""

    value: Any = EnvValue()

    def describe(self) -> str:
        return "a mapping of environment variable names to strings or numbers"

    def coerce(self, value: Any, lenient: bool) -> tuple:
        if isinstance(value, Mapping):
            items = list(value.items())
        elif isinstance(value, (tuple, list)) and all(
                isinstance(item, (tuple, list)) and len(item) == 2 for item in value):
            items = [tuple(item) for item in value]      # the stored form, built in code
        else:
            raise _Reject()
        out = []
        for name, item in items:
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise _Reject(f"{name!r} is not an environment variable name")
            try:
                out.append((name, self.value.coerce(item, lenient)))
            except _Reject:
                raise _Reject(f"{name} = {item!r} is not {self.value.describe()}") from None
        if len({name for name, _ in out}) != len(out):
            raise _Reject("a name repeats")
        return tuple(out)


def _key(default: Any, rule: Any):
    """A config key: its default and the rule its values obey."""
    return field(default=default, metadata={"rule": rule})


def _value_error(key: str, value: Any, rule: Any, source: str, why: str = "") -> ConfigValueError:
    shown = f"{value!r} ({type(value).__name__})"
    message = f"{source}: {key} = {shown} is not allowed; expected {rule.describe()}"
    if why:
        message += f" ({why})"
    return ConfigValueError(message, key=key, given=value, allowed=rule.describe())


class _Section:
    """Base of the application's section dataclasses: every value is checked (and normalised)
    here, once, whether the section is built in code or by the loader, which then names the
    file or override the bad value came from."""

    SECTION = ""

    def __post_init__(self) -> None:
        source = f"{type(self).__name__}(...)"
        for f in dataclasses.fields(self):
            rule = f.metadata["rule"]
            value = getattr(self, f.name)
            try:
                normalised = rule.coerce(value, lenient=False)
            except _Reject as reject:
                error = _value_error(f"{self.SECTION}.{f.name}", value, rule, source, reject.why)
                error.single_key = True     # the loader names this key's own origin
                raise error from None
            object.__setattr__(self, f.name, normalised)
        self._check_together(source)

    def _check_together(self, source: str) -> None:
        """Checks that span several keys of the section; overridden where there are some."""


# --------------------------------------------------------------------------------------------
# The sections.
# --------------------------------------------------------------------------------------------
