"""``gradpool plan``: the per-rank memory and communication of a run, before renting the cards.

Usage::

    plan = plan_memory(load_config("configs/deepseek3_671b_910b.yaml"))
    print(format_plan(plan))                 # the table
    json.dumps(plan.to_dict())               # the same numbers, in bytes

Nothing here builds the model or touches a device: parameter shapes come from
:func:`gradpool.app.model.parameter_specs` (``ModelConfig`` alone), bucket geometry from
:class:`gradpool.layout.ReduceScatterLayout` (the layouts the reducer builds), and the pool's
buckets from a *replay*: the acquire/release sequence ``gradpool train`` makes in two training
steps (zero_grad, the forward's fused all-gathers, each unit's reduce in backward order, the
root's drain), run against a bookkeeping-only model of :class:`gradpool.pool.BucketPool`'s policy
(smallest free bucket that fits, else a new one rounded up to the alignment; a released bucket
is reusable once its fence has completed; at ``max_buckets_in_flight`` fenced buckets of a dtype
``acquire`` first waits for the oldest). Why a replay and not a formula: buckets change roles
between steps (an output bucket of step 1 serves an input in step 2) and the pool grows by
running maxima, so only the sequence gives the high-water. The synchronous reduce gives a unit's
output buckets back in its own backward (added into ``main_grad``, or copied into gradients
autograd owns: pool memory never leaves the pool); the replay holds the asynchronous reduce's
outputs until the end of the step, and HSDP's all-reduced partial sums until the next
``zero_grad``, where the real pool may give them back earlier, so for those the replay is an
upper bound (tests/test_plan.py finds the tiny model within its 3 % tolerance).
``tests/test_plan.py`` checks it against the real pool's measured high-water on the tiny model,
so a change to the pool's policy that this model does not follow fails a test. With expert
parallelism no built model has been measured against the replay yet; its expert buckets are
checked against a hand count (``tests/test_plan_ep.py``).

Side by side, for the same step (same buckets, same padding):

* **upstream** per-step allocation (PyTorch FSDP2 / upstream hyper_parallel): every input and
  output is allocated fresh each step, an input freed when its collective completes, an output
  once the unit's shards reached ``main_grad``; no bound on what is in flight, so a unit's
  inputs and outputs are alive together. Its transient peak is the largest unit's sum; a caching
  allocator holds at least that (fragmentation not counted).
* **Megatron-style** persistent gradient buffer: every parameter's full gradient at once, in the
  ``main_grad`` dtype, each parameter starting on a 64-element boundary, each bucket (here: a
  ``fully_shard`` unit) ending on a multiple of lcm(shard group, 128); reduce-scattered in place,
  so nothing is copied, and ``main_grad`` is a view of it.

The copy time is an estimate, not a measurement: bytes the pool reads and writes per step
divided by ``hbm_gbps * copy_efficiency``. Its default is the 910B's commonly published HBM2e
bandwidth, 1.6 TB/s (four HBM2e stacks at 3.2 Gb/s per pin give ~1.64 TB/s), at 0.7 of peak, an
assumed fraction for a streaming copy kernel; both can be set. No 910B run has measured it.

Beside memory, the plan tells time and activations: per rank and step the bytes all-gathered,
reduce-scattered, all-reduced and dispatched, over which link, and a time at published bandwidths
(:mod:`~gradpool.app.plan.comm`); the activations of one micro-step with and without full
recompute (:mod:`~gradpool.app.plan.activations`), so that "fits" counts them; and expert
parallelism (``model.expert_parallel``) laid out as the model does it
(:mod:`~gradpool.app.plan.geometry`).

The package, by concern: ``options`` (figures and options), ``geometry`` (units, meshes, reduce
layouts), ``replay`` (the pool and step replay), ``comm``, ``activations``, ``memory`` (the
figures and :func:`plan_memory`), ``report`` (the table).
"""
from __future__ import annotations

from gradpool.app.plan.activations import ActivationPlan, plan_activations
from gradpool.app.plan.comm import INTER, INTRA, CommPlan, CommRow, link
from gradpool.app.plan.geometry import local_expert_specs
from gradpool.app.plan.memory import (ContextPlan, CopyPlan, ExpertPlan, FitPlan, MegatronPlan,
                                      MemoryPlan, ParamPlan, PlanConfig, PlanMesh, PoolPlan,
                                      UpstreamPlan, plan_memory)
from gradpool.app.plan.options import (COPY_EFFICIENCY, DEVICE_MEMORY_GIB, DISPATCHERS, GIB,
                                       HBM_910B_GBPS, INTER_NODE_GBPS, INTRA_NODE_GBPS, ITEMSIZE,
                                       MIB, PlanOptions)
from gradpool.app.plan.report import format_plan, human

__all__ = ["ActivationPlan", "COPY_EFFICIENCY", "CommPlan", "CommRow", "ContextPlan",
           "CopyPlan", "DEVICE_MEMORY_GIB", "DISPATCHERS", "ExpertPlan", "FitPlan", "GIB",
           "HBM_910B_GBPS", "INTER", "INTER_NODE_GBPS", "INTRA", "INTRA_NODE_GBPS", "ITEMSIZE",
           "MIB", "MegatronPlan", "MemoryPlan", "ParamPlan", "PlanConfig", "PlanMesh",
           "PlanOptions", "PoolPlan", "UpstreamPlan", "format_plan", "human", "link",
           "local_expert_specs", "plan_activations", "plan_memory"]
