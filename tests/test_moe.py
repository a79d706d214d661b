"""Expert parallelism, the single-process parts: the local experts' sparse compute against the
E=1 model's dense MoE, their matmul FLOPs counted from the shapes MindSpore was given, the
all-to-all dispatcher's bookkeeping (an exchange between E simulated ranks, in NumPy, against a
dense NumPy MoE), which dispatcher a run uses and its plan costs, and the refusals. The
collectives and both dispatchers run on real msrun ranks in tests/test_moe_distributed.py."""
import dataclasses

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, mint, nn

from gradpool import GradPoolConfig
from gradpool.app.config import ModelConfig
from gradpool.app.dispatchers import resolve_dispatcher
from gradpool.app.model import TinyDeepSeekV3
from gradpool.app.moe import (AllGatherDispatcher, ExpertParallel, LocalExperts, dispatcher_for,
                              local_experts, routed_rows)
from gradpool.app.moe_dispatch import AllToAllDispatcher, plan_receive, plan_send
from gradpool.comm import SingleProcessCommunicator
from gradpool.errors import InvalidArgumentError
from hyper_parallel import fully_shard
from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy

ms.set_device("CPU")
CFG = ModelConfig(expert_hidden=23)         # 4 experts, top-2, hidden 32


@pytest.fixture(scope="module")
def moe():
    return TinyDeepSeekV3(CFG, seed=7).layers[0].moe


def _tokens(rows: int, seed: int = 0) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal((rows, CFG.hidden_size))
                  .astype(np.float32))


class MatmulCounter:
    """Counts the multiply-adds of every ``mint.matmul`` from its operands' shapes, leaving out
    the router's ([.., H] x [H, num_experts]): what remains is expert work."""

    def __init__(self, monkeypatch):
        self.flops = 0
        original = mint.matmul

        def counting(a, b):
            if tuple(b.shape) != (CFG.hidden_size, CFG.num_experts):
                batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
                out = int(np.prod(batch)) * a.shape[-2] * b.shape[-1]
                self.flops += 2 * out * a.shape[-1]
            return original(a, b)

        monkeypatch.setattr(mint, "matmul", counting)


def test_sparse_local_experts_sum_to_the_dense_moe_and_do_their_share_of_its_work(moe, monkeypatch):
    """Two EP ranks of one group, simulated: each runs its two experts on the group's gathered
    tokens (2 x 32 rows). The partial outputs add up to the dense MoE's output for each rank's
    rows, and each rank's expert FLOPs are exactly its routed rows' (6 H I per row), summing to
    k rows per token over the group: half of the dense product's per rank (num_experts / k = E)."""
    ep, tokens_per_rank = 2, 32
    group = _tokens(ep * tokens_per_rank)
    weights = moe.routing_weights(group)
    dense = moe(group).asnumpy()
    counter = MatmulCounter(monkeypatch)
    moe(group[:tokens_per_rank])
    dense_flops_per_rank, counter.flops = counter.flops, 0
    per_row = 2 * 3 * CFG.hidden_size * CFG.expert_hidden
    assert dense_flops_per_rank == CFG.num_experts * tokens_per_rank * per_row
    total, flops = 0, []
    for rank in range(ep):
        experts = LocalExperts({g: moe.experts[g] for g in local_experts(CFG.num_experts, ep, rank)})
        counter.flops = 0
        total = total + experts(group, weights).asnumpy()
        flops.append(counter.flops)
        routed = sum(r.size for r in routed_rows(weights.asnumpy(), experts.indices).values())
        assert experts.last.routed == routed and experts.last.padding == 0
        assert flops[-1] == routed * per_row
    np.testing.assert_allclose(total, dense, rtol=0, atol=2e-6 * np.abs(dense).max())
    assert sum(flops) == CFG.experts_per_token * ep * tokens_per_rank * per_row
    assert sum(flops) / ep == dense_flops_per_rank / ep


def test_an_expert_no_row_is_routed_to_runs_one_padding_row_with_weight_zero(moe):
    experts = LocalExperts({g: moe.experts[g] for g in (0, 1)})
    tokens = _tokens(6)
    weights = np.zeros((6, CFG.num_experts), np.float32)
    weights[:, 0] = 1.0                                     # every row to expert 0, none to 1
    out = experts(tokens, Tensor(weights))
    assert (experts.last.rows, experts.last.padding) == ({0: 6, 1: 0}, 1)
    np.testing.assert_array_equal(out.asnumpy(), moe.experts[0](tokens).asnumpy())
    params = experts.trainable_params()
    grads = ms.grad(lambda t, w: experts(t, w).sum(), None, params)(tokens, Tensor(weights))
    unrouted = [g.asnumpy() for p, g in zip(params, grads) if ".1." in p.name or p.name.startswith("1.")]
    assert len(unrouted) == 3 and all(not g.any() for g in unrouted)


def _simulated_all_to_all(sends: list, splits: list) -> list:
    """all_to_all_single among E simulated ranks: rank d receives, from each source s in
    order, the block of s's send buffer that s's split sizes address to d."""
    ep = len(sends)
    blocks = [np.split(sends[s], np.cumsum(splits[s])[:-1]) for s in range(ep)]
    return [np.concatenate([blocks[s][d] for s in range(ep)]) for d in range(ep)]


@pytest.mark.parametrize("ep,num_experts,top_k", [(2, 4, 2), (4, 8, 2), (4, 4, 1), (2, 6, 3)])
def test_all_to_all_bookkeeping_routes_every_row_to_its_expert_and_back(ep, num_experts, top_k):
    rng = np.random.default_rng([ep, num_experts, top_k])
    tokens, hidden = 9, 5
    mats = rng.standard_normal((num_experts, hidden, hidden))
    xs = [rng.standard_normal((tokens, hidden)) for _ in range(ep)]
    ws = []
    for _ in range(ep):
        w = np.zeros((tokens, num_experts))
        for t in range(tokens):
            w[t, rng.choice(num_experts, top_k, replace=False)] = rng.random(top_k) + 0.1
        ws.append(w)
    ws[0][:, 0] = 0.0                                      # an expert no row of rank 0 uses
    plans = [plan_send(w, ep) for w in ws]
    for plan, w in zip(plans, ws):
        assert plan.counts.sum() == np.count_nonzero(w) == plan.rows.size
    counts = _simulated_all_to_all([p.per_expert.reshape(-1) for p in plans],
                                   [[num_experts // ep] * ep for _ in range(ep)])
    there = _simulated_all_to_all([x[p.rows] for x, p in zip(xs, plans)],
                                  [p.counts for p in plans])
    outputs, receives = [], []
    for dest in range(ep):
        local = local_experts(num_experts, ep, dest)
        receive = plan_receive(counts[dest].reshape(ep, -1), local)
        receives.append(receive)
        assert receive.counts.sum() == there[dest].shape[0]
        out = np.zeros_like(there[dest])
        for g, positions in receive.positions.items():
            out[positions] = there[dest][positions] @ mats[g]
        outputs.append(out)
    back = _simulated_all_to_all(outputs, [r.counts for r in receives])
    for x, w, plan, got in zip(xs, ws, plans, back):
        combined = np.zeros_like(x)
        np.add.at(combined, plan.rows, got * w[plan.rows, plan.experts][:, None])
        want = sum(w[:, [g]] * (x @ mats[g]) for g in range(num_experts))
        np.testing.assert_allclose(combined, want, rtol=1e-12, atol=1e-12)


def test_the_dispatcher_a_run_uses_is_the_one_its_plan_costs(monkeypatch):
    """model.moe_dispatcher: ``auto`` is all-to-all on Ascend, all-gather elsewhere; the model
    builds the dispatcher ``resolve_dispatcher`` names, and ``gradpool plan`` costs the same."""
    import gradpool.device
    from gradpool.app.config import from_dict
    from gradpool.app.plan import PlanOptions, plan_memory
    ep = ExpertParallel(size=1, rank=0, comm=SingleProcessCommunicator())
    built = {"all-to-all": AllToAllDispatcher, "all-gather": AllGatherDispatcher}
    for device in ("Ascend", "CPU"):
        monkeypatch.setattr(gradpool.device, "device_target", lambda d=device: d)
        for choice in ("auto", "all-to-all", "all-gather"):
            name = resolve_dispatcher(choice, device)
            assert name == (choice if choice != "auto" else
                            "all-to-all" if device == "Ascend" else "all-gather")
            if name == "all-to-all" and device == "Ascend":
                continue                       # its exchange is HCCL's (no NPU here)
            assert type(dispatcher_for(ep, choice)) is built[name]
            cfg = from_dict({}, [f"launch.device={device}", "launch.ranks=2",
                                 "model.expert_parallel=2", f"model.moe_dispatcher={choice}"])
            assert plan_memory(cfg, PlanOptions()).experts.dispatcher == name
    with pytest.raises(InvalidArgumentError, match="'ring'"):
        resolve_dispatcher("ring", "CPU")
    assert dispatcher_for(None, "all-to-all") is None


def test_expert_parallel_refusals():
    with pytest.raises(InvalidArgumentError, match="expert_parallel = 2 needs"):
        TinyDeepSeekV3(dataclasses.replace(CFG, expert_parallel=2))
    with pytest.raises(InvalidArgumentError, match="spans 1 ranks, not size 2"):
        ExpertParallel(size=2, rank=0, comm=SingleProcessCommunicator())
    with pytest.raises(InvalidArgumentError, match=r"rank must be an integer in \[0, 2\), got 2"):
        ExpertParallel(size=2, rank=2, comm=SingleProcessCommunicator())
    with pytest.raises(InvalidArgumentError, match="does not divide num_experts = 4"):
        local_experts(4, 3, 0)
    assert list(local_experts(8, 4, 3)) == [6, 7]
    with pytest.raises(InvalidArgumentError, match="does not divide"):
        plan_send(np.ones((2, 4)), 3)


class _Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(1.0, 8.0, dtype=np.float32).reshape(7, 1)), name="w")

    def construct(self, x):
        return (mint.matmul(x, self.w) ** 2).sum()


@pytest.mark.parametrize("main_grad", [False, True], ids=["plain", "main_grad"])
def test_gradient_divide_factor_divides_the_summed_gradient_at_world_one(main_grad):
    """World 1: "avg" divides by 1, so the factor alone makes the difference; the scaling
    factor multiplies after it; set_reduce_op_type replaces the factor (last call wins)."""
    x = Tensor(np.linspace(-1, 1, 14, dtype=np.float32).reshape(2, 7))
    plain = _Tiny()
    want = ms.grad(plain, grad_position=None, weights=plain.trainable_params())(x)[0].asnumpy()
    for setup, scale in ((lambda m: m.set_gradient_divide_factor(4), 0.25),
                         (lambda m: (m.set_gradient_divide_factor(4.0),
                                     m.set_gradient_scaling_factor(3.0)), 0.75),
                         (lambda m: (m.set_gradient_divide_factor(4),
                                     m.set_reduce_op_type("avg")), 1.0)):
        model = _Tiny()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=main_grad),
                    pool_config=GradPoolConfig(async_reduce=False))
        setup(model)
        params = model.trainable_params()
        model.zero_grad()
        grads = ms.grad(model, grad_position=None, weights=params)(x)
        got = params[0].main_grad if main_grad else grads[0]
        np.testing.assert_allclose(got.asnumpy(), want * scale, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1.5, float("nan"), float("inf"), "4", True, None])
def test_a_bad_gradient_divide_factor_is_refused_by_name(bad):
    model = _Tiny()
    fully_shard(model, pool_config=GradPoolConfig(async_reduce=False))
    with pytest.raises(InvalidArgumentError, match="gradient divide factor") as raised:
        model.set_gradient_divide_factor(bad)
    assert repr(bad) in str(raised.value)
