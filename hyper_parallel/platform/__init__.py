"""Platform implementations (MindSpore only here) and ``get_platform()``, upstream's handle on the
platform's collectives.

mindformers calls ``get_platform()`` at import time and uses, from what it returns:
``create_group(ranks)`` (real: the mesh's communication group of those ranks),
``differentiable_all_reduce`` (its MoE router's token counts over tensor- and context-parallel
groups) and ``differentiable_sync_hook`` / ``differentiable_all_to_all_single_async`` /
``AsyncCollectiveTensor`` (its expert-parallel overlap with pipeline stages): those raise
:class:`gradpool.FeatureNotProvidedError` when used.
"""
from __future__ import annotations

from typing import Sequence

from gradpool import InvalidArgumentError, check_int
from hyper_parallel.core.not_provided import (EP_OVERLAP, PARALLEL_COLLECTIVES, refused_class,
                                              refused_function)

__all__ = ["get_platform", "MindSporePlatform"]


class MindSporePlatform:
    """The MindSpore platform, as far as FSDP/HSDP/EP use it."""

    name = "mindspore"

    differentiable_all_reduce = staticmethod(refused_function(
        "differentiable_all_reduce", PARALLEL_COLLECTIVES, __name__))
    differentiable_sync_hook = staticmethod(refused_function(
        "differentiable_sync_hook", EP_OVERLAP, __name__))
    differentiable_all_to_all_single_async = staticmethod(refused_function(
        "differentiable_all_to_all_single_async", EP_OVERLAP, __name__))
    AsyncCollectiveTensor = refused_class("AsyncCollectiveTensor", EP_OVERLAP, __name__)

    @staticmethod
    def create_group(rank_list: Sequence[int]) -> str:
        """The name of the communication group of the world ranks ``rank_list`` (created once,
        by its members, as a mesh creates its groups)."""
        from hyper_parallel.core.device_mesh import _group_for

        ranks = tuple(rank_list)
        for rank in ranks:
            check_int("create_group rank", rank, 0)
        if len(ranks) < 2 or len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(
                f"create_group needs two or more distinct ranks, got {list(rank_list)}; a single "
                "rank needs no communication group")
        return _group_for(ranks)


_PLATFORM = MindSporePlatform()


def get_platform() -> MindSporePlatform:
    return _PLATFORM
