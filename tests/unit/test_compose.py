"""docker/docker-compose.yml: valid against the Compose Specification, and true to the repo.

No Docker engine runs here, so the file is checked the way a reviewer would: the schema,
then every path, command, port, timeout and socket it names against the repository.
"""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mmsched import config as config_mod
from mmsched.admin import parse_address
from mmsched.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER = os.path.join(REPO, "docker")
COMPOSE = os.path.join(DOCKER, "docker-compose.yml")
SCHEMA = os.path.join(REPO, "tests", "data", "compose-spec.json")
CONFIG_TARGET = "/etc/mmsched/mmsched.toml"


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE) as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def sidecar_config(compose) -> tuple[str, config_mod.Config]:
    """The config file mounted into the mmsched service, loaded as mmsched would (no env)."""
    mount = next(v for v in compose["services"]["mmsched"]["volumes"] if v["target"] == CONFIG_TARGET)
    path = os.path.normpath(os.path.join(DOCKER, mount["source"]))
    return path, config_mod.load(path, env={})


def _seconds(duration: str) -> float:
    """A Compose duration ("1m30s", "45s", "500ms") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _subcommands(parser) -> dict:
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def test_compose_file_matches_the_compose_specification(compose):
    with open(SCHEMA) as fh:
        schema = json.load(fh)
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_would_reject(compose):
    """The vendored schema is strict enough to catch a typo (guards against a no-op schema)."""
    with open(SCHEMA) as fh:
        validator = jsonschema.Draft7Validator(json.load(fh))
    bad = json.loads(json.dumps(compose))
    bad["services"]["mmsched"]["stop_grace_priod"] = "45s"
    bad["services"]["tokenizer-worker"]["depends_on"]["mmsched"]["condition"] = "service_ready"
    assert len(list(validator.iter_errors(bad))) >= 2


def test_every_path_it_names_exists_in_the_repo(compose):
    for name, svc in compose["services"].items():
        build = svc["build"]
        context = os.path.normpath(os.path.join(DOCKER, build["context"]))
        assert os.path.isdir(context), (name, context)
        assert os.path.isfile(os.path.join(context, build["dockerfile"])), (name, build["dockerfile"])
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                assert os.path.exists(os.path.normpath(os.path.join(DOCKER, vol["source"]))), (name, vol)
            else:
                assert vol["source"] in compose["volumes"], (name, vol["source"])
    # what the Dockerfile copies from the build context exists too
    with open(os.path.join(REPO, "docker", "Dockerfile")) as fh:
        dockerfile = fh.read()
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        if line.startswith("--from="):  # out of an earlier stage: that stage must exist
            stage = line.split()[0].removeprefix("--from=")
            assert re.search(rf"^FROM \S+ AS {stage}$", dockerfile, re.M), f"Dockerfile copies from no stage {stage}"
            continue
        for src in line.split()[:-1]:
            assert os.path.exists(os.path.join(REPO, src)), f"Dockerfile copies missing {src}"


def test_the_image_is_slim_cpu_torch_non_root_and_runs_mmsched():
    with open(os.path.join(REPO, "docker", "Dockerfile")) as fh:
        text = fh.read()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    with open(os.path.join(REPO, "constraints.txt")) as fh:
        pinned = re.search(r"^torch==(\S+)$", fh.read(), re.M).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pinned)}$", text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["mmsched"\]$', text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd == ["serve", "--config", CONFIG_TARGET]
    build_parser().parse_args(cmd)  # exits (SystemExit) on a flag mmsched does not know


@pytest.mark.parametrize("service", ["mmsched", "tokenizer-worker"])
def test_each_command_is_one_mmsched_knows(compose, service):
    command = compose["services"][service]["command"]
    parser = build_parser()
    sub = _subcommands(parser)[command[0]]
    known = {opt for a in sub._actions for opt in a.option_strings}
    for flag in (c for c in command[1:] if c.startswith("--")):
        assert flag in known, f"{service}: mmsched {command[0]} has no {flag}"
    args = parser.parse_args(command)  # and the values parse
    if command[0] == "loadtest":  # the stand-in worker sends for its whole duration
        assert args.rate * args.duration <= args.requests, "--requests caps the run early"


def test_the_healthcheck_hits_the_configs_admin_port(compose, sidecar_config):
    _, cfg = sidecar_config
    assert cfg.admin, "the sidecar's config must turn the admin endpoint on"
    test = compose["services"]["mmsched"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python", test  # no curl in the slim image
    url = re.search(r"http://([\w.]+):(\d+)/health", " ".join(test))
    assert url, test
    host, port = parse_address(cfg.admin)
    assert int(url.group(2)) == port
    assert host in ("0.0.0.0", "127.0.0.1", url.group(1)), "the check runs inside the container"


def test_stop_grace_outlasts_the_drain(compose, sidecar_config):
    _, cfg = sidecar_config
    svc = compose["services"]["mmsched"]
    assert svc["stop_signal"] == "SIGTERM"
    grace = _seconds(svc["stop_grace_period"])
    assert grace > cfg.shutdown_timeout, (grace, cfg.shutdown_timeout)


def test_the_socket_lies_in_the_shared_volume(compose, sidecar_config):
    path, cfg = sidecar_config
    assert os.path.basename(path) == "tp2.toml"
    assert cfg.tp == 2 and cfg.log_format == "json"
    assert cfg.frontend.startswith("ipc://"), cfg.frontend
    sock = cfg.frontend[len("ipc://"):]
    mmsched, worker = compose["services"]["mmsched"], compose["services"]["tokenizer-worker"]

    def volume_dirs(svc):
        return {v["target"]: v["source"] for v in svc["volumes"] if v["type"] == "volume"}

    mine = [t for t in volume_dirs(mmsched) if os.path.dirname(sock) == t or sock.startswith(t + "/")]
    assert mine, f"{sock} is not in a named volume of mmsched"
    assert volume_dirs(worker).get(mine[0]) == volume_dirs(mmsched)[mine[0]], "the worker must mount it too"
    command = worker["command"]
    assert command[command.index("--frontend") + 1] == cfg.frontend


def test_the_worker_shares_ipc_and_waits_for_health(compose):
    mmsched, worker = compose["services"]["mmsched"], compose["services"]["tokenizer-worker"]
    assert mmsched["ipc"] == "shareable"
    assert worker["ipc"] == "service:mmsched"
    assert worker["depends_on"]["mmsched"]["condition"] == "service_healthy"
    assert worker["image"] == mmsched["image"]


def test_the_config_files_load(sidecar_config):
    """Both shipped configs pass the same validation `mmsched serve` runs (exit 2 otherwise)."""
    for name in ("default.toml", "tp2.toml"):
        path = os.path.join(REPO, "configs", name)
        with open(path, "rb") as fh:
            assert set(tomllib.load(fh)) <= set(config_mod.FIELDS)
        config_mod.load(path, env={})
