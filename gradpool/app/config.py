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

Types follow YAML, not Python's truthiness: in a file ``comm_fusion: "true"`` is a string and an
error. Overrides come from a shell, where quoting is easy to get wrong, so there (and only there)
the strings ``true``/``false``/``yes``/``no``/``on``/``off`` are accepted for bool keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Optional, Tuple

import yaml

from gradpool import DTYPE_NAMES, SUPPORTED_DEVICES, GradPoolConfig, InvalidArgumentError
from gradpool.app.errors import (ConfigError, ConfigValueError, OverrideSyntaxError,
                                 UnknownConfigKeyError)
from gradpool.device import blocks_launches_by_default

# Old key name -> its name now, per section; read with a FutureWarning.
_RENAMED = {("gradpool", "buckets_in_flight"): "max_buckets_in_flight"}


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
        return "a string or a number"

    def coerce(self, value: Any, lenient: bool) -> str:
        if isinstance(value, str):
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
@dataclass(frozen=True)
class FullyShardConfig(_Section):
    SECTION = "fully_shard"
    comm_fusion: bool = _key(False, Bool())       # many gradients per fused bucket
    reshard_after_forward: bool = _key(True, Bool())
    param_dtype: Optional[str] = _key(None, Choice(DTYPE_NAMES, nullable=True))  # null: own
    reduce_dtype: Optional[str] = _key("float32", Choice(DTYPE_NAMES, nullable=True))
    apply_grad_on_fp32_main_grad: bool = _key(True, Bool())
    reduce_op: str = _key("avg", Choice(("avg", "sum")))
    # null: shard over every rank; [R, S]: HSDP, R replicas of S-way shards (R * S = ranks)
    mesh_shape: Optional[tuple] = _key(None, ListOf(Int(minimum=1), nullable=True))
    mesh_dim_names: Optional[tuple] = _key(None, ListOf(Text(), nullable=True, unique=True))
    gradient_scaling_factor: float = _key(1.0, PositiveNumber())   # reduced grads times this
    # false (HSDP): skip the replicate all-reduce on all but the last micro-step
    all_reduce_every_micro_step: bool = _key(True, Bool())

    def _check_together(self, source: str) -> None:
        if self.mesh_shape is not None and len(self.mesh_shape) > 2:
            raise ConfigValueError(
                f"{source}: fully_shard.mesh_shape = {list(self.mesh_shape)} has "
                f"{len(self.mesh_shape)} dims; fully_shard takes [shard] or [replicate, shard]",
                key="fully_shard.mesh_shape", given=self.mesh_shape, allowed="1 or 2 sizes")
        if self.mesh_dim_names is not None and (
                self.mesh_shape is None or len(self.mesh_dim_names) != len(self.mesh_shape)):
            raise ConfigValueError(
                f"{source}: fully_shard.mesh_dim_names = {list(self.mesh_dim_names)} needs one "
                f"name per dim of fully_shard.mesh_shape = "
                f"{list(self.mesh_shape) if self.mesh_shape else None}",
                key="fully_shard.mesh_dim_names", given=self.mesh_dim_names,
                allowed="one name per mesh dim")


# The library's GradPoolConfig, as YAML keys, and the rules their values are read by.
_GRADPOOL_RULES = {
    "bucket_cap_mib": PositiveNumber(),
    "max_buckets_in_flight": Int(minimum=1, nullable=True),
    "alignment_bytes": Int(minimum=4, multiple_of=4),
    "zero_copy": Bool(),
    "poison_on_release": Bool(),
    "max_cached_mib": PositiveNumber(nullable=True),
    "verify_gradients": Bool(),
    "async_reduce": Bool(),
}


@dataclass(frozen=True)
class ModelConfig(_Section):
    SECTION = "model"
    vocab_size: int = _key(67, Int(minimum=2))        # odd on purpose: uneven shards
    hidden_size: int = _key(32, Int(minimum=1))
    num_layers: int = _key(2, Int(minimum=1))
    num_heads: int = _key(4, Int(minimum=1))          # must divide hidden_size
    num_experts: int = _key(4, Int(minimum=1))        # routed experts per MoE layer
    experts_per_token: int = _key(2, Int(minimum=1))  # top-k
    expert_hidden: int = _key(24, Int(minimum=1))     # inner width of each expert's MLP
    seq_len: int = _key(8, Int(minimum=1))
    batch_size: int = _key(4, Int(minimum=1))         # sequences per rank per micro-step

    def _check_together(self, source: str) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigValueError(
                f"{source}: model.hidden_size = {self.hidden_size} is not divisible by "
                f"model.num_heads = {self.num_heads}; choose sizes with hidden_size % "
                "num_heads == 0", key="model.hidden_size", given=self.hidden_size,
                allowed=f"a multiple of num_heads ({self.num_heads})")
        if self.experts_per_token > self.num_experts:
            raise ConfigValueError(
                f"{source}: model.experts_per_token = {self.experts_per_token} exceeds "
                f"model.num_experts = {self.num_experts}; top-k needs k <= num_experts",
                key="model.experts_per_token", given=self.experts_per_token,
                allowed=f"an integer in [1, {self.num_experts}]")


@dataclass(frozen=True)
class TrainConfig(_Section):
    SECTION = "train"
    steps: int = _key(5, Int(minimum=1))              # optimizer steps
    micro_steps: int = _key(1, Int(minimum=1))        # gradient-accumulation micro-steps
    learning_rate: float = _key(1e-3, PositiveNumber())
    seed: int = _key(1234, Int(minimum=0))            # parameter init and token batches
    optimizer: str = _key("adam", Choice(("adam", "sgd")))
    # Checkpoints go to <save_dir>/step-<8 digits> (gradpool.app.checkpoints); null: none.
    save_dir: Optional[str] = _key(None, Text(nullable=True))
    save_every: Optional[int] = _key(None, Int(minimum=1, nullable=True))  # null: at the end
    resume_from: Optional[str] = _key(None, Text(nullable=True))   # a step-<N> directory

    def _check_together(self, source: str) -> None:
        if self.save_every is not None and self.save_dir is None:
            # without a directory the run would train for hours and keep nothing
            raise ConfigValueError(
                f"{source}: train.save_every = {self.save_every} needs train.save_dir, which is "
                "null; set train.save_dir to where the checkpoints go (or train.save_every to "
                "null)", key="train.save_every", given=self.save_every,
                allowed="null unless train.save_dir is set")


# Set by the launcher itself on every rank (msrun's dynamic-cluster variables, the rank report,
# the card list): a value in launch.env would fight it, so it is refused there.
LAUNCHER_ENV = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID",
                "MS_TOPO_TIMEOUT", "RANK_ID", "RANK_SIZE", "DEVICE_ID",
                "GRADPOOL_RANK_REPORT_DIR")
# launch.<key> -> the CANN environment variable it sets (HCCL, Ascend only). Names and ranges
# from the CANN 9.x environment-variable reference (HCCL_CONNECT_TIMEOUT is [120, 7200] s,
# HCCL_EXEC_TIMEOUT [0, 2147483647] s on Atlas A2 with 0 = never, HCCL_BUFFSIZE >= 1 MB per
# communicator and direction).
HCCL_ENV = {"hccl_if_ip": "HCCL_IF_IP", "hccl_socket_ifname": "HCCL_SOCKET_IFNAME",
            "hccl_connect_timeout_s": "HCCL_CONNECT_TIMEOUT",
            "hccl_exec_timeout_s": "HCCL_EXEC_TIMEOUT", "hccl_buffsize_mib": "HCCL_BUFFSIZE"}
ASCEND_VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"
DEFAULT_CLUSTER_TIMEOUT_S = 600         # msrun's own default for --cluster_time_out


@dataclass(frozen=True)
class LaunchConfig(_Section):
    """Where and how the ranks run. One node: ``ranks`` processes on this host. ``nodes > 1``:
    every node runs ``gradpool train`` with its own ``node_rank``; each starts
    ``ranks_per_node`` ranks (global ranks ``node_rank * ranks_per_node + i``) through msrun."""

    SECTION = "launch"
    ranks: int = _key(2, Int(minimum=1))              # processes, one device each (msrun worker_num)
    device: str = _key("CPU", Choice(SUPPORTED_DEVICES))
    master_port: Optional[int] = _key(None, Int(minimum=1, maximum=65535, nullable=True))
    log_dir: Optional[str] = _key(None, Text(nullable=True))   # null: a temporary one
    nodes: int = _key(1, Int(minimum=1))
    node_rank: int = _key(0, Int(minimum=0))          # this node (0 runs msrun's scheduler)
    ranks_per_node: Optional[int] = _key(None, Int(minimum=1, nullable=True))   # null: ranks/nodes
    master_addr: str = _key("127.0.0.1", Text())      # node 0's address (IP or host name)
    cluster_timeout_s: int = _key(DEFAULT_CLUSTER_TIMEOUT_S, Int(minimum=1))
    env: tuple = _key((), EnvMapping())               # added to every rank's environment
    devices: Optional[tuple] = _key(None, ListOf(Int(minimum=0), nullable=True, unique=True))
    hccl_if_ip: Optional[str] = _key(None, Text(nullable=True))
    hccl_socket_ifname: Optional[str] = _key(None, Text(nullable=True))
    hccl_connect_timeout_s: Optional[int] = _key(None, Int(minimum=120, maximum=7200,
                                                           nullable=True))
    hccl_exec_timeout_s: Optional[int] = _key(None, Int(minimum=0, maximum=2 ** 31 - 1,
                                                        nullable=True))
    hccl_buffsize_mib: Optional[int] = _key(None, Int(minimum=1, nullable=True))
    launch_blocking: Optional[bool] = _key(None, Bool(nullable=True))   # null: true on CPU only

    @property
    def blocks_launches(self) -> bool:
        """Whether the ranks run every op synchronously: ``launch_blocking``, or when null, true on
        CPU (ranks sharing a host's cores) and false on Ascend (async launch keeps the device
        streams fed and collectives overlapped)."""
        if self.launch_blocking is None:
            return blocks_launches_by_default(self.device)
        return self.launch_blocking

    @property
    def local_ranks(self) -> int:
        """Ranks this node starts (msrun's ``local_worker_num``)."""
        return self.ranks_per_node if self.ranks_per_node is not None else self.ranks // self.nodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_ranks

    def node_of(self, rank: int) -> int:
        return rank // self.local_ranks

    def rank_env(self) -> dict:
        """What every rank of this node gets in its environment from this section."""
        env = dict(self.env)
        if self.devices is not None:
            env[ASCEND_VISIBLE_DEVICES] = ",".join(map(str, self.devices))
        for key, name in HCCL_ENV.items():
            value = getattr(self, key)
            if value is not None:
                env[name] = str(value)
        return env

    def _refuse(self, source: str, key: str, message: str, allowed: str) -> None:
        value = getattr(self, key)
        shown = list(value) if isinstance(value, tuple) else value     # as the file wrote it
        raise ConfigValueError(f"{source}: launch.{key} = {shown!r} {message}",
                               key=f"launch.{key}", given=value, allowed=allowed)

    def _check_together(self, source: str) -> None:
        bound = max_ranks(self.device)
        if self.nodes == 1 and self.ranks > bound:
            raise ConfigValueError(
                f"{source}: launch.ranks = {self.ranks} is more than one machine runs on "
                f"{self.device} ({bound}); lower it", key="launch.ranks", given=self.ranks,
                allowed=f"an integer in [1, {bound}]")
        if self.node_rank >= self.nodes:
            self._refuse(source, "node_rank", f"is out of range for launch.nodes = {self.nodes}; "
                         f"nodes are numbered 0 to {self.nodes - 1}",
                         f"an integer in [0, {self.nodes - 1}]")
        if self.ranks_per_node is None and self.ranks % self.nodes:
            self._refuse(source, "nodes", f"does not divide launch.ranks = {self.ranks}: msrun "
                         "starts the same number of ranks on every node",
                         f"a divisor of {self.ranks}")
        if self.ranks_per_node is not None and self.ranks_per_node * self.nodes != self.ranks:
            self._refuse(source, "ranks_per_node", f"times launch.nodes = {self.nodes} is not "
                         f"launch.ranks = {self.ranks}; every node runs ranks / nodes ranks "
                         "(or set it to null)",
                         f"{self.ranks // self.nodes if self.ranks % self.nodes == 0 else 'null'}")
        if self.local_ranks > bound:
            self._refuse(source, "ranks_per_node" if self.ranks_per_node is not None else "ranks",
                         f"gives {self.local_ranks} ranks per node, more than one machine runs "
                         f"on {self.device} ({bound}); add nodes",
                         f"at most {bound} ranks per node")
        if self.nodes > 1 and self.master_port is None:
            self._refuse(source, "master_port", f"(pick a free one) cannot work with launch.nodes "
                         f"= {self.nodes}: every node must name the same port of node 0",
                         "an integer in [1024, 65535]")
        if not _is_host(self.master_addr):
            self._refuse(source, "master_addr", "is neither an IP address nor a host name",
                         "an IP address or a host name")
        self._check_ascend_keys(source)
        for name, _ in self.env:
            taken = {v: k for k, v in HCCL_ENV.items()}
            if name in LAUNCHER_ENV or name == ASCEND_VISIBLE_DEVICES or name in taken:
                own = (f"launch.{taken[name]}" if name in taken else
                       "launch.devices" if name == ASCEND_VISIBLE_DEVICES else None)
                hint = f"set {own} instead" if own else "the launcher sets it for every rank"
                raise ConfigValueError(
                    f"{source}: launch.env sets {name}, which it may not: {hint}",
                    key="launch.env", given=name, allowed="any other variable")

    def _check_ascend_keys(self, source: str) -> None:
        ascend_only = ["devices", *HCCL_ENV]
        if self.device != "Ascend":
            for key in ascend_only:
                if getattr(self, key) is not None:
                    self._refuse(source, key, f"only applies to launch.device = Ascend (this run "
                                 f"is on {self.device}); set it to null", "null on CPU")
            return
        if self.devices is not None and len(self.devices) != self.local_ranks:
            self._refuse(source, "devices", f"names {len(self.devices)} card(s), but this node "
                         f"runs {self.local_ranks} rank(s) (launch.ranks / launch.nodes); give "
                         "one card id per rank", f"a list of {self.local_ranks} card ids")
        if self.hccl_if_ip is not None:
            try:
                ipaddress.ip_address(self.hccl_if_ip)
            except ValueError:
                self._refuse(source, "hccl_if_ip", "is not an IPv4 or IPv6 address (HCCL_IF_IP "
                             "takes one host NIC address)", "an IP address")


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _is_host(text: str) -> bool:
    """An IP address, or a syntactically valid DNS host name (RFC 1123); whether the name
    resolves is checked when a node launches (``gradpool.app.launch.check_launch``)."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= 253 and all(_HOST_LABEL.match(part) for part in name.split("."))


# One host's sensible number of ranks: a few per core on CPU (correctness runs oversubscribe),
# the cards of one server on Ascend (16 for the largest 910B servers).
RANKS_PER_CPU_CORE = 4
ASCEND_CARDS_PER_NODE = 16


def max_ranks(device: str) -> int:
    if device == "Ascend":
        return ASCEND_CARDS_PER_NODE
    return RANKS_PER_CPU_CORE * (os.cpu_count() or 1)


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
    value = _parse_yaml(raw_value.strip(), source) if raw_value.strip() else None
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
    return RunConfig(**sections)


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
