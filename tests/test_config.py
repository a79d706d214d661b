"""The YAML config loader: shipped files load, every bad input names what was wrong."""
import dataclasses
import json
import math
import pathlib

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from gradpool import GradPoolConfig
from gradpool.app.config import (
    ModelConfig, Override, RunConfig, dump_yaml, from_dict, known_keys, load_config,
    parse_override)
from gradpool.runtime import MIB
from gradpool.app.errors import (ConfigError, ConfigValueError, OverrideSyntaxError,
                                 UnknownConfigKeyError)

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "deepseek3_tiny.yaml"
ASCEND = CONFIGS / "deepseek3_910b_2card.yaml"


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- shipped files ----------------------------------------------------------------------
@pytest.mark.parametrize("path", [TINY, ASCEND], ids=lambda p: p.name)
def test_shipped_files_load_with_the_field_configuration(path):
    cfg = load_config(path)
    fs = cfg.fully_shard
    assert fs.param_dtype is None and fs.reduce_dtype == "float32"
    assert fs.apply_grad_on_fp32_main_grad is True and fs.comm_fusion is False
    assert cfg.launch.ranks == 2
    assert cfg.gradpool.alignment_bytes == 512
    assert cfg.model.vocab_size % 2 == 1  # uneven shards of the embedding's dim 0


def test_tiny_file_is_the_cpu_default():
    cfg = load_config(TINY)
    assert cfg.launch.device == "CPU"
    assert cfg.model == ModelConfig()  # the file states the defaults
    assert cfg.train.learning_rate == pytest.approx(1e-3)


def test_ascend_file_targets_ascend_with_a_larger_model():
    cfg = load_config(ASCEND)
    assert cfg.launch.device == "Ascend"
    assert cfg.model.hidden_size > ModelConfig().hidden_size


@pytest.mark.parametrize("path", [TINY, ASCEND], ids=lambda p: p.name)
def test_every_key_in_shipped_files_has_a_comment(path):
    for line in path.read_text().splitlines():
        if line.startswith("  ") and ":" in line:
            assert "#" in line, f"{path.name}: no comment on {line.strip()!r}"


def test_every_known_key_is_in_the_shipped_files():
    for path in (TINY, ASCEND):
        data = yaml.safe_load(path.read_text())
        assert {s: tuple(body) for s, body in data.items()} == known_keys()


# ---- defaults and units ---------------------------------------------------------------------
def test_an_empty_file_is_refused_saying_what_to_write(tmp_path):
    for text in ("", "# only a comment\n"):
        with pytest.raises(ConfigError, match="is empty; write at least one section"):
            load_config(write(tmp_path, text))
    assert load_config(write(tmp_path, "gradpool:\n")) == RunConfig()     # a section: defaults
    assert from_dict({}) == RunConfig()


def test_a_file_that_is_not_utf8_is_one_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  vocab_size: 67  # größe\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8"):
        load_config(path)


def test_more_ranks_than_one_machine_runs_are_refused():
    from gradpool.app.config import max_ranks
    with pytest.raises(ConfigValueError, match="launch.ranks = 100000") as err:
        from_dict({"launch": {"ranks": 100000}})
    assert err.value.key == "launch.ranks"
    assert from_dict({"launch": {"ranks": max_ranks("CPU")}}).launch.ranks == max_ranks("CPU")
    with pytest.raises(ConfigValueError, match="launch.ranks = 17"):
        from_dict({"launch": {"ranks": 17, "device": "Ascend"}})


def test_mib_properties_convert_to_bytes():
    pool = GradPoolConfig(bucket_cap_mib=0.5, max_cached_mib=3)
    assert pool.bucket_cap_bytes == MIB // 2
    assert pool.max_cached_bytes == 3 * MIB
    assert GradPoolConfig().max_cached_bytes is None
    assert pool.pool_kwargs() == {"alignment_bytes": 512, "max_cached_bytes": 3 * MIB,
                                  "poison_on_release": False, "max_buckets_in_flight": 2}


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) would read 1e-4 as the string "1e-4".
    cfg = load_config(write(tmp_path, "train:\n  learning_rate: 1e-4\n"))
    assert cfg.train.learning_rate == pytest.approx(1e-4)


def test_enum_values_are_case_insensitive_and_stored_canonically(tmp_path):
    cfg = load_config(write(tmp_path, "launch:\n  device: ascend\nfully_shard:\n  reduce_op: SUM\n"))
    assert cfg.launch.device == "Ascend" and cfg.fully_shard.reduce_op == "sum"


# ---- bad files --------------------------------------------------------------------------------
def test_unknown_nested_key_names_path_file_and_suggestion(tmp_path):
    path = write(tmp_path, "fully_shard:\n  comm_fuson: true\n")
    with pytest.raises(UnknownConfigKeyError) as info:
        load_config(path)
    message = str(info.value)
    assert "'fully_shard.comm_fuson'" in message
    assert str(path) in message
    assert "did you mean 'fully_shard.comm_fusion'" in message


def test_unknown_top_level_section_names_it_and_suggests(tmp_path):
    path = write(tmp_path, "gradpol:\n  zero_copy: true\n")
    with pytest.raises(UnknownConfigKeyError) as info:
        load_config(path)
    message = str(info.value)
    assert "'gradpol'" in message and str(path) in message
    assert "did you mean 'gradpool'" in message


def test_unknown_key_without_a_close_match_lists_known_keys(tmp_path):
    with pytest.raises(UnknownConfigKeyError) as info:
        load_config(write(tmp_path, "train:\n  zzz: 1\n"))
    assert "'train.zzz'" in str(info.value) and "learning_rate" in str(info.value)


@pytest.mark.parametrize("text, key, given, allowed", [
    ("fully_shard:\n  comm_fusion: 'true'\n", "fully_shard.comm_fusion", "'true' (str)", "bool"),
    ("fully_shard:\n  comm_fusion: 1\n", "fully_shard.comm_fusion", "1 (int)", "bool"),
    ("train:\n  steps: 2.5\n", "train.steps", "2.5 (float)", "an integer >= 1"),
    ("train:\n  steps: true\n", "train.steps", "True (bool)", "an integer >= 1"),
    ("model:\n  vocab_size: '67'\n", "model.vocab_size", "'67' (str)", "an integer >= 2"),
    ("gradpool:\n  bucket_cap_mib: big\n", "gradpool.bucket_cap_mib", "'big' (str)", "number > 0"),
    ("launch:\n  log_dir: 7\n", "launch.log_dir", "7 (int)", "string or null"),
    ("launch:\n  master_port: 70000\n", "launch.master_port", "70000 (int)", "<= 65535"),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v and "." in v else None)
def test_wrong_type_names_key_given_value_and_allowed(tmp_path, text, key, given, allowed):
    path = write(tmp_path, text)
    with pytest.raises(ConfigValueError) as info:
        load_config(path)
    message = str(info.value)
    assert key in message and given in message and allowed in message and str(path) in message
    assert info.value.key == key


@pytest.mark.parametrize("text, key, given, allowed", [
    ("fully_shard:\n  reduce_op: max\n", "fully_shard.reduce_op", "'max'", "'avg', 'sum'"),
    ("fully_shard:\n  reduce_dtype: fp32\n", "fully_shard.reduce_dtype", "'fp32'",
     "'float32', 'float16', 'bfloat16' or null"),
    ("fully_shard:\n  param_dtype: int8\n", "fully_shard.param_dtype", "'int8'", "'bfloat16'"),
    ("train:\n  optimizer: adamw\n", "train.optimizer", "'adamw'", "'adam', 'sgd'"),
    ("launch:\n  device: GPU\n", "launch.device", "'GPU'", "'CPU', 'Ascend'"),
])
def test_bad_enum_value_lists_allowed_values(tmp_path, text, key, given, allowed):
    with pytest.raises(ConfigValueError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert key in message and given in message and allowed in message


def test_bad_enum_value_suggests_the_closest():
    with pytest.raises(ConfigValueError, match=r"did you mean 'avg'"):
        from_dict({"fully_shard": {"reduce_op": "avgg"}})


@pytest.mark.parametrize("section, key, value", [
    ("gradpool", "bucket_cap_mib", 0), ("gradpool", "bucket_cap_mib", -1.5),
    ("gradpool", "max_cached_mib", 0), ("gradpool", "max_buckets_in_flight", 0),
    ("gradpool", "alignment_bytes", 0), ("gradpool", "alignment_bytes", -512),
    ("gradpool", "alignment_bytes", 510), ("train", "learning_rate", 0.0),
    ("train", "steps", 0), ("launch", "ranks", 0), ("model", "num_layers", -1),
    ("gradpool", "bucket_cap_mib", float("inf")), ("train", "learning_rate", float("nan")),
])
def test_non_positive_or_non_finite_numbers_are_rejected(section, key, value):
    with pytest.raises(ConfigValueError) as info:
        from_dict({section: {key: value}})
    assert f"{section}.{key} = {value!r}" in str(info.value)


def test_cross_key_checks_name_both_keys():
    with pytest.raises(ConfigValueError, match=r"model.hidden_size = 30.*model.num_heads = 4"):
        from_dict({"model": {"hidden_size": 30}})
    with pytest.raises(ConfigValueError, match=r"experts_per_token = 5.*num_experts = 4"):
        from_dict({"model": {"experts_per_token": 5}})


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigValueError, match=r"model.vocab_size = -1"):
        ModelConfig(vocab_size=-1)
    with pytest.raises(ConfigValueError, match=r"RunConfig.model must be a ModelConfig"):
        RunConfig(model={"vocab_size": 67})


@pytest.mark.parametrize("text, fragment", [
    ("- 1\n- 2\n", "top level must be a mapping"),
    ("model: 3\n", "section 'model' must be a mapping"),
    ("model:\n  seq_len: 8\n  seq_len: 9\n", "duplicate key 'seq_len'"),
    ("model: [unclosed\n", "not valid YAML"),
    ("model:\n  [a]: 1\n", "unhashable key"),
])
def test_malformed_files(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


# ---- overrides ------------------------------------------------------------------------------
def test_override_applies_and_later_wins():
    cfg = load_config(TINY, ["fully_shard.comm_fusion=true", "train.steps=3", "train.steps=4"])
    assert cfg.fully_shard.comm_fusion is True and cfg.train.steps == 4


@pytest.mark.parametrize("text, value", [
    ("fully_shard.comm_fusion=true", True), ("fully_shard.comm_fusion='true'", True),
    ("fully_shard.comm_fusion=\"False\"", False), ("fully_shard.comm_fusion = off", False),
])
def test_override_accepts_bool_strings(text, value):
    assert from_dict({}, [text]).fully_shard.comm_fusion is value


def test_override_parses_yaml_scalars():
    assert parse_override("train.learning_rate=1e-4").value == pytest.approx(1e-4)
    assert parse_override("launch.master_port=null").value is None
    assert parse_override("launch.log_dir=a=b").value == "a=b"  # split on the first '='
    assert parse_override("model.seq_len=16") == Override("model", "seq_len", 16, "model.seq_len=16")


@pytest.mark.parametrize("text, fragment", [
    ("fully_shard.comm_fusion", "section.key=value"),
    ("comm_fusion=true", "must be section.key"),
    ("fully_shard.comm_fusion.x=true", "must be section.key"),
    ("=true", "must be section.key"),
    ("model.seq_len=[1, 2]", "one scalar"),
    ("model.seq_len={a: 1}", "one scalar"),
    ("model.seq_len='unclosed", "not valid YAML"),
])
def test_bad_override_syntax(text, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_override(text)
    assert repr(text) in str(info.value)
    if fragment != "not valid YAML":
        assert isinstance(info.value, OverrideSyntaxError)


def test_unknown_override_key_names_the_override():
    text = "fully_shard.comm_fuson=true"
    with pytest.raises(UnknownConfigKeyError) as info:
        load_config(TINY, [text])
    message = str(info.value)
    assert repr(text) in message and "'fully_shard.comm_fuson'" in message
    assert "did you mean 'fully_shard.comm_fusion'" in message
    with pytest.raises(UnknownConfigKeyError, match="unknown section 'fullyshard'"):
        parse_override("fullyshard.comm_fusion=true")


def test_bad_override_value_names_the_override():
    text = "fully_shard.reduce_op=max"
    with pytest.raises(ConfigValueError) as info:
        load_config(TINY, [text])
    assert repr(text) in str(info.value) and "'avg', 'sum'" in str(info.value)
    with pytest.raises(ConfigValueError, match=r"comm_fusion = 'maybe'"):
        from_dict({}, ["fully_shard.comm_fusion=maybe"])


def test_cross_key_error_from_an_override_names_the_override():
    with pytest.raises(ConfigValueError, match=r"'model.num_heads=5'"):
        load_config(TINY, ["model.num_heads=5"])


# ---- round trip -------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [TINY, ASCEND], ids=lambda p: p.name)
def test_round_trip_through_yaml(tmp_path, path):
    cfg = load_config(path, ["gradpool.max_cached_mib=0.75", "launch.log_dir=logs/run 1"])
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain builtins only
    again = load_config(write(tmp_path, dump_yaml(cfg), "again.yaml"))
    assert again == cfg and again.to_dict() == data
    assert from_dict(data) == cfg


# ---- property: random valid overrides produce the values set ---------------------------------
def _yaml_text(value):
    """Render a value as override text the way a user would type it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)  # e.g. 1e-05, 0.25: both read back as floats
    if isinstance(value, int):
        return str(value)
    # A JSON string is a valid YAML double-quoted scalar; keep non-ASCII raw because PyYAML
    # does not join \u surrogate-pair escapes back into one character.
    return json.dumps(value, ensure_ascii=False)


finite_positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
# Pool sizes must hold at least one aligned chunk (1 MiB alignment at most): from 1 MiB up.
pool_mib = st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False)
dtype = st.sampled_from([None, "float32", "float16", "bfloat16"])
SIMPLE = {
    "fully_shard.comm_fusion": st.booleans(),
    "fully_shard.reshard_after_forward": st.booleans(),
    "fully_shard.param_dtype": dtype,
    "fully_shard.reduce_dtype": dtype,
    "fully_shard.apply_grad_on_fp32_main_grad": st.booleans(),
    "fully_shard.reduce_op": st.sampled_from(["avg", "sum"]),
    "fully_shard.gradient_scaling_factor": finite_positive,
    "fully_shard.all_reduce_every_micro_step": st.booleans(),
    "gradpool.bucket_cap_mib": pool_mib,
    "gradpool.max_buckets_in_flight": st.none() | st.integers(1, 64),
    "gradpool.alignment_bytes": st.integers(1, 1024).map(lambda n: 4 * n),
    "gradpool.zero_copy": st.booleans(),
    "gradpool.poison_on_release": st.booleans(),
    "gradpool.max_cached_mib": st.none() | pool_mib,
    "gradpool.verify_gradients": st.booleans(),
    "gradpool.async_reduce": st.booleans(),
    "gradpool.check_unit_order": st.booleans() | st.just("strict"),
    "gradpool.main_grad_in_place": st.booleans(),
    "model.vocab_size": st.integers(2, 100_000),
    "model.num_layers": st.integers(1, 64),
    "model.expert_hidden": st.integers(1, 4096),
    "model.seq_len": st.integers(1, 4096),
    "model.batch_size": st.integers(1, 512),
    "model.moe_dispatcher": st.sampled_from(["auto", "all-to-all", "all-gather"]),
    "train.steps": st.integers(1, 10_000),
    "train.micro_steps": st.integers(1, 64),
    "train.learning_rate": finite_positive,
    "train.seed": st.integers(0, 2**32 - 1),
    "train.optimizer": st.sampled_from(["adam", "sgd"]),
    "train.async_save": st.booleans(),
    "train.stop_save_grace_s": st.integers(0, 3600),
    "train.verify_checkpoint": st.booleans(),
    "train.resume_from": st.none() | st.text(
        st.characters(whitelist_categories=("L", "N"), whitelist_characters="/_-. "),
        min_size=1, max_size=20).filter(lambda s: s.strip() == s and s != "latest"),
    "launch.ranks": st.integers(1, 8),      # within one host's bound on CPU and Ascend
    "launch.device": st.sampled_from(["CPU", "Ascend"]),
    "launch.master_port": st.none() | st.integers(1, 65535),
    "launch.launch_blocking": st.none() | st.booleans(),
    "launch.log_dir": st.none() | st.text(
        st.characters(whitelist_categories=("L", "N"), whitelist_characters="/_-. "),
        min_size=1, max_size=20).filter(lambda s: s.strip() == s),
}


@st.composite
def model_shape(draw):
    """Keys tied by cross-key rules are drawn together so every set is valid."""
    heads = draw(st.integers(1, 16))
    experts = draw(st.integers(1, 16))
    return {"model.num_heads": heads,
            "model.hidden_size": heads * draw(st.integers(1, 64)),
            "model.num_experts": experts,
            "model.experts_per_token": draw(st.integers(1, experts)),
            # tied to launch.ranks and the mesh too: its rules have their own tests below
            "model.expert_parallel": 1}


MODEL_SHAPE_KEYS = {"model.num_heads", "model.hidden_size", "model.num_experts",
                    "model.experts_per_token", "model.expert_parallel"}


@pytest.mark.parametrize("overrides, fragment", [
    (["model.expert_parallel=3"], "does not divide model.num_experts = 4"),
    (["model.expert_parallel=4", "launch.ranks=2"], "does not divide launch.ranks = 2"),
    (["model.expert_parallel=2", "launch.ranks=4", "fully_shard.mesh_shape=[4,1]"],
     "does not nest in fully_shard.mesh_shape = [4, 1]"),
    (["model.expert_parallel=0"], "model.expert_parallel"),
])
def test_expert_parallel_that_cannot_be_laid_out_is_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigValueError, match="model.expert_parallel") as caught:
        from_dict({}, overrides)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("overrides", [
    ["model.expert_parallel=4", "launch.ranks=4"],
    ["model.expert_parallel=2", "launch.ranks=4", "fully_shard.mesh_shape=[2,2]"],
    ["model.expert_parallel=2", "launch.ranks=4", "model.num_experts=6"],
])
def test_expert_parallel_that_nests_is_accepted(overrides):
    assert from_dict({}, overrides).model.expert_parallel > 1


# Tied by cross-key rules (node_rank < nodes, ranks / nodes, devices per node, Ascend-only keys):
# drawn together by the property test in tests/test_launch_config.py.
LAUNCH_NODE_KEYS = {"launch.nodes", "launch.node_rank", "launch.ranks_per_node",
                    "launch.master_addr", "launch.cluster_timeout_s", "launch.env",
                    "launch.devices", "launch.hccl_if_ip", "launch.hccl_socket_ifname",
                    "launch.hccl_connect_timeout_s", "launch.hccl_exec_timeout_s",
                    "launch.hccl_buffsize_mib"}


@st.composite
def checkpoint_saving(draw):
    """save_every needs save_dir: drawn together so every set is valid."""
    save_dir = draw(SIMPLE["launch.log_dir"])
    every = draw(st.none() | st.integers(1, 10_000)) if save_dir is not None else None
    keep = draw(st.none() | st.integers(1, 100)) if save_dir is not None else None
    return {"train.save_dir": save_dir, "train.save_every": every, "train.keep_last": keep}


SAVE_KEYS = {"train.save_dir", "train.save_every", "train.keep_last"}


def test_property_strategies_cover_every_key():
    # A key added to the schema must be added to the property test too.
    every = {f"{s}.{k}" for s, keys in known_keys().items() for k in keys}
    assert set(SIMPLE) | MODEL_SHAPE_KEYS | MESH_KEYS | LAUNCH_NODE_KEYS | SAVE_KEYS == every


@st.composite
def override_sets(draw):
    keys = draw(st.lists(st.sampled_from(sorted(SIMPLE)), unique=True, max_size=len(SIMPLE)))
    chosen = {key: draw(SIMPLE[key]) for key in keys}
    if draw(st.booleans()):
        chosen.update(draw(model_shape()))
    if draw(st.booleans()):
        chosen.update(draw(checkpoint_saving()))
    return chosen


_TINY_DICT = load_config(TINY).to_dict()


@settings(max_examples=150, deadline=None)
@given(chosen=override_sets())
def test_random_valid_overrides_produce_the_values_set(chosen):
    texts = [f"{key}={_yaml_text(value)}" for key, value in chosen.items()]
    cfg = load_config(TINY, texts)
    base = _TINY_DICT
    got = cfg.to_dict()
    for section, body in got.items():
        for key, value in body.items():
            want = chosen.get(f"{section}.{key}", base[section][key])
            if isinstance(want, float):
                assert math.isclose(value, want, rel_tol=1e-12)
            else:
                assert value == want, f"{section}.{key}"
    # The overridden config round-trips as well.
    assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg
    assert dataclasses.replace(cfg) == cfg


# ---- renamed keys -----------------------------------------------------------------------------
def test_old_buckets_in_flight_key_is_read_with_a_deprecation_warning(tmp_path):
    with pytest.warns(FutureWarning, match=r"gradpool.buckets_in_flight is deprecated; call it "
                                           r"gradpool.max_buckets_in_flight"):
        cfg = load_config(write(tmp_path, "gradpool:\n  buckets_in_flight: 5\n"))
    assert cfg.gradpool.max_buckets_in_flight == 5
    with pytest.warns(FutureWarning):
        cfg = load_config(TINY, ["gradpool.buckets_in_flight=null"])
    assert cfg.gradpool.max_buckets_in_flight is None
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="given twice"):
        load_config(write(tmp_path, "gradpool:\n  max_buckets_in_flight: 1\n"
                                    "  buckets_in_flight: 5\n"))


def test_the_gradpool_section_is_the_library_config():
    """What `fully_shard(pool_config=...)` takes is what the YAML section loads into."""
    cfg = load_config(TINY)
    assert type(cfg.gradpool) is GradPoolConfig
    assert set(known_keys()["gradpool"]) == {f.name for f in dataclasses.fields(GradPoolConfig)}


@pytest.mark.parametrize("key, value", [("bucket_cap_mib", 1e-12), ("max_cached_mib", 0.00001)])
def test_pool_sizes_too_small_for_one_aligned_chunk_are_refused_at_load(tmp_path, key, value):
    path = write(tmp_path, f"gradpool:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"gradpool.{key} = {value!r}" in str(err.value) and str(path) in str(err.value)


# ---- the mesh -----------------------------------------------------------------------------------
MESH_KEYS = {"fully_shard.mesh_shape", "fully_shard.mesh_dim_names"}     # checked together


def test_a_mesh_loads_from_a_file_and_from_overrides(tmp_path):
    hsdp = load_config(CONFIGS / "deepseek3_tiny_hsdp.yaml")
    assert hsdp.fully_shard.mesh_shape == (2, 2) and hsdp.launch.ranks == 4
    assert hsdp.fully_shard.mesh_dim_names == ("dp_replicate", "fsdp")
    assert from_dict(yaml.safe_load(dump_yaml(hsdp))) == hsdp
    cfg = load_config(TINY, ["fully_shard.mesh_shape=[1, 2]"])
    assert cfg.fully_shard.mesh_shape == (1, 2)


@pytest.mark.parametrize("body, needle", [
    ({"mesh_shape": [2, 2, 1]}, "has 3 dims"),
    ({"mesh_shape": [2, 0]}, "fully_shard.mesh_shape = [2, 0]"),
    ({"mesh_shape": []}, "non-empty list"),
    ({"mesh_shape": [2, 2], "mesh_dim_names": ["a", "a"]}, "an item repeats"),
    ({"mesh_shape": [2, 2], "mesh_dim_names": ["a"]}, "one name per dim"),
    ({"mesh_dim_names": ["a"]}, "one name per dim"),
    ({"mesh_shape": "2x2"}, "'2x2'"),
])
def test_bad_meshes_are_refused_naming_the_key(body, needle):
    with pytest.raises(ConfigValueError) as err:
        from_dict({"fully_shard": body})
    assert needle in str(err.value)


# ---- checkpoints --------------------------------------------------------------------------------
def test_checkpoint_keys_default_to_nothing_saved_or_resumed():
    train = load_config(TINY).train
    assert (train.save_dir, train.save_every, train.resume_from) == (None, None, None)


def test_checkpoint_keys_load_from_a_file_and_from_overrides(tmp_path):
    path = write(tmp_path, "train:\n  save_dir: ckpt\n  save_every: 2\n"
                           "  resume_from: old/step-00000002\n")
    train = load_config(path).train
    assert (train.save_dir, train.save_every, train.resume_from) == \
        ("ckpt", 2, "old/step-00000002")
    train = load_config(TINY, ["train.save_dir=out", "train.save_every=3"]).train
    assert (train.save_dir, train.save_every) == ("out", 3)
    assert load_config(TINY, ["train.save_dir=out"]).train.save_every is None   # at the end


@pytest.mark.parametrize("source", ["file", "override"])
def test_save_every_without_save_dir_names_both_keys(tmp_path, source):
    if source == "file":
        path, overrides = write(tmp_path, "train:\n  save_every: 2\n"), []
    else:
        path, overrides = TINY, ["train.save_every=2"]
    with pytest.raises(ConfigValueError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "train.save_every = 2" in message and "train.save_dir" in message
    assert (str(path) if source == "file" else "'train.save_every=2'") in message
    assert info.value.key == "train.save_every"


@pytest.mark.parametrize("key, value, needle", [
    ("save_every", 0, "an integer >= 1 or null"),
    ("save_every", "2", "an integer >= 1 or null"),
    ("save_every", True, "an integer >= 1 or null"),
    ("save_dir", "", "a non-empty string or null"),
    ("save_dir", 3, "a non-empty string or null"),
    ("resume_from", "", "a non-empty string or null"),
    ("resume_from", ["a"], "a non-empty string or null"),
])
def test_bad_checkpoint_values_name_key_and_allowed(key, value, needle):
    body = {key: value, **({"save_dir": "ckpt"} if key == "save_every" else {})}
    with pytest.raises(ConfigValueError) as info:
        from_dict({"train": body})
    assert f"train.{key} = {value!r}" in str(info.value) and needle in str(info.value)
    assert info.value.key == f"train.{key}"
