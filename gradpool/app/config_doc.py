"""``docs/config.md``, generated from the config schema.

    python -m gradpool.app.config_doc > docs/config.md

Every section and key comes from the schema (:func:`gradpool.app.config.known_keys`, each key's
rule, the defaults of :class:`gradpool.app.config.RunConfig`), so a key added, removed or given
another default or rule changes the page; ``tests/test_docs.py`` fails while ``docs/config.md``
differs from :func:`render`. What a key means is in ``MEANINGS``, else the ``# comment`` on its
line in the section's source; :func:`undocumented_keys` lists keys with neither. The page ends
with what each file under ``configs/`` sets differently from the defaults.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import pathlib
import sys
import tokenize
from typing import Any, Dict, List, Optional

from gradpool.app import config as _config
from gradpool.app import config_sections as _sections
from gradpool.app.config_rules import ListOf

COMMAND = "python -m gradpool.app.config_doc > docs/config.md"
ROOT = pathlib.Path(__file__).resolve().parents[2]

# What each section is for, above its table.
SECTION_NOTES = {
    "fully_shard": "How `fully_shard` wraps the model: the keywords of "
                   "`hyper_parallel.fully_shard` and the `HSDPModule` settings a run uses "
                   "(see [Using `fully_shard`](using-fully-shard.md)).",
    "gradpool": "The library's `gradpool.GradPoolConfig` (what `fully_shard(pool_config=...)` "
                "takes), checked at load time by the library's own rules: e.g. a "
                "`bucket_cap_mib` smaller than one aligned chunk is refused, naming the key.",
    "model": "Sizes of the DeepSeek-V3-shaped model `gradpool train` builds "
             "(`gradpool.app.model`); the tiny defaults keep a step fast on CPU, and the odd "
             "vocabulary makes the embedding and head shard unevenly.",
    "train": "The training loop: steps, optimizer, and checkpoints "
             "(see [Checkpoints](checkpoints.md#saving-and-resuming-a-run)).",
    "launch": "Where and how the ranks run: msrun's world, nodes and ports, every rank's "
              "environment, the Ascend settings (see [Launching runs](launch.md)).",
}

# What each key means. Links are relative to docs/.
MEANINGS = {
    "fully_shard.comm_fusion":
        "`false`: one reduce-scatter per gradient; `true`: gradients fused into buckets per "
        "reduce dtype (up to `gradpool.bucket_cap_mib`), and one all-gather per unit",
    "fully_shard.reshard_after_forward":
        "free each non-root unit's gathered parameters after its forward, gather them again "
        "before its backward",
    "fully_shard.param_dtype":
        "compute dtype of gathered parameters (`float32`/`float16`/`bfloat16`); null: the "
        "parameters' own",
    "fully_shard.reduce_dtype": "dtype gradients are reduced in",
    "fully_shard.apply_grad_on_fp32_main_grad":
        "accumulate reduced shards into each parameter's fp32 `main_grad`",
    "fully_shard.reduce_op": "`avg` or `sum` across ranks",
    "fully_shard.mesh_shape":
        "null: shard over every rank; `[S]`, or `[R, S]` for HSDP (R replicas of S-way shards, "
        "R x S = `launch.ranks`, else refused); `--set fully_shard.mesh_shape=[2,2]`",
    "fully_shard.mesh_dim_names":
        "one name per dim of `mesh_shape`, e.g. `[dp_replicate, fsdp]`",
    "fully_shard.gradient_scaling_factor": "reduced gradients are multiplied by this",
    "fully_shard.all_reduce_every_micro_step":
        "`false` (HSDP): the replicate all-reduce runs on the last micro-step only",
    "gradpool.bucket_cap_mib": "largest fused bucket, MiB",
    "gradpool.max_buckets_in_flight":
        "buckets per dtype whose collective may still run; at the bound `acquire` waits for "
        "the oldest (null: no bound)",
    "gradpool.alignment_bytes": "chunk alignment and bucket size granularity (Ascend's rule: 512)",
    "gradpool.zero_copy":
        "let the collective read a gradient in place when the layout allows",
    "gradpool.poison_on_release": "fill recycled buckets with NaN (debug)",
    "gradpool.max_cached_mib": "cap on memory the pool holds, MiB (null: no cap)",
    "gradpool.verify_gradients": "checksum each gradient on arrival and after its reduce",
    "gradpool.async_reduce":
        "with `apply_grad_on_fp32_main_grad`: each unit's reduce is launched in its backward "
        "and waited once into `main_grad` when the unit after the next one launches its reduce "
        "(the last two at the end of backward; the gradients "
        "`value_and_grad` returns are zeros then); `false`: each reduce completes in its "
        "unit's backward",
    "gradpool.check_unit_order":
        "every `fully_shard` unit collective carries a tag naming its unit, compared on the "
        "device and read once at the end of each backward that reduced (no collective and no "
        "host read per unit): units run in a different order on the ranks are an error naming "
        "them, not mixed shards; `strict`: every rank agrees before each unit collective "
        "instead (a world all-gather read on the host each time), which also names a mismatch "
        "that would hang; `false`: no check",
    "gradpool.main_grad_in_place":
        "where the device adds in place (Ascend): `main_grad += shard` with `Tensor.add_`, "
        "checked once per process to take effect (an error names this key if it does not); "
        "`false`: a new `main_grad` tensor per reduce",
    "model.vocab_size": "vocabulary; odd on purpose: the embedding and head shard unevenly",
    "model.hidden_size": "model width; a multiple of `num_heads`",
    "model.num_layers": "decoder layers (each one `fully_shard` unit)",
    "model.num_heads": "attention heads; must divide `hidden_size`",
    "model.num_experts": "routed experts per MoE layer",
    "model.experts_per_token": "top-k experts per token; at most `num_experts`",
    "model.expert_hidden": "inner width of each expert's MLP",
    "model.seq_len": "tokens each sequence predicts from",
    "model.expert_parallel":
        "expert-parallel ranks per MoE layer: each holds `num_experts / expert_parallel` "
        "experts (1: every rank holds all); divides `num_experts`, `launch.ranks` and the "
        "mesh's shard size",
    "model.moe_dispatcher":
        "the token dispatcher of `expert_parallel > 1`: `all-to-all` sends each routed row only "
        "to its expert's rank (`mint.distributed.all_to_all_single` on Ascend; off Ascend a "
        "stand-in built from all-gathers, for tests), `all-gather` gathers the EP group's tokens "
        "on every rank and reduce-scatters the outputs; `auto`: all-to-all on Ascend, all-gather "
        "elsewhere. `gradpool plan` costs the same one. See "
        "[expert parallelism](using-fully-shard.md#experts-on-their-own-sub-mesh-expert-parallelism)",
    "model.batch_size":
        "sequences per rank per micro-step (keep the global batch when the world size changes: "
        "4 at 2 ranks is 2 at 4 ranks)",
    "train.steps": "optimizer steps",
    "train.micro_steps": "gradient-accumulation micro-steps per optimizer step",
    "train.learning_rate": "the optimizer's learning rate",
    "train.seed": "seeds parameter init and the token batches",
    "train.optimizer": "`adam` or `sgd`",
    "train.save_dir":
        "save model and optimizer into `<save_dir>/step-00000004` (one directory per saved "
        "step); a file system all ranks share; null: no checkpoints",
    "train.save_every":
        "save after every this many steps and after the last (null: after the last only); "
        "`save_every` without `save_dir` is refused",
    "train.resume_from":
        "a `step-<N>` directory of an earlier run: load it at this run's world size and "
        "continue with step N+1; `latest`: the newest committed, intact `step-<N>` under "
        "`save_dir` (none there: start from step 0 and say so; see "
        "[Resuming the latest](checkpoints.md#resuming-the-latest-checkpoint)); a directory "
        "called `latest` is `./latest`",
    "train.keep_last":
        "after each save keep only the newest this many committed `step-<N>` directories "
        "(older ones removed, never the one just saved; needs `save_dir`); null: keep all",
    "train.async_save":
        "write each checkpoint in the background: the step waits only for a copy of the state "
        "in host memory; a save is committed (resumable, counted by `latest` and `keep_last`) "
        "at the end of the first step after every rank's write finished (see "
        "[Asynchronous save](checkpoints.md#asynchronous-save))",
    "train.stop_save_grace_s":
        "on SIGTERM, SIGINT or SIGHUP to the launcher, the seconds a save in progress gets to "
        "finish and commit before every rank is stopped (the launcher prints it); 0: stop at "
        "once (the save is left uncommitted, the previous step stays `latest`)",
    "train.verify_checkpoint":
        "check every checksum of `resume_from` before the launch and in the ranks' load; "
        "`false` (trusted storage) checks sizes, save ids and headers only and says so",
    "launch.ranks":
        "the world size (msrun's `worker_num`); at most 4 ranks per CPU core, 16 Ascend cards, "
        "per node",
    "launch.device": "`CPU` (MCCL under msrun) or `Ascend` (HCCL)",
    "launch.master_port":
        "msrun's scheduler port (null: a free one; required with several nodes); at launch it "
        "must be `>= 1024` and free on node 0",
    "launch.log_dir":
        "logs, reports and the resolved config (null: a temporary directory; `node<k>/` in it "
        "with several nodes)",
    "launch.nodes": "machines; every node runs `gradpool train` with its own `node_rank`",
    "launch.node_rank": "this node (0 runs msrun's scheduler and hosts rank 0)",
    "launch.ranks_per_node": "ranks per machine (null: `ranks / nodes`, which must divide)",
    "launch.master_addr": "node 0's IP or host name (multi-node)",
    "launch.cluster_timeout_s":
        "seconds for every rank to join (msrun's `--cluster_time_out`)",
    "launch.env":
        "variables added to every rank's environment (`{GLOG_v: 2}`; the launcher's own are "
        "refused; a single rank run in-process keeps `gradpool`'s own environment)",
    "launch.devices":
        "Ascend only: the card ids this node uses, one per local rank "
        "(`[0, 1, 2, 3, 4, 5, 6, 7]`); rank `i` of the node gets `DEVICE_ID=i` among them",
    "launch.hccl_if_ip":
        "Ascend only: the host NIC address HCCL uses to reach the root node when communicators "
        "are built (one IPv4/IPv6 address; wins over the interface name)",
    "launch.hccl_socket_ifname":
        "Ascend only: the host NIC by name: `eth` (prefix), `=eth0` (exactly), `^eth` / "
        "`^=eth0` (exclude)",
    "launch.hccl_connect_timeout_s":
        "Ascend only: seconds to wait for the other devices when links are built (CANN's "
        "default 120; raise it for hundreds of cards)",
    "launch.hccl_exec_timeout_s":
        "Ascend only: seconds a device waits for the others inside a collective (CANN's "
        "default 1836 on Atlas A2; 0: never)",
    "launch.hccl_buffsize_mib":
        "Ascend only: MB of HCCL buffer per communicator and direction (CANN's default 200): "
        "each communicator takes 2 x this of device memory, outside the pool",
    "launch.launch_blocking":
        "`true`: every op of a rank runs to completion before the next is dispatched "
        "(`mindspore.runtime.launch_blocking()`); null: true on CPU, false on Ascend. Also the "
        "in-process rank and the `--reference` run. See "
        "[Op launch on CPU](launch.md#op-launch-on-cpu)",
}

_INTRO = """\
One YAML file drives a run (`configs/deepseek3_tiny.yaml`, `configs/deepseek3_910b_2card.yaml`,
...): `gradpool train --config FILE`, `gradpool plan --config FILE`, `gradpool check-config FILE`.
Unknown keys, wrong types and bad values are errors naming the key path, the file, the value given
and what is allowed; `--set section.key=value` overrides follow the same rules (there, and only
there, `true`/`false`/`yes`/`no`/`on`/`off` are read as bools). An empty file is refused (write
at least one section; every key left out takes its default). `gradpool check-config FILE` prints
the resolved config, every key included.
"""


def _yaml_value(value: Any) -> str:
    """A default as YAML writes it: null, true, 25.0, [2, 2], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def _allowed(rule: Any) -> str:
    """The rule's own description; a list's items described one by one."""
    if isinstance(rule, ListOf):
        text = "a non-empty list, each item " + rule.item.describe()
        if rule.unique:
            text += ", each once"
        return text + ("; or null" if rule.nullable else "")
    return rule.describe()


def source_comments(cls: type) -> Dict[str, str]:
    """``{field: comment}``: the trailing ``# comment`` on each field's line(s) in the class's
    source, and a comment on the line(s) just above a field."""
    try:
        lines = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments: Dict[str, List[str]] = {}
    above: List[str] = []
    current: Optional[str] = None
    expect_name = True
    for token in tokenize.generate_tokens(io.StringIO(lines).readline):
        kind, text = token.type, token.string
        if kind == tokenize.COMMENT:
            if current is not None:
                comments.setdefault(current, []).append(text.lstrip("# ").strip())
            else:
                above.append(text.lstrip("# ").strip())
        elif kind == tokenize.NEWLINE:
            # a trailing comment comes before NEWLINE; the statement ends here
            current, expect_name = None, True
        elif kind in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            continue
        elif expect_name:
            expect_name = False
            if kind == tokenize.NAME and text in names:
                current = text
                if above:
                    comments.setdefault(text, []).extend(above)
            above = []
    return {name: "; ".join(parts) for name, parts in comments.items()}


def _comments(section: str) -> Dict[str, str]:
    cls = _config._SECTIONS[section]
    return source_comments(cls) if issubclass(cls, _sections._Section) else {}


def meaning(section: str, key: str) -> str:
    """What ``section.key`` means: ``MEANINGS``, else its source comment, else ""."""
    text = MEANINGS.get(f"{section}.{key}") or _comments(section).get(key, "")
    env = _sections.HCCL_ENV.get(key) if section == "launch" else None
    if section == "launch" and key == "devices":
        env = _sections.ASCEND_VISIBLE_DEVICES
    if env and text:
        text = f"sets `{env}`. {text}"
    return text


def undocumented_keys() -> List[str]:
    """Keys of the schema with no meaning in ``MEANINGS`` nor a source comment."""
    return [f"{section}.{key}" for section, keys in _config.known_keys().items()
            for key in keys if not meaning(section, key)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shipped_configs() -> List[str]:
    """Per file under configs/: the keys it sets to other values than the defaults."""
    defaults = _config.RunConfig().to_dict()
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = _config.load_config(path).to_dict()
        changed = [f"`{section}.{key}: {_yaml_value(value)}`"
                   for section, body in cfg.items() for key, value in body.items()
                   if value != defaults[section][key]]
        out.append(f"* `configs/{path.name}`: " + (", ".join(changed) if changed
                                                    else "every key at its default"))
    return out


def render() -> str:
    """The whole of ``docs/config.md``."""
    defaults = _config.RunConfig().to_dict()
    parts = ["# Config reference", "",
             f"Generated from the config schema (`gradpool/app/config_sections.py`, "
             f"`gradpool.GradPoolConfig`) by `{COMMAND}`; do not edit it by hand. "
             "`tests/test_docs.py` fails while it is out of date.", "",
             _INTRO.rstrip("\n"), ""]
    sections = _config.known_keys()
    parts.append("Sections: " + ", ".join(f"[`{name}`](#{name})" for name in sections) + ".")
    parts.append("")
    for section, keys in sections.items():
        parts += [f"## {section}", "", SECTION_NOTES.get(section, ""), "",
                  "| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
        for key in keys:
            parts.append(f"| `{section}.{key}` | `{_yaml_value(defaults[section][key])}` | "
                         f"{_cell(_allowed(_config._rules(section)[key]))} | "
                         f"{_cell(meaning(section, key))} |")
        renamed = [(old, new) for (sec, old), new in sorted(_config._RENAMED.items())
                   if sec == section]
        if renamed:
            parts.append("")
            parts += [f"The old name `{section}.{old}` is still read as `{section}.{new}`, with "
                      "a warning." for old, new in renamed]
        parts.append("")
    parts += ["## Shipped configs", "",
              "What each file under `configs/` sets to another value than the default "
              "(`gradpool check-config FILE` prints all of it):", ""]
    parts += _shipped_configs()
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
