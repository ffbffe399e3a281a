"""docker/docker-compose.multihost.yml: a valid override of docker-compose.yml whose commands
torchrun and mmsched both accept, one node per host, consistent with the main file."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import yaml
from torch.distributed.run import get_args_parser

from mmsched import config as config_mod
from mmsched.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER = os.path.join(REPO, "docker")
HOST_ENV = {"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "eth0"}


def load(name: str) -> dict:
    with open(os.path.join(DOCKER, name)) as fh:
        return yaml.safe_load(fh)


def interpolate(value, env: dict):
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` (the forms the file uses)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m):
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, value)


@pytest.fixture(scope="module")
def base() -> dict:
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def override() -> dict:
    return load("docker-compose.multihost.yml")


def merged(base: dict, override: dict, service: str, env: dict) -> dict:
    """The service as compose merges it: mappings merge, command/entrypoint are replaced."""
    svc = dict(base["services"].get(service, {}))
    for k, v in override["services"][service].items():
        svc[k] = {**svc.get(k, {}), **v} if isinstance(v, dict) and isinstance(svc.get(k), dict) else v
    return interpolate(svc, env)


def test_the_override_matches_the_compose_specification(override):
    with open(os.path.join(REPO, "tests", "data", "compose-spec.json")) as fh:
        validator = jsonschema.Draft7Validator(json.load(fh))
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(override)]
    assert errors == []


@pytest.mark.parametrize("service,node_rank", [("mmsched", 0), ("mmsched-follower", 1)])
def test_each_host_runs_one_torchrun_node_of_mmsched_serve(base, override, service, node_rank):
    svc = merged(base, override, service, HOST_ENV)
    assert svc["entrypoint"] == ["torchrun"]
    args = get_args_parser().parse_args(svc["command"])
    assert (args.nnodes, args.node_rank, args.master_addr) == ("2", node_rank, "10.0.0.1")
    assert args.module and args.training_script == "mmsched"
    serve = build_parser().parse_args(args.training_script_args)
    assert serve.command == "serve" and serve.config == "/etc/mmsched/mmsched.toml"
    # gloo's per-pair connections on ephemeral ports need the host's network, on a named interface
    assert svc["network_mode"] == "host"
    assert svc["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"


def test_a_missing_master_address_is_an_error_not_a_default(base, override):
    with pytest.raises(KeyError, match="MASTER_ADDR"):
        merged(base, override, "mmsched-follower", {"GLOO_SOCKET_IFNAME": "eth0"})


def test_the_follower_is_the_main_image_with_the_same_config(base, override):
    leader = merged(base, override, "mmsched", HOST_ENV)
    follower = merged(base, override, "mmsched-follower", HOST_ENV)
    assert follower["image"] == leader["image"] and follower["build"] == leader["build"]
    assert follower["volumes"][0] == leader["volumes"][0]  # configs/tp2.toml, read-only
    assert follower["profiles"] == ["follower"]  # `up` on host A leaves it out
    assert "profiles" not in leader and "healthcheck" not in follower  # no admin port on followers


def test_the_leader_keeps_its_healthcheck_and_drain_on_host_networking(base, override):
    leader = merged(base, override, "mmsched", HOST_ENV)
    mount = next(v for v in leader["volumes"] if v["target"] == "/etc/mmsched/mmsched.toml")
    cfg = config_mod.load(os.path.normpath(os.path.join(DOCKER, mount["source"])), env=leader["environment"])
    host, _, port = cfg.admin.rpartition(":")
    assert host == "127.0.0.1", "on host networking 0.0.0.0 would publish /metrics on every interface"
    assert f"http://127.0.0.1:{port}/health" in " ".join(leader["healthcheck"]["test"])
    # docker's SIGTERM reaches torchrun, which SIGKILLs its ranks --shutdown-timeout later:
    # the leader's drain must fit inside it, and it inside docker's grace before its SIGKILL
    torchrun = get_args_parser().parse_args(leader["command"])
    grace = int(leader["stop_grace_period"].rstrip("s"))
    assert cfg.shutdown_timeout < torchrun.shutdown_timeout < grace
    assert leader["stop_signal"] == "SIGTERM"
    follower = merged(base, override, "mmsched-follower", HOST_ENV)
    assert follower["stop_signal"] == "SIGTERM" and int(follower["stop_grace_period"].rstrip("s")) > 30
