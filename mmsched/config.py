"""Configuration: defaults < TOML file < environment (``MMSCHED_<NAME>``) < command-line flags.

One flat table of settings; every key is also a flag (``max_batch`` → ``--max-batch``)
and an environment variable (``MMSCHED_MAX_BATCH``). A bad value raises ConfigError
naming the key; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .errors import ConfigError
from .faults import Fault
from .protocol import Limits


def _opt(default: Any, help: str, lo: float | None = None, hi: float | None = None,
         choices: tuple | None = None):
    kw = {"default_factory": lambda: type(default)(default)} if isinstance(default, (list, dict)) else {"default": default}
    return field(metadata={"help": help, "lo": lo, "hi": hi, "choices": choices, "kind": type(default)}, **kw)


@dataclass
class Config:
    frontend: str = _opt("ipc:///tmp/mmsched.sock", "ZeroMQ ROUTER address the leader binds (ipc:// or tcp://)")
    insecure: bool = _opt(False, "serve a non-loopback tcp:// frontend without CurveZMQ (not recommended)")
    curve_secret_key: str = _opt("", "server certificate with its secret key (NAME.key_secret from mmsched keygen)")
    curve_clients_dir: str = _opt("", "directory of allowed client public keys (NAME.key files)")
    ipc_mode: str = _opt("660", "octal file mode of an ipc:// frontend socket")
    zmq_hwm: int = _opt(100000, "ZeroMQ high-water mark (messages) of the frontend, both directions", 0, 1 << 30)
    max_message_bytes: int = _opt(256 << 20, "most bytes one message may hold, all frames (inline payloads included)", 1024, 1 << 40)
    max_inflight_bytes: int = _opt(8 << 30, "most feature bytes queued and running together; beyond it, 503", 0, 1 << 44)
    admin: str = _opt("", "admin HTTP endpoint for /health and /metrics: PORT, HOST:PORT or [IPV6]:PORT (host 127.0.0.1; port 0: a free one, named in admin_listening); off when empty")
    tp: int = _opt(1, "number of ranks in the group", 1, 256)
    dist_init: str = _opt("", "torch.distributed init address for --tp N (default: a free 127.0.0.1 port)")
    shm_prefix: str = _opt("mmsched_", "only segments with this prefix are opened or unlinked "
                           "(4-64 of [A-Za-z0-9_.-], a letter first, ending in _ . or -)")
    max_batch: int = _opt(256, "most requests handled as one batch (one consensus)", 1, 65536)
    max_queue: int = _opt(4096, "most requests waiting at the leader; beyond it, 503", 1, 1 << 24)
    max_queued_items: int = _opt(8192, "most feature items of queued and running requests together (each may hold a descriptor at the leader); beyond it, 503", 1, 1 << 24)
    collective_timeout: float = _opt(30.0, "seconds any collective may take before the group is broken", 0.1, 86400)
    shutdown_timeout: float = _opt(30.0, "seconds a SIGTERM drain may finish in-flight work", 0, 86400)
    torch_threads: int = _opt(1, "torch intra-op threads per rank (ranks only move data)", 1, 1024)
    sched_slice_us: int = _opt(100, "scheduler time slice asked for each rank thread, in us (Linux 6.12+: a woken collective thread runs sooner); 0 leaves the kernel's", 0, 100000)
    cpu_affinity: str = _opt("spread", "spread: each rank on this host runs on its own share of the CPUs the process may use (rank 0 the first run of them); off: the scheduler places them", choices=("spread", "off"))
    gil_switch_us: int = _opt(500, "how long a rank thread waiting for the GIL (one woken from a collective) waits before the running thread must let go, in us (sys.setswitchinterval; Python's default is 5000)", 100, 100000)
    log_format: str = _opt("text", "log line format", choices=("text", "json"))
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    fault: list = _opt([], "inject failures: RANK:STAGE:RID_GLOB (stages: open materialize release engine stall hold corrupt)")
    batch_ring: bool = _opt(True, "same-host followers take batches from a shared-memory ring instead of a gloo broadcast, "
                                     "and a group on one host runs the engine's all-gather through shared memory")
    stall_s: float = _opt(3.0, "seconds a 'stall' (engine) or 'hold' (materialize) fault holds its rank", 0, 3600)
    session_idle_timeout: float = _opt(600.0, "seconds a session may sit unused (no turn run, none queued or running) before its features are released", 0.001, 1e9)
    session_max_bytes: int = _opt(1 << 30, "most feature bytes all sessions together may hold; beyond it, 503", 0, 1 << 42)
    session_max_count: int = _opt(16384, "most sessions open at once, all clients; a turn that would open one more gets 503", 0, 1 << 30)
    session_max_features: int = _opt(65536, "most features all sessions together may hold, zero-size ones too; beyond it, 503", 0, 1 << 30)
    sweep_grace: float = _opt(60.0, "seconds an unlocked, prefixed segment must be old before the sweep takes it", 0, 1e9)
    sweep_interval: float = _opt(30.0, "seconds between orphan sweeps while serving (0: only at start-up)", 0, 1e9)
    max_input_len: int = _opt(131072, "most input ids per request", 1, 1 << 26)
    max_items: int = _opt(64, "most mm_items per request", 0, 1 << 16)
    max_item_bytes: int = _opt(1 << 30, "most bytes one feature may hold", 0, 1 << 40)
    max_request_bytes: int = _opt(2 << 30, "most feature bytes one request may hold", 0, 1 << 42)
    max_new_tokens: int = _opt(4096, "largest params.max_new_tokens accepted", 1, 1 << 20)
    max_params_bytes: int = _opt(64 << 10, "most bytes params may take in a request's header (MessagePack)", 0, 1 << 30)
    max_params_items: int = _opt(4096, "most elements (keys, values, array entries) params may hold", 0, 1 << 24)
    seed: int = _opt(0, "seed of the engine's weights (EngineContext.seed)", 0, 2**31 - 1)
    engine: str = _opt("mmsched.engines.reference:ReferenceEngine", "the engine plug-in, module:factory; "
                       "the factory gets an EngineContext (docs/engines.md)")
    engine_options: dict = _opt({}, "a table passed to the engine's factory as EngineContext.options "
                                "([engine_options] in a file; an inline table like {layers = 2} as a flag)")

    @cached_property  # read per message: built once (a Config is not changed after load)
    def limits(self) -> Limits:
        return Limits(shm_prefix=self.shm_prefix, max_input_len=self.max_input_len,
                      max_items=self.max_items, max_item_bytes=self.max_item_bytes,
                      max_request_bytes=self.max_request_bytes, max_new_tokens=self.max_new_tokens,
                      max_message_bytes=self.max_message_bytes, max_params_bytes=self.max_params_bytes,
                      max_params_items=self.max_params_items)

    @property
    def faults(self) -> list[Fault]:
        return [Fault.parse(s) for s in self.fault]

    @property
    def heartbeat_s(self) -> float:
        """How often an idle leader sends an empty batch, so followers never wait past their deadline."""
        return min(1.0, self.collective_timeout / 4)

    def to_toml(self) -> str:
        lines = []
        for f in fields(self):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(getattr(self, f.name))}")
        return "\n".join(lines) + "\n"


FIELDS = {f.name: f for f in fields(Config)}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table: valid among the top-level keys
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def parse_table(text: str) -> dict:
    """A TOML inline table given as text (``{layers = 2}``), for the environment and flags."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # a table nested past the stack, too
        raise ValueError(f"must be a TOML inline table like {{layers = 2}}, not {shown(text)}") from None


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def _coerce(name: str, value: Any, from_text: bool) -> Any:
    f = FIELDS[name]
    kind = f.metadata["kind"]
    try:
        if kind is dict:
            if from_text:
                value = parse_table(value)
            if not isinstance(value, dict):
                raise ValueError("must be a table")
        elif kind is bool:
            if from_text:
                low = str(value).strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError("must be true or false")
                value = low in ("1", "true", "yes", "on")
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
        elif kind is list:
            if from_text:
                value = [s for s in value.split(",") if s] if isinstance(value, str) else list(value)
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ValueError("must be a list of strings")
        elif kind is float:
            if from_text:
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError("must be a number")
            value = float(value)
        elif kind is int:
            if from_text:
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("must be an integer")
        elif not isinstance(value, str):
            raise ValueError("must be a string")
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc if 'must' in str(exc) else f'cannot read {shown(value)} as {kind.__name__}'}") from None
    m = f.metadata
    if m["lo"] is not None and value < m["lo"] or m["hi"] is not None and value > m["hi"]:
        raise ConfigError(f"{name}: {shown(value)} is outside {m['lo']}..{m['hi']}")
    if m["choices"] and value not in m["choices"]:
        raise ConfigError(f"{name}: {shown(value)} is not one of {', '.join(m['choices'])}")
    return value


def shown(v: Any, limit: int = 160) -> str:
    """``repr(v)`` (or an exception's text) cut to ``limit`` characters: a config error is one
    readable line, whatever was pasted into the setting."""
    text = str(v) if isinstance(v, BaseException) else repr(v)
    size = len(v) if isinstance(v, str) else len(text)  # the value's own length, not its repr's
    return text if len(text) <= limit else f"{text[:limit]}... ({size} characters)"


# PORT, HOST:PORT or [IPV6]:PORT, ASCII only: a host without colons, spaces or brackets (a bare
# IPv6 address is ambiguous), an IPv6 address with at least one colon and maybe a %zone
ADMIN_RE = re.compile(r"(?:(?:(?P<host>[!-9;-Z^-~]*)|\[(?P<ipv6>[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%[!-Z^-~]+)?)\]):)?"
                      r"(?P<port>[0-9]{1,5})", re.ASCII)
PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{2,62}[_.\-]")


def _check_prefix(prefix: str) -> None:
    """The sweep unlinks what carries the prefix: an empty or short one would reach files
    mmsched does not own (``libpod_lock``), ``sem.`` names POSIX semaphores, and a prefix
    without a closing separator matches longer words (``mmsched`` takes ``mmschedule``)."""
    if not PREFIX_RE.fullmatch(prefix) or prefix.startswith("sem."):
        raise ConfigError(f"shm_prefix: {shown(prefix)} could match files mmsched does not own; use 4-64 characters "
                          "of [A-Za-z0-9_.-] that start with a letter, end with _ . or -, and not sem.")


def load(path: str | None = None, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Config:
    """Merge the four layers; raises ConfigError naming the first bad key."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError, and what tomllib lets through:
            # bytes that are not UTF-8, an integer past Python's 4300 digits, nesting past the stack
            raise ConfigError(f"config: {path} is not valid TOML: {shown(exc)}") from exc
        for k, v in doc.items():
            if k not in FIELDS:
                raise ConfigError(f"{k}: unknown setting in {path}")
            values[k] = _coerce(k, v, from_text=False)
    for k in FIELDS:
        ev = env.get(f"MMSCHED_{k.upper()}")
        if ev is not None:
            values[k] = _coerce(k, ev, from_text=True)
    for k, v in (flags or {}).items():
        if v is None or v == []:
            continue
        if k not in FIELDS:
            raise ConfigError(f"{k}: unknown setting")
        values[k] = _coerce(k, v, from_text=False)
    cfg = Config(**values)
    cfg.faults  # noqa: B018 - parses every fault spec; a bad one names itself
    if not cfg.frontend.startswith(("ipc://", "tcp://")) or cfg.frontend in ("ipc://", "tcp://"):
        raise ConfigError(f"frontend: {shown(cfg.frontend)} is not an ipc:// or tcp:// address")
    form = ADMIN_RE.fullmatch(cfg.admin)  # port 0: a free one, named in admin_listening
    if cfg.admin and not (form and int(form["port"]) < 65536):
        raise ConfigError(f"admin: {shown(cfg.admin)} is not PORT, HOST:PORT or [IPV6]:PORT (port 0..65535)")
    try:
        if not 0 <= int(cfg.ipc_mode, 8) <= 0o777:
            raise ValueError
    except ValueError:
        raise ConfigError(f"ipc_mode: {shown(cfg.ipc_mode)} is not an octal file mode like 660") from None
    _check_prefix(cfg.shm_prefix)
    if cfg.tp > 1 and cfg.collective_timeout < 1:
        raise ConfigError("collective_timeout: must be >= 1 s when tp > 1")
    return cfg
