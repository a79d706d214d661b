"""One YAML file drives a run: a strict loader into frozen dataclasses.

Usage::

    cfg = load_config("configs/deepseek3_tiny.yaml", overrides=["fully_shard.comm_fusion=true"])
    cfg.gradpool.bucket_cap_bytes, cfg.model.vocab_size
    print(dump_yaml(cfg))            # loads back to an equal RunConfig

The ``gradpool`` section is the library's own :class:`gradpool.GradPoolConfig` (what
``fully_shard(pool_config=...)`` takes); the other sections belong to the application. The old
key ``gradpool.buckets_in_flight`` is read as ``gradpool.max_buckets_in_flight`` with a
``FutureWarning``.

Strict on purpose: a misspelt key that were silently ignored would run the default instead of
the experiment the file describes. So an unknown key raises :class:`UnknownConfigKeyError` with
its full dotted path, the file (or override) it came from and the closest known key; a bad value
raises :class:`ConfigValueError` naming the key, the value given and what is allowed.

The schema lives in :mod:`gradpool.app.config_rules` (value rules) and
:mod:`gradpool.app.config_sections` (the sections, re-exported here); the strict YAML reading in
:mod:`gradpool.app.config_yaml`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import yaml

from gradpool import GradPoolConfig, InvalidArgumentError
from gradpool.app.config_rules import EnvMapping, ListOf, _Reject, _value_error
# The sections are the schema; the launcher's default and rank limit are re-exported from here,
# where callers import a config from.
from gradpool.app.config_sections import (DEFAULT_CLUSTER_TIMEOUT_S,  # noqa: F401
                                          FullyShardConfig, LaunchConfig, ModelConfig,
                                          TrainConfig, _GRADPOOL_RULES, max_ranks)
from gradpool.app.config_yaml import _parse_yaml
from gradpool.app.errors import (ConfigError, ConfigValueError, OverrideSyntaxError,
                                 UnknownConfigKeyError)

# Old key name -> its name now, per section; read with a FutureWarning.
_RENAMED = {("gradpool", "buckets_in_flight"): "max_buckets_in_flight"}


_SECTIONS = {"fully_shard": FullyShardConfig, "gradpool": GradPoolConfig,
             "model": ModelConfig, "train": TrainConfig, "launch": LaunchConfig}


def _rules(section: str) -> dict:
    """``{key: rule}`` of a section, in the order its keys are listed."""
    if section == "gradpool":
        return _GRADPOOL_RULES
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(_SECTIONS[section])}


@dataclass(frozen=True)
class RunConfig:
    """A whole run: one attribute per YAML section."""

    fully_shard: FullyShardConfig = field(default_factory=FullyShardConfig)
    gradpool: GradPoolConfig = field(default_factory=GradPoolConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigValueError(
                    f"RunConfig.{name} must be a {cls.__name__}, got {value!r}; build it with "
                    f"{cls.__name__}(...) or load a file with load_config",
                    key=name, given=value, allowed=cls.__name__)
        mesh = self.fully_shard.mesh_shape
        if mesh is not None and math.prod(mesh) != self.launch.ranks:
            raise ConfigValueError(
                f"fully_shard.mesh_shape = {list(mesh)} covers {math.prod(mesh)} rank(s), but "
                f"launch.ranks = {self.launch.ranks}; give a mesh whose sizes multiply to "
                f"{self.launch.ranks} (or null: shard over every rank)",
                key="fully_shard.mesh_shape", given=mesh,
                allowed=f"sizes whose product is launch.ranks ({self.launch.ranks})")
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """EP groups are ``expert_parallel`` consecutive ranks; they must tile the job and lie
        inside one shard group of the data-parallel mesh (experts are sharded over the ranks
        holding the same experts, the expert-data-parallel ranks)."""
        ep, ranks = self.model.expert_parallel, self.launch.ranks
        if ep == 1:
            return
        if ranks % ep:
            raise ConfigValueError(
                f"model.expert_parallel = {ep} does not divide launch.ranks = {ranks}; the "
                "ranks form groups of expert_parallel consecutive ranks, so choose a divisor "
                "of launch.ranks", key="model.expert_parallel", given=ep,
                allowed=f"a divisor of launch.ranks ({ranks})")
        mesh = self.fully_shard.mesh_shape
        if mesh is not None and mesh[-1] % ep:
            raise ConfigValueError(
                f"model.expert_parallel = {ep} does not nest in fully_shard.mesh_shape = "
                f"{list(mesh)}: an expert-parallel group must lie inside one shard group "
                f"({mesh[-1]} ranks); choose expert_parallel dividing {mesh[-1]}",
                key="model.expert_parallel", given=ep,
                allowed=f"a divisor of the shard size ({mesh[-1]})")

    def to_dict(self) -> dict:
        """Plain nested dict of builtins; ``from_dict(cfg.to_dict()) == cfg``."""
        return {name: {key: _plain(_rules(name)[key], value)
                       for key, value in dataclasses.asdict(getattr(self, name)).items()}
                for name in _SECTIONS}


def _plain(rule: Any, value: Any) -> Any:
    """A stored value as YAML builtins (tuples back to lists, pair tuples back to a mapping)."""
    if isinstance(rule, EnvMapping):
        return {name: item for name, item in value}
    return list(value) if isinstance(value, tuple) else value


def known_keys() -> dict:
    """``{section: (key, ...)}`` of every key the loader accepts."""
    return {name: tuple(_rules(name)) for name in _SECTIONS}


# --------------------------------------------------------------------------------------------
# YAML reading.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Override:
    """One ``section.key=value`` override; ``text`` is kept to name it in errors."""

    section: str
    key: str
    value: Any
    text: str

    @property
    def path(self) -> str:
        return f"{self.section}.{self.key}"


def parse_override(text: str) -> Override:
    """Parse ``section.key=value``; the value is read as a YAML scalar (``true``, ``3``, ``null``).

    The key path is checked here, so a typo fails before anything is loaded.
    """
    source = f"override {text!r}"
    if not isinstance(text, str) or "=" not in text:
        raise OverrideSyntaxError(
            f"{source}: expected the form section.key=value, e.g. fully_shard.comm_fusion=true")
    path, _, raw_value = text.partition("=")
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise OverrideSyntaxError(
            f"{source}: key {path.strip()!r} must be section.key (two names joined by one dot), "
            f"with section one of {', '.join(_SECTIONS)}")
    section, key = (p.strip() for p in parts)
    key = _current_name(section, key, source)
    _check_known(section, key, source)
    if not raw_value.strip():
        # an unset shell variable (--set train.resume_from=$LAST) must not quietly mean null
        raise OverrideSyntaxError(
            f"{source}: the value of {section}.{key} is empty; give a value, or write "
            f"{section}.{key}=null to unset the key")
    value = _parse_yaml(raw_value.strip(), source)
    if isinstance(value, list) and isinstance(_rules(section)[key], ListOf):
        return Override(section, key, value, text)       # e.g. fully_shard.mesh_shape=[2,2]
    if isinstance(value, dict) and isinstance(_rules(section)[key], EnvMapping):
        return Override(section, key, value, text)       # e.g. launch.env={HCCL_DETERMINISTIC: 1}
    if isinstance(value, (dict, list)):
        raise OverrideSyntaxError(
            f"{source}: value {raw_value.strip()!r} is a {type(value).__name__}; overrides take "
            "one scalar (a bool, number, string or null)")
    return Override(section, key, value, text)


def _current_name(section: str, key: str, source: str) -> str:
    """``key``, or the name it was renamed to (with a FutureWarning naming both)."""
    new = _RENAMED.get((section, key))
    if new is None:
        return key
    warnings.warn(f"{source}: {section}.{key} is deprecated; call it {section}.{new}",
                  FutureWarning, stacklevel=3)
    return new


def _closest(word: str, options: Iterable[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return close[0] if close else None


def _check_known(section: str, key: Optional[str], source: str) -> None:
    """Raise UnknownConfigKeyError for an unknown section, or unknown key of a known section."""
    if section not in _SECTIONS:
        guess = _closest(section, _SECTIONS)
        hint = f"; did you mean {guess!r}?" if guess else "."
        raise UnknownConfigKeyError(
            f"{source}: unknown section {section!r}{hint} Known sections: {', '.join(_SECTIONS)}")
    keys = known_keys()[section]
    if key is not None and key not in keys:
        guess = _closest(key, keys)
        hint = f"; did you mean '{section}.{guess}'?" if guess else "."
        raise UnknownConfigKeyError(
            f"{source}: unknown key '{section}.{key}'{hint} "
            f"Known keys in {section!r}: {', '.join(keys)}")


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------
def from_dict(data: Optional[Mapping], overrides: Iterable[str | Override] = (),
              source: str = "config dict") -> RunConfig:
    """Build a :class:`RunConfig` from a ``{section: {key: value}}`` mapping plus overrides.

    Missing sections and keys take their defaults; ``source`` names where ``data`` came from in
    error messages.
    """
    if data is None:  # an empty YAML file
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    parsed = [o if isinstance(o, Override) else parse_override(o) for o in overrides]

    # (section, key) -> (value, where it came from, lenient); later overrides win.
    values: dict = {}
    for section, body in data.items():
        _check_known(str(section), None, source)
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys, "
                              f"got {body!r} ({type(body).__name__})")
        for key, value in body.items():
            key = _current_name(section, str(key), source)
            _check_known(section, key, source)
            if (section, key) in values:
                raise ConfigError(f"{source}: {section}.{key} is given twice (once under its old "
                                  f"name); keep only {section}.{key}")
            values[(section, key)] = (value, source, False)
    for o in parsed:
        values[(o.section, o.key)] = (o.value, f"override {o.text!r}", True)

    sections = {name: _build_section(name, {key: values[(name, key)] for key in _rules(name)
                                            if (name, key) in values}, source, parsed)
                for name in _SECTIONS}
    try:
        return RunConfig(**sections)
    except ConfigValueError as exc:      # a check across sections: name where the config came from
        origin = source + (" with overrides " + ", ".join(repr(o.text) for o in parsed)
                           if parsed else "")
        raise ConfigValueError(f"{origin}: {exc}", key=exc.key, given=exc.given,
                               allowed=exc.allowed) from None


def _read(section: str, key: str, given: tuple) -> Any:
    """One value through its key's rule; ``given`` is ``(value, where, lenient)``."""
    value, where, lenient = given
    rule = _rules(section)[key]
    try:
        return rule.coerce(value, lenient)
    except _Reject as reject:
        raise _value_error(f"{section}.{key}", value, rule, where, reject.why) from None


def _build_section(name: str, given: dict, source: str, overrides: list):
    """A section from ``{key: (value, where, lenient)}``; errors name the key and its origin."""
    cls = _SECTIONS[name]
    origin = source
    if overrides:
        origin += " with overrides " + ", ".join(repr(o.text) for o in overrides)
    if cls is GradPoolConfig:
        # The library's config knows no YAML: read each key by its rule here, then let the
        # library check what it checks at its own boundary.
        kwargs = {key: _read(name, key, value) for key, value in given.items()}
        try:
            return GradPoolConfig(**kwargs)
        except InvalidArgumentError as exc:
            # the library names its fields GradPoolConfig.<key>; here they are gradpool.<key>
            message = str(exc).replace("GradPoolConfig.", f"{name}.")
            raise ConfigError(f"{origin}: {message}") from None
    # Shell words (true/yes/on ...) are read here; every other check is the section's own.
    kwargs = {key: _read(name, key, value) if value[2] else value[0]
              for key, value in given.items()}
    try:
        return cls(**kwargs)
    except ConfigValueError as exc:
        key = exc.key.split(".", 1)[1] if exc.key else None
        where = given[key][1] if getattr(exc, "single_key", False) and key in given else origin
        message = str(exc).replace(f"{cls.__name__}(...)", where, 1)
        raise ConfigValueError(message, key=exc.key, given=exc.given,
                               allowed=exc.allowed) from None


def load_config(path: str | os.PathLike, overrides: Iterable[str | Override] = ()) -> RunConfig:
    """Read a run's YAML file and apply ``section.key=value`` overrides (later ones win)."""
    source = f"config file {os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: is not UTF-8 text (byte {exc.start}: {exc.reason}); save "
                          "it as UTF-8") from None
    data = _parse_yaml(text, source)
    if data is None:
        raise ConfigError(f"{source}: is empty; write at least one section, e.g. "
                          "'fully_shard:\n  comm_fusion: false' (every key left out takes its "
                          "default; `gradpool check-config` prints them all)")
    return from_dict(data, overrides, source)


def dump_yaml(cfg: RunConfig) -> str:
    """The config as YAML text that :func:`load_config` reads back to an equal config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
