"""Configuration: the shipped files, file < env < flag precedence, and every kind of bad value.

Bad values are checked twice: ``config.load`` raises ConfigError naming the key, and the
real ``mmsched serve`` exits 2 with the key in its message (before binding anything).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mmsched import config as config_mod
from mmsched.config import FIELDS, Config, ConfigError, load

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MMSCHED_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(extra)
    return env


def mmsched(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mmsched", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=clean_env(**(env or {})), text=True)


def write(tmp_path, text: str | bytes, name: str = "mmsched.toml") -> str:
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- the shipped files

def test_default_toml_is_exactly_the_builtin_defaults():
    path = os.path.join(CONFIGS, "default.toml")
    with open(path, "rb") as fh:
        doc = tomllib.load(fh)
    assert sorted(doc) == sorted(FIELDS), "default.toml must spell out every setting, and only those"
    defaults = Config()
    for key, value in doc.items():
        assert value == getattr(defaults, key), key
        assert type(value) is type(getattr(defaults, key)), (key, "write 30.0, not 30, for a float")
    assert load(path, env={}) == defaults


def test_default_toml_has_a_comment_for_every_setting():
    with open(os.path.join(CONFIGS, "default.toml")) as fh:
        lines = fh.read().splitlines()
    for i, line in enumerate(lines):
        key = line.split("=", 1)[0].strip()
        if key in FIELDS and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"{key} has no comment above it"


def test_tp2_toml_is_a_two_rank_deployment():
    cfg = load(os.path.join(CONFIGS, "tp2.toml"), env={})
    assert cfg.tp == 2 and cfg.admin and cfg.log_format == "json"
    assert cfg.frontend == "ipc:///run/mmsched/mmsched.sock"


def test_printed_config_reads_back_as_the_same_config():
    cfg = load(None, env={"MMSCHED_FAULT": "1:open:a-*,0:stall:b?", "MMSCHED_MAX_BATCH": "7"})
    path_free = tomllib.loads(cfg.to_toml())
    assert Config(**path_free) == cfg


# ---------------------------------------------------------------- precedence

# key, value in the file, value in the environment (text) and as read, value as a flag
LAYERS = [
    ("max_batch", 10, "20", 20, 30),
    ("shutdown_timeout", 5.0, "7.5", 7.5, 0.25),
    ("log_format", "text", "json", "json", "text"),
    ("frontend", "ipc:///tmp/a.sock", "tcp://127.0.0.1:5999", "tcp://127.0.0.1:5999", "ipc:///tmp/c.sock"),
    ("fault", ["0:open:a"], "1:open:b,1:stall:c", ["1:open:b", "1:stall:c"], ["0:engine:d"]),
    ("collective_timeout", 12, "13", 13.0, 14.5),
]


@pytest.mark.parametrize("key,in_file,env_text,from_env,flag", LAYERS, ids=[k[0] for k in LAYERS])
def test_file_then_env_then_flag(tmp_path, key, in_file, env_text, from_env, flag):
    path = write(tmp_path, f"{key} = {config_mod._toml_value(in_file)}\n")
    env = {f"MMSCHED_{key.upper()}": env_text}
    assert getattr(load(None, env={}), key) == getattr(Config(), key)
    assert getattr(load(path, env={}), key) == in_file
    assert getattr(load(path, env=env), key) == from_env
    assert getattr(load(path, env=env, flags={key: flag}), key) == flag
    assert getattr(load(None, env={}, flags={key: flag}), key) == flag  # a flag alone wins too


def test_layers_merge_key_by_key(tmp_path):
    """Each layer overrides only the keys it sets; the rest come from the layer below."""
    path = write(tmp_path, "max_batch = 10\nmax_queue = 11\nseed = 12\n")
    cfg = load(path, env={"MMSCHED_MAX_QUEUE": "21", "MMSCHED_SEED": "22"}, flags={"seed": 32})
    assert (cfg.max_batch, cfg.max_queue, cfg.seed) == (10, 21, 32)
    assert cfg.tp == Config().tp


def test_the_cli_prints_file_env_flag_in_that_order(tmp_path):
    path = write(tmp_path, 'max_batch = 10\nmax_queue = 11\nshutdown_timeout = 5.0\nlog_format = "json"\n')
    proc = mmsched("config", "--print", "--config", path, "--max-batch", "30", "--fault", "1:open:x-*",
                   env={"MMSCHED_MAX_BATCH": "20", "MMSCHED_MAX_QUEUE": "21", "MMSCHED_TP": "2",
                        "MMSCHED_FAULT": "0:open:ignored"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    printed = tomllib.loads(out)
    assert sorted(printed) == sorted(FIELDS)
    assert printed["max_batch"] == 30          # flag over env over file
    assert printed["max_queue"] == 21          # env over file
    assert printed["tp"] == 2                  # env over default
    assert printed["shutdown_timeout"] == 5.0  # file over default
    assert printed["log_format"] == "json"
    assert printed["fault"] == ["1:open:x-*"]  # a flag list replaces the env list
    assert printed["seed"] == Config().seed    # default


# ---------------------------------------------------------------- bad values

# name, TOML text (or None), env, flags, key the error must name
BAD = [
    ("unknown key", "max_batchh = 3\n", {}, {}, "max_batchh"),
    ("wrong type", 'max_batch = "many"\n', {}, {}, "max_batch"),
    ("wrong type, float", 'shutdown_timeout = "soon"\n', {}, {}, "shutdown_timeout"),
    ("wrong type, list", 'fault = "1:open:x"\n', {}, {}, "fault"),
    ("wrong type, env", None, {"MMSCHED_MAX_QUEUE": "lots"}, {}, "max_queue"),
    ("out of range", "tp = 0\n", {}, {}, "tp"),
    ("out of range, env", None, {"MMSCHED_COLLECTIVE_TIMEOUT": "0.01"}, {}, "collective_timeout"),
    ("out of range, flag", None, {}, {"torch_threads": 0}, "torch_threads"),
    ("tp>1 needs a longer timeout", "tp = 2\ncollective_timeout = 0.5\n", {}, {}, "collective_timeout"),
    ("bad choice", 'log_format = "xml"\n', {}, {}, "log_format"),
    ("bad fault spec", 'fault = ["1:explode:x-*"]\n', {}, {}, "fault"),
    ("bad fault spec, env", None, {"MMSCHED_FAULT": "one:open:x"}, {}, "fault"),
    ("bad admin address", 'admin = "localhost"\n', {}, {}, "admin"),
    # int() reads these as ports (or raises a ValueError past the loader): ASCII digits only
    ("admin port in Arabic-Indic digits", None, {"MMSCHED_ADMIN": "\u0669\u0664\u0660\u0661"}, {}, "admin"),
    ("admin port in fullwidth digits", None, {}, {"admin": "127.0.0.1:\uff10"}, "admin"),
    ("admin port a superscript", 'admin = "0\u00b2"\n', {}, {}, "admin"),
    ("admin port of 5000 digits", None, {}, {"admin": "9" * 5000}, "admin"),
    ("admin host with a NUL", 'admin = "127.0.0.1\\u0000:0"\n', {}, {}, "admin"),
    ("admin as a URL", None, {}, {"admin": "http://127.0.0.1:0"}, "admin"),
    ("admin IPv6 without brackets", None, {}, {"admin": "::1:0"}, "admin"),
    ("admin empty brackets", None, {}, {"admin": "[]:0"}, "admin"),
    ("admin IPv4 in brackets", None, {}, {"admin": "[127.0.0.1]:0"}, "admin"),
    ("admin bracket left open", None, {}, {"admin": "[::1:0"}, "admin"),
    ("bad frontend", 'frontend = "/tmp/mmsched.sock"\n', {}, {}, "frontend"),
    ("unreadable TOML", "max_batch = = 3\n", {}, {}, "config"),
    # tomllib's own limits: each raised past the loader (a traceback, exit 1)
    ("TOML integer over 4300 digits", "max_batch = " + "9" * 4301 + "\n", {}, {}, "config"),
    ("TOML nested past the recursion limit", "a = " + "[" * 5000 + "1" + "]" * 5000 + "\n", {}, {}, "config"),
    ("TOML not UTF-8", b"max_batch = 3\n\xff = 2\n", {}, {}, "config"),
    ("engine options nested past the recursion limit", None,
     {"MMSCHED_ENGINE_OPTIONS": "{a = " + "[" * 5000 + "1" + "]" * 5000 + "}"}, {}, "engine_options"),
    ("missing file", "<missing>", {}, {}, "config"),
]


def _bad_path(tmp_path, text):
    if text is None:
        return None
    if text == "<missing>":
        return str(tmp_path / "no-such.toml")
    return write(tmp_path, text)


@pytest.mark.parametrize("what,text,env,flags,key", BAD, ids=[b[0] for b in BAD])
def test_bad_config_raises_config_error_naming_the_key(tmp_path, what, text, env, flags, key):
    with pytest.raises(ConfigError) as info:
        load(_bad_path(tmp_path, text), env=env, flags=flags)
    assert str(info.value).split(":", 1)[0] == key, str(info.value)


def test_a_huge_value_is_named_in_a_short_error():
    """A value pasted by mistake (5000 digits) is cut in the message: one readable line."""
    for env in ({"MMSCHED_MAX_BATCH": "9" * 5000}, {"MMSCHED_MAX_BATCH": "9" * 4000}):
        with pytest.raises(ConfigError) as info:
            load(None, env=env)
        assert str(info.value).startswith("max_batch: ") and len(str(info.value)) < 300, str(info.value)[:400]
        assert f"({len(env['MMSCHED_MAX_BATCH'])} characters)" in str(info.value), str(info.value)  # not its repr's


def _as_flags(flags: dict) -> list[str]:
    return [a for k, v in flags.items() for a in ("--" + k.replace("_", "-"), str(v))]


def test_bad_config_stops_serve_with_exit_2_naming_the_key(tmp_path):
    """Every case above through the real ``mmsched serve``; started together to save time."""
    procs = []
    for i, (what, text, env, flags, key) in enumerate(BAD):
        case_dir = tmp_path / f"case{i}"
        case_dir.mkdir()
        path = _bad_path(case_dir, text)
        args = ["serve", "--frontend", f"ipc://{case_dir}/never.sock"] if key != "frontend" else ["serve"]
        if path:
            args += ["--config", path]
        procs.append((what, key, case_dir, mmsched(*args, *_as_flags(flags), env=env)))
    for what, key, case_dir, proc in procs:
        try:
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, (what, proc.returncode, err[-2000:])
        assert f"config error: {key}:" in err, (what, err[-2000:])
        assert "Traceback" not in err, (what, err)
        assert not (case_dir / "never.sock").exists(), f"{what}: serve bound its socket before failing"


def test_a_flag_of_the_wrong_type_exits_2_naming_the_flag():
    """argparse checks flag types before the config layer: still exit 2, still named."""
    proc = mmsched("serve", "--max-batch", "many")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "--max-batch" in err and "many" in err



@pytest.mark.parametrize("command", ["serve", "config"])
def test_a_flag_must_be_spelled_out(command):
    """Outside attack: ``--gil 250`` set gil_switch_us (argparse takes a unique prefix), so a
    script's flag could change meaning when a flag starting the same way is added."""
    proc = mmsched(command, "--gil", "250", "--frontend", "ipc:///nonexistent-dir/x.sock")
    try:  # the frontend cannot bind: a serve that took the flag still exits, and never lingers
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2 and "unrecognized arguments: --gil 250" in err, err[-2000:]

# ---------------------------------------------------------------- the operator's doc

def test_every_setting_is_in_the_operations_doc_with_its_default():
    with open(os.path.join(REPO, "docs", "operations.md")) as fh:
        doc = fh.read()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].strip("`") in FIELDS:
            rows[cells[0].strip("`")] = cells
    missing = sorted(set(FIELDS) - set(rows))
    assert not missing, f"docs/operations.md has no settings row for {missing}"
    defaults = Config()
    for key, cells in rows.items():
        assert cells[1] == f"`MMSCHED_{key.upper()}`", cells
        assert cells[2] == f"`--{key.replace('_', '-')}`", cells
        assert cells[3] == f"`{config_mod._toml_value(getattr(defaults, key))}`", (key, cells[3])


# ---------------------------------------------------------------- the help a new user reads

def test_help_shows_defaults_environment_names_and_choices(capsys):
    """Issue 17 item 11: ``serve --help`` showed none of them; ``config`` equalled ``config --print``."""
    from mmsched import cli

    serve_help = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    flat = " ".join(serve_help.split())
    assert "(default: 256; env MMSCHED_MAX_BATCH)" in flat, serve_help
    assert "one of text, json (default: \"text\"; env MMSCHED_LOG_FORMAT)" in flat, serve_help
    top = cli.build_parser().format_help()
    assert all(c in top for c in ("sweep", "keygen", "loadtest")), top
    loadtest_help = cli.build_parser()._subparsers._group_actions[0].choices["loadtest"].format_help()
    assert "request type" in loadtest_help
    assert cli.main(["config", "--max-batch", "3"]) == 0
    short = capsys.readouterr().out
    assert cli.main(["config", "--print", "--max-batch", "3"]) == 0
    full = capsys.readouterr().out
    assert short != full and "max_batch" in short and len(short.splitlines()) == 1, short
