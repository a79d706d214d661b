"""The sections of a run's config: what each key holds and the checks across keys. The
``gradpool`` section is the library's own :class:`gradpool.GradPoolConfig`; the launch section
knows the msrun topology (nodes, ranks, the environment the launcher owns)."""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Optional

from gradpool import DTYPE_NAMES, SUPPORTED_DEVICES, GradPoolConfig
from gradpool.app.config_rules import (Bool, BoolOr, Choice, EnvMapping, Int, ListOf,
                                       PositiveNumber, Text, _key, _Section)
from gradpool.app.dispatchers import AUTO, DISPATCHERS
from gradpool.app.errors import ConfigValueError
from gradpool.device import blocks_launches_by_default


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
    "check_unit_order": BoolOr(("strict",)),
    "main_grad_in_place": Bool(),
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
    # E: each MoE layer's routed experts split over E expert-parallel ranks (1: every rank
    # holds every expert). EP groups are E consecutive ranks.
    expert_parallel: int = _key(1, Int(minimum=1))
    # the token dispatcher of expert_parallel > 1 (gradpool.app.dispatchers)
    moe_dispatcher: str = _key(AUTO, Choice((AUTO,) + DISPATCHERS))

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
        if self.num_experts % self.expert_parallel:
            raise ConfigValueError(
                f"{source}: model.expert_parallel = {self.expert_parallel} does not divide "
                f"model.num_experts = {self.num_experts}; each expert-parallel rank holds "
                "num_experts / expert_parallel experts, so choose a divisor of num_experts",
                key="model.expert_parallel", given=self.expert_parallel,
                allowed=f"a divisor of model.num_experts ({self.num_experts})")


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
    # a step-<N> directory, or "latest": the newest committed, intact one under save_dir
    resume_from: Optional[str] = _key(None, Text(nullable=True))
    keep_last: Optional[int] = _key(None, Int(minimum=1, nullable=True))   # null: keep all
    # write each checkpoint in the background (committed within a step of its last write)
    async_save: bool = _key(False, Bool())
    # a stop signal to the launcher lets a save in progress commit for up to this long
    stop_save_grace_s: int = _key(60, Int(minimum=0))
    # false: resume_from's checksums are not checked (said on stderr and in the ranks' logs)
    verify_checkpoint: bool = _key(True, Bool())

    def _check_together(self, source: str) -> None:
        for key, value in (("keep_last", self.keep_last),
                           ("resume_from", "latest" if self.resume_from == "latest" else None)):
            if value is not None and self.save_dir is None:
                raise ConfigValueError(
                    f"{source}: train.{key} = {value!r} needs train.save_dir, which is null; set "
                    f"train.save_dir to where the checkpoints are (or train.{key} to null)",
                    key=f"train.{key}", given=value, allowed="null unless train.save_dir is set")
        if self.save_every is not None and self.save_dir is None:
            # without a directory the run would train for hours and keep nothing
            raise ConfigValueError(
                f"{source}: train.save_every = {self.save_every} needs train.save_dir, which is "
                "null; set train.save_dir to where the checkpoints go (or train.save_every to "
                "null)", key="train.save_every", given=self.save_every,
                allowed="null unless train.save_dir is set")


# Set by the launcher itself on every rank (msrun's dynamic-cluster variables, the rank report,
# the card list, PATH with this interpreter first, so msrun's "python" is it): a value in
# launch.env would fight it, so it is refused there.
LAUNCHER_ENV = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID",
                "MS_TOPO_TIMEOUT", "RANK_ID", "RANK_SIZE", "DEVICE_ID",
                "GRADPOOL_RANK_REPORT_DIR", "GRADPOOL_LAUNCHER", "PATH")
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
