"""The launch section and the commands built from it, without msrun: multi-node keys, their
cross-key rules, the launch-time checks (port, host name), the msrun command and environment
each node gets, and `gradpool launch-cmd` / `gradpool train` refusing bad input before anything
starts (one line, exit 2, no temporary directory left)."""
from __future__ import annotations

import glob
import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from gradpool.app import rank_report
from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import (LaunchConfig, dump_yaml, from_dict, load_config, max_ranks)
from gradpool.app.launch import NodeSpec, build_node_launch, check_launch, port_free
from gradpool.errors import InvalidArgumentError
from gradpool.app.errors import ConfigValueError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
BIG = ROOT / "configs" / "deepseek3_671b_910b.yaml"
SCRIPT = ROOT / "gradpool" / "app" / "rank_main.py"


def launch(**keys) -> LaunchConfig:
    return from_dict({"launch": keys}).launch


def flags(argv) -> dict:
    """msrun's ``--name=value`` flags of a command, up to the script it runs."""
    out = {}
    for word in argv:
        if word == "python":
            break
        if word.startswith("--"):
            name, _, value = word[2:].partition("=")
            out[name] = value
    return out


# -- the keys ----------------------------------------------------------------------------------
def test_defaults_are_one_node_on_this_host():
    cfg = load_config(TINY).launch
    assert (cfg.nodes, cfg.node_rank, cfg.ranks_per_node, cfg.local_ranks) == (1, 0, None, 2)
    assert cfg.master_addr == "127.0.0.1" and cfg.cluster_timeout_s == 600
    assert cfg.env == () and cfg.devices is None and cfg.rank_env() == {}


def test_ranks_per_node_defaults_to_ranks_over_nodes_and_places_the_ranks():
    cfg = launch(ranks=16, nodes=2, node_rank=1, master_port=29500)
    assert cfg.local_ranks == 8 and cfg.first_rank == 8
    assert [cfg.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert launch(ranks=16, nodes=2, ranks_per_node=8, master_port=29500).local_ranks == 8


def test_env_devices_and_hccl_keys_become_the_ranks_environment():
    cfg = launch(ranks=16, nodes=2, master_port=29500, device="Ascend",
                 devices=[0, 1, 2, 3, 4, 5, 6, 7], env={"GLOG_v": 2, "TAG": "run-1"},
                 hccl_if_ip="10.1.2.3", hccl_socket_ifname="=eth0", hccl_connect_timeout_s=600,
                 hccl_exec_timeout_s=0, hccl_buffsize_mib=400)
    assert cfg.rank_env() == {
        "GLOG_v": "2", "TAG": "run-1", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        "HCCL_IF_IP": "10.1.2.3", "HCCL_SOCKET_IFNAME": "=eth0", "HCCL_CONNECT_TIMEOUT": "600",
        "HCCL_EXEC_TIMEOUT": "0", "HCCL_BUFFSIZE": "400"}


def test_launch_keys_round_trip_through_yaml_and_overrides():
    cfg = load_config(BIG)
    assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg
    assert yaml.safe_load(dump_yaml(cfg))["launch"]["env"] == {}
    over = load_config(TINY, ["launch.env={A: 1, B: x}", "launch.nodes=2",
                              "launch.master_port=29500", "launch.node_rank=1"])
    assert over.launch.env == (("A", "1"), ("B", "x")) and over.launch.first_rank == 1
    assert from_dict(yaml.safe_load(dump_yaml(over))) == over


@pytest.mark.parametrize("keys, key, needles", [
    ({"nodes": 2, "node_rank": 2, "master_port": 29500}, "launch.node_rank",
     ["launch.node_rank = 2", "out of range", "0 to 1"]),
    ({"ranks": 4, "nodes": 2, "ranks_per_node": 3, "master_port": 29500},
     "launch.ranks_per_node", ["launch.ranks_per_node = 3", "launch.nodes = 2",
                               "launch.ranks = 4"]),
    ({"ranks": 3, "nodes": 2, "master_port": 29500}, "launch.nodes",
     ["launch.nodes = 2", "does not divide launch.ranks = 3"]),
    ({"ranks": 4, "nodes": 2, "device": "Ascend", "devices": [0, 1, 2], "master_port": 29500},
     "launch.devices", ["launch.devices = [0, 1, 2]", "3 card(s)", "runs 2 rank(s)"]),
    ({"devices": [0, 1]}, "launch.devices", ["launch.devices", "only applies to", "Ascend"]),
    ({"hccl_buffsize_mib": 200}, "launch.hccl_buffsize_mib", ["only applies to"]),
    ({"device": "Ascend", "hccl_if_ip": "eth0"}, "launch.hccl_if_ip",
     ["launch.hccl_if_ip = 'eth0'", "not an IPv4 or IPv6 address"]),
    ({"device": "Ascend", "hccl_connect_timeout_s": 60}, "launch.hccl_connect_timeout_s",
     ["launch.hccl_connect_timeout_s = 60", ">= 120"]),
    ({"nodes": 2}, "launch.master_port", ["launch.master_port = None", "same port"]),
    ({"master_addr": "not a host!"}, "launch.master_addr",
     ["launch.master_addr = 'not a host!'", "neither an IP address nor a host name"]),
    ({"cluster_timeout_s": 0}, "launch.cluster_timeout_s", ["launch.cluster_timeout_s = 0"]),
    ({"env": {"MS_ROLE": "MS_SCHED"}}, "launch.env", ["MS_ROLE", "the launcher sets it"]),
    ({"env": {"HCCL_BUFFSIZE": 100}}, "launch.env", ["HCCL_BUFFSIZE", "launch.hccl_buffsize_mib"]),
    ({"env": {"FLAG": True}}, "launch.env", ["FLAG = True", "a string (without NUL bytes) or"]),
    ({"env": {"FLAG": "a\0b"}}, "launch.env", ["FLAG = 'a\\x00b'", "without NUL bytes"]),
    ({"env": {"PATH": "/usr/bin"}}, "launch.env", ["PATH", "the launcher sets it"]),
    ({"env": {"1BAD": "x"}}, "launch.env", ["'1BAD' is not an environment variable name"]),
    ({"env": ["A=1"]}, "launch.env", ["launch.env = ['A=1']", "a mapping"]),
    ({"ranks": 20, "nodes": 1, "device": "Ascend"}, "launch.ranks", ["launch.ranks = 20"]),
    ({"ranks": 64, "nodes": 2, "device": "Ascend", "master_port": 29500}, "launch.ranks",
     ["32 ranks per node", "add nodes"]),
])
def test_bad_launch_sections_are_refused_naming_key_and_value(keys, key, needles):
    with pytest.raises(ConfigValueError) as err:
        from_dict({"launch": keys})
    assert err.value.key == key
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("keys, blocks", [
    ({}, True), ({"device": "Ascend"}, False),                       # null: by device
    ({"launch_blocking": False}, False), ({"device": "Ascend", "launch_blocking": True}, True),
])
def test_op_launch_blocks_on_cpu_unless_told(keys, blocks):
    assert launch(**keys).blocks_launches is blocks


def test_a_launch_blocking_that_is_not_a_bool_is_refused():
    assert load_config(TINY, ["launch.launch_blocking=off"]).launch.blocks_launches is False
    with pytest.raises(ConfigValueError) as err:
        load_config(TINY, ["launch.launch_blocking=sometimes"])
    assert err.value.key == "launch.launch_blocking"
    assert "'sometimes'" in str(err.value) and "a bool (true or false) or null" in str(err.value)


def test_the_per_node_bound_lets_more_nodes_carry_more_ranks():
    bound = max_ranks("Ascend")
    assert launch(ranks=4 * bound, nodes=4, device="Ascend", master_port=29500).local_ranks \
        == bound


# -- launch-time checks ------------------------------------------------------------------------
def test_a_port_below_1024_is_refused_at_launch():
    with pytest.raises(ConfigValueError, match=r"launch.master_port = 80 is below 1024") as err:
        check_launch(launch(master_port=80))
    assert err.value.key == "launch.master_port"


def test_a_port_in_use_is_refused_on_the_scheduler_node_only():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert not port_free(port)
        with pytest.raises(ConfigValueError, match=rf"launch.master_port = {port} is in use"):
            check_launch(launch(master_port=port))
        with pytest.raises(ConfigValueError, match="is in use"):
            check_launch(launch(nodes=2, master_port=port), master_is_local=True)
        # node 1 binds nothing: on one host it must not mind node 0's scheduler on the port
        check_launch(launch(nodes=2, node_rank=1, master_port=port), master_is_local=True)
    assert port_free(port)


def test_a_master_name_that_does_not_resolve_is_refused_at_launch():
    cfg = launch(nodes=2, node_rank=1, master_port=29500, master_addr="no-such-host.invalid")
    with pytest.raises(ConfigValueError, match=r"launch.master_addr = 'no-such-host.invalid' "
                                               r"does not resolve") as err:
        check_launch(cfg)
    assert err.value.key == "launch.master_addr"


def test_node_0_must_own_the_master_address():
    cfg = launch(nodes=2, master_port=29500, master_addr="192.0.2.7")    # TEST-NET: not ours
    with pytest.raises(ConfigValueError, match="not an address of this host"):
        check_launch(cfg)
    check_launch(launch(nodes=2, node_rank=1, master_port=29500, master_addr="192.0.2.7"))


# -- the command each node runs ----------------------------------------------------------------
def test_one_node_runs_msrun_with_every_rank_here(tmp_path):
    node = build_node_launch(NodeSpec(world=2, local=2, master_port=29500), SCRIPT, ["--x", 1],
                             log_dir=tmp_path, env={"A": "1"})
    assert node.via_msrun and len(node.processes) == 1
    argv = node.command
    assert flags(argv) == {"worker_num": "2", "local_worker_num": "2", "master_port": "29500",
                           "log_dir": str(tmp_path), "join": "True", "cluster_time_out": "600"}
    assert argv[-6:] == ("python", "-m", "gradpool.app._rank_entry", str(SCRIPT), "--x", "1")
    env = dict(node.processes[0].env)
    assert env["A"] == "1" and env[rank_report.ENV_DIR] == str(tmp_path)


def test_node_k_of_a_cluster_runs_msrun_with_its_rank_and_the_masters_address(tmp_path):
    cfg = load_config(BIG, ["launch.node_rank=3"])
    from gradpool.app.job import node_launch
    node = node_launch(cfg, tmp_path, master_is_local=False)
    assert node.via_msrun
    assert flags(node.command) == {
        "worker_num": "2048", "local_worker_num": "8", "master_port": "8123",
        "master_addr": "10.0.0.1", "node_rank": "3", "log_dir": str(tmp_path), "join": "True",
        "cluster_time_out": "1800"}
    env = dict(node.processes[0].env)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert env["HCCL_SOCKET_IFNAME"] == "=eth0" and env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert env["HCCL_BUFFSIZE"] == "200" and "HCCL_IF_IP" not in env
    assert list(node.spec.ranks) == list(range(24, 32))
    text = node.shell()
    assert "export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text
    assert shlex.join(node.command) in text


def test_node_0_of_a_cluster_runs_the_scheduler_through_msrun(tmp_path):
    spec = NodeSpec(world=4, local=2, node_rank=0, nodes=2, master_addr="127.0.0.1",
                    master_port=29500, cluster_timeout_s=30)
    node = build_node_launch(spec, SCRIPT, log_dir=tmp_path, master_is_local=True)
    assert node.via_msrun and flags(node.command)["node_rank"] == "0"
    assert flags(node.command)["cluster_time_out"] == "30"


def test_a_second_node_on_the_masters_host_starts_its_workers_itself(tmp_path):
    # msrun would start a second scheduler there (master_addr is local): the workers get the
    # environment msrun gives its workers, one process and one log per rank
    spec = NodeSpec(world=6, local=2, node_rank=2, nodes=3, master_addr="127.0.0.1",
                    master_port=29500, cluster_timeout_s=45)
    node = build_node_launch(spec, SCRIPT, ["--a"], log_dir=tmp_path, env={"X": "y"},
                             master_is_local=True)
    assert not node.via_msrun and [p.rank for p in node.processes] == [4, 5]
    for local, process in enumerate(node.processes):
        env = dict(process.env)
        assert process.argv == (sys.executable, "-m", "gradpool.app._rank_entry", str(SCRIPT),
                                "--a")
        assert process.log_name == f"worker_{process.rank}.log"
        assert {k: env[k] for k in ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM",
                                    "MS_NODE_ID", "MS_TOPO_TIMEOUT", "RANK_ID", "RANK_SIZE",
                                    "DEVICE_ID", "X")} == {
            "MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "29500",
            "MS_WORKER_NUM": "6", "MS_NODE_ID": str(process.rank), "MS_TOPO_TIMEOUT": "45",
            "RANK_ID": str(process.rank), "RANK_SIZE": "6", "DEVICE_ID": str(local), "X": "y"}
    assert "without msrun" in node.shell() and node.shell().rstrip().endswith("wait")


def test_the_same_node_with_a_remote_master_uses_msrun(tmp_path):
    spec = NodeSpec(world=4, local=2, node_rank=1, nodes=2, master_addr="10.0.0.1",
                    master_port=29500)
    assert build_node_launch(spec, SCRIPT, log_dir=tmp_path, master_is_local=False).via_msrun


def test_node_spec_refuses_inconsistent_sizes():
    with pytest.raises(InvalidArgumentError, match="not the world size"):
        NodeSpec(world=5, local=2, nodes=2)
    with pytest.raises(InvalidArgumentError, match="node_rank"):
        NodeSpec(world=4, local=2, nodes=2, node_rank=2)


# -- the commands ------------------------------------------------------------------------------
def test_launch_cmd_prints_node_ks_command_and_environment(capsys):
    assert main(["launch-cmd", "--config", str(BIG), "--node-rank", "5"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "--node_rank=5" in out and "--worker_num=2048" in out and "--local_worker_num=8" in out
    assert "export HCCL_SOCKET_IFNAME==eth0" in out
    assert "check-config" in out and "launch.node_rank=5" in out
    assert "/shared/gradpool/ds3-671b/node5/config.yaml" in out


def _no_new_temp_dirs(before):
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "gradpool-*"))) == before, \
        "a refused run left a temporary directory"


@pytest.mark.parametrize("overrides, needles", [
    (["launch.nodes=2", "launch.master_port=29500", "launch.node_rank=5"],
     ["launch.node_rank = 5", "out of range"]),
    (["launch.ranks=4", "launch.nodes=2", "launch.ranks_per_node=1", "launch.master_port=2950"],
     ["launch.ranks_per_node = 1"]),
    (["launch.device=Ascend", "launch.devices=[0, 1, 2]"], ["launch.devices = [0, 1, 2]"]),
    (["launch.nodes=2", "launch.node_rank=1", "launch.master_port=29500",
      "launch.master_addr=no-such-host.invalid"], ["launch.master_addr = 'no-such-host.invalid'",
                                                   "does not resolve"]),
    (["launch.master_port=443"], ["launch.master_port = 443", "below 1024"]),
])
def test_train_refuses_bad_launch_input_before_anything_starts(capsys, overrides, needles):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gradpool-*")))
    argv = ["train", "--config", str(TINY)]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    _no_new_temp_dirs(before)


def test_train_refuses_a_port_in_use(capsys):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gradpool-*")))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["train", "--config", str(TINY), "--set", f"launch.master_port={port}"]) \
            == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"launch.master_port = {port} is in use" in err and len(err.strip().splitlines()) == 1
    _no_new_temp_dirs(before)


def test_launch_cmd_refuses_a_node_out_of_range(capsys):
    assert main(["launch-cmd", "--config", str(BIG), "--node-rank", "256"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "launch.node_rank = 256" in err and len(err.strip().splitlines()) == 1


# -- property: valid multi-node sections load and round-trip -----------------------------------
@st.composite
def node_sections(draw):
    device = draw(st.sampled_from(["CPU", "Ascend"]))
    per = draw(st.integers(1, min(8, max_ranks(device))))
    nodes = draw(st.integers(1, 64))
    section = {"device": device, "nodes": nodes, "ranks": per * nodes,
               "node_rank": draw(st.integers(0, nodes - 1)),
               "ranks_per_node": draw(st.sampled_from([None, per])),
               "master_port": draw(st.integers(1024, 65535)),
               "master_addr": draw(st.sampled_from(["127.0.0.1", "10.0.0.1", "node-0.cluster",
                                                    "fe80::1"])),
               "cluster_timeout_s": draw(st.integers(1, 7200)),
               "env": draw(st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True)
                                           .filter(lambda n: not n.startswith(("MS_", "RANK",
                                                                               "HCCL", "DEVICE",
                                                                               "ASCEND",
                                                                               "GRADPOOL"))),
                                           st.text("abc123", max_size=5), max_size=3))}
    if device == "Ascend":
        section["devices"] = draw(st.none() | st.permutations(range(16)).map(
            lambda p: sorted(p[:per])))
        section["hccl_if_ip"] = draw(st.none() | st.sampled_from(["10.0.0.2", "::1"]))
        section["hccl_socket_ifname"] = draw(st.none() | st.sampled_from(["=eth0", "eth,enp"]))
        section["hccl_connect_timeout_s"] = draw(st.none() | st.integers(120, 7200))
        section["hccl_exec_timeout_s"] = draw(st.none() | st.integers(0, 10 ** 6))
        section["hccl_buffsize_mib"] = draw(st.none() | st.integers(1, 4096))
    return section


@settings(max_examples=100, deadline=None)
@given(section=node_sections())
def test_random_valid_node_sections_load_and_round_trip(section):
    cfg = from_dict({"launch": section})
    got = cfg.to_dict()["launch"]
    for key, value in section.items():
        assert got[key] == value, key
    assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg
    spec_ranks = range(cfg.launch.first_rank, cfg.launch.first_rank + cfg.launch.local_ranks)
    assert all(cfg.launch.node_of(r) == cfg.launch.node_rank for r in spec_ranks)


def test_train_refuses_a_log_dir_it_cannot_write(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = main(["train", "--config", str(TINY), "--set", f"launch.log_dir={blocker / 'logs'}"])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "launch.log_dir" in err and "cannot be written" in err
    assert len(err.strip().splitlines()) == 1
