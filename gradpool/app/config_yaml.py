"""Reading a config file's YAML strictly: a duplicate key is an error, and ``1e-3`` is a number."""
from __future__ import annotations

import re
from typing import Any, Hashable

import yaml

from gradpool.app.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with two fixes that matter for a config file.

    * PyYAML follows YAML 1.1, where ``1e-3`` (no dot) is a *string*; a learning rate written
      that way would be rejected as "not a number". Floats with an exponent are floats here.
    * A duplicated key silently keeps the last value in PyYAML; here it is an error.
    """


# Copy before adding: the resolver table is a class attribute shared with SafeLoader.
_StrictLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            break  # construct_mapping below reports the unhashable key
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _construct_unique_mapping)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None


# --------------------------------------------------------------------------------------------
# Overrides.
# --------------------------------------------------------------------------------------------
