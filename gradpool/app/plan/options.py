"""What a plan assumes: the card's figures and the options ``gradpool plan`` takes.

Every default bandwidth here is a published figure, not a measurement (no Ascend card is at
hand); docs/plan.md names the sources. The communication estimates of the plan are the standard
ring costs at these bandwidths, so they are only as good as the figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gradpool.app.dispatchers import DISPATCHERS, resolve_dispatcher
from gradpool.errors import InvalidArgumentError, check_positive_number

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
HBM_910B_GBPS = 1600.0          # GB/s, the figure commonly published for the 910B's HBM2e
COPY_EFFICIENCY = 0.7           # assumed fraction of peak a copy kernel reaches (not measured)
DEVICE_MEMORY_GIB = {"Ascend": 64.0}     # the 910B's HBM; CPU: none assumed
# Atlas 800T A2 (8 x 910B per server) as Huawei publishes it: HCCS 392 GB/s per card between the
# cards of a server, and one 200 Gb/s RoCE port per card between servers (200 / 8 = 25 GB/s).
INTRA_NODE_GBPS = {"Ascend": 392.0}
INTER_NODE_GBPS = {"Ascend": 25.0}
MEGATRON_PARAM_ALIGN = 64       # elements (Megatron-Core's param_and_grad_buffer)
MEGATRON_BUCKET_ALIGN = 128
HCCL_DEFAULT_BUFFSIZE_MIB = 200  # CANN's HCCL_BUFFSIZE default, per communicator and direction
MIB, GIB = 2 ** 20, 2 ** 30


@dataclass(frozen=True)
class PlanOptions:
    """``hbm_gbps`` (GB/s) and ``copy_efficiency`` set the copy-time estimate;
    ``device_memory_gib`` the card the totals are compared with (None: 64 on Ascend, none on
    CPU); ``intra_node_gbps`` and ``inter_node_gbps`` (GB/s per card) the communication
    estimate (None: the Atlas 800T A2 figures on Ascend, no estimate on CPU);
    ``dispatcher`` the token dispatcher of expert parallelism (None: the run's, by
    ``model.moe_dispatcher``; its ``auto`` is all-to-all on Ascend, all-gather elsewhere)."""

    hbm_gbps: float = HBM_910B_GBPS
    copy_efficiency: float = COPY_EFFICIENCY
    device_memory_gib: Optional[float] = None
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    dispatcher: Optional[str] = None

    def __post_init__(self) -> None:
        check_positive_number("hbm_gbps", self.hbm_gbps)
        check_positive_number("copy_efficiency", self.copy_efficiency)
        if self.copy_efficiency > 1:
            raise InvalidArgumentError(
                f"copy_efficiency is a fraction of peak bandwidth, at most 1; got "
                f"{self.copy_efficiency!r}")
        check_positive_number("device_memory_gib", self.device_memory_gib, nullable=True)
        check_positive_number("intra_node_gbps", self.intra_node_gbps, nullable=True)
        check_positive_number("inter_node_gbps", self.inter_node_gbps, nullable=True)
        if self.dispatcher is not None and self.dispatcher not in DISPATCHERS:
            raise InvalidArgumentError(
                f"dispatcher must be one of {', '.join(DISPATCHERS)}; got {self.dispatcher!r}")

    def bandwidths(self, device: str) -> tuple:
        """(intra-node, inter-node) GB/s for ``device``; None where neither a flag nor a
        published default gives one."""
        return (self.intra_node_gbps if self.intra_node_gbps is not None
                else INTRA_NODE_GBPS.get(device),
                self.inter_node_gbps if self.inter_node_gbps is not None
                else INTER_NODE_GBPS.get(device))

    def dispatcher_for(self, choice: str, device: str) -> str:
        """The dispatcher to cost: ``--dispatcher`` if given, else the one a run with
        ``model.moe_dispatcher = choice`` uses on ``device``."""
        return self.dispatcher or resolve_dispatcher(choice, device)
