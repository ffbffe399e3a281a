"""The ``mmsched`` command: serve, config, sweep, keygen, loadtest, worker."""

from __future__ import annotations

import argparse
import os
import sys

from . import config as config_mod
from .errors import ConfigError


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    for name, f in config_mod.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = f.metadata["kind"]
        default = f.default_factory() if kind is list else f.default
        choices = f.metadata["choices"]
        help = (f"{f.metadata['help']}" + (f"; one of {', '.join(choices)}" if choices else "")
                + f" (default: {config_mod._toml_value(default)}; env MMSCHED_{name.upper()})").replace("%", "%%")
        if name == "fault":
            p.add_argument(flag, action="append", metavar="RANK:STAGE:RID_GLOB", help=help)
        elif kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            p.add_argument(flag, type=config_mod.parse_table if kind is dict else kind, metavar=name.upper(),
                           help=help, choices=choices)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmsched", description="mmsched, a scheduler sidecar for multimodal "
                                     "LLM serving: serve, config, sweep, keygen, loadtest, worker. See README.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    # no abbreviations: `--gil 250` used to set gil_switch_us, and would change meaning (or
    # fail as ambiguous) the day another flag starting so is added
    serve = sub.add_parser("serve", allow_abbrev=False, help="run the scheduler (tp ranks)", description=(
        "Run the scheduler. Every setting is a flag, an environment variable and a TOML key; "
        "flags beat the environment, which beats --config FILE, which beats the defaults."))
    _add_config_flags(serve)
    cfgp = sub.add_parser("config", allow_abbrev=False,
                          help="check the configuration (file, environment, flags); --print shows it all")
    _add_config_flags(cfgp)
    cfgp.add_argument("--print", action="store_true", dest="do_print",
                      help="print the whole effective configuration as TOML (a valid config file)")
    kg = sub.add_parser("keygen", help="write a CurveZMQ key pair: NAME.key (public) and NAME.key_secret")
    kg.add_argument("--out", default=".", metavar="DIR", help="directory to write into")
    kg.add_argument("--name", default="mmsched", help="file name stem")
    sw = sub.add_parser("sweep", help="reclaim orphaned segments (unlocked, old, prefixed)")
    sw.add_argument("--shm-prefix", default=None, help="segment name prefix (default from config)")
    sw.add_argument("--grace", type=float, default=None, metavar="S", help="minimum age in seconds")
    sw.add_argument("--dry-run", action="store_true", help="list what would be reclaimed, unlink nothing")
    sw.add_argument("--config", metavar="FILE", help="TOML config file")
    from .worker.cli import add_flags as add_worker_flags

    add_worker_flags(sub.add_parser("worker", help="the tokenizer worker: OpenAI-style HTTP in front of mmsched "
                                    "(needs mmsched[hf])"))
    _add_loadtest_flags(sub.add_parser("loadtest", help="drive a frontend with a seeded request mix; "
                                       "report latency, statuses, lost results and leaks"))
    return parser


def _load(args: argparse.Namespace) -> config_mod.Config:
    flags = {k: getattr(args, k) for k in config_mod.FIELDS if getattr(args, k, None) is not None}
    return config_mod.load(args.config, flags=flags)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "loadtest":
        return _loadtest(args)
    if args.command == "worker":
        from .worker.cli import main as worker_main

        return worker_main(args)
    if args.command == "keygen":
        return _keygen(args)
    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        return _config(args, cfg)
    return _serve(cfg, argv)


def _keygen(args: argparse.Namespace) -> int:
    from .auth import keygen

    public, secret = keygen(args.out, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _config(args: argparse.Namespace, cfg: config_mod.Config) -> int:
    if args.do_print:
        sys.stdout.write(cfg.to_toml())
    else:
        changed = [k for k in config_mod.FIELDS if getattr(cfg, k) != getattr(config_mod.Config(), k)]
        print(f"config ok; differs from the defaults in: {', '.join(changed) or 'nothing'} "
              "(mmsched config --print shows every setting)")
    return 0


def _serve(cfg: config_mod.Config, argv: list[str]) -> int:
    """Check what the leader binds and the engine spec before any rank starts, then run the rank(s)."""
    # torch's C++ warnings are lines of its own in our log (one per connection reset on the
    # rendezvous port, which any local process can cause); torch reads this once, as it loads
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from .admin import check_admin
    from .auth import check_frontend

    placed = _env_rank()
    try:
        if placed is None or placed[0] == 0:  # only the leader binds the frontend and the admin port
            check_frontend(cfg)
            check_admin(cfg.admin)
        from .engine import resolve

        resolve(cfg.engine)  # a spec that names no module or no factory stops us before any rank starts
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    from .launcher import launch_group  # these import torch: only once the config is known good
    from .server import run_rank

    if placed is not None:
        rank, world = placed
        return run_rank(cfg, rank, world)
    if cfg.tp == 1:
        return run_rank(cfg, 0, 1)
    return launch_group(cfg, argv)


def _env_rank() -> tuple[int, int] | None:
    """(rank, world) when launched by torchrun or by ``mmsched serve --tp N``."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _sweep(args: argparse.Namespace) -> int:
    from . import log
    from .sweep import sweep

    try:
        cfg = config_mod.load(args.config, flags={"shm_prefix": args.shm_prefix, "sweep_grace": args.grace})
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    log.setup(-1, cfg.log_format, cfg.log_level, role="sweep")
    report = sweep(cfg.shm_prefix, cfg.sweep_grace, dry_run=args.dry_run)
    verb = "would reclaim" if args.dry_run else "reclaimed"
    for name in report.reclaimed:
        print(f"{verb} {name}")
    print(f"sweep {report}")
    return 0



def _add_loadtest_flags(p: argparse.ArgumentParser) -> None:
    def sizes(text: str) -> list[int]:
        from .loadgen import parse_size

        try:
            return [parse_size(x) for x in text.split(",") if x]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def names(text: str) -> list[str]:
        return [x for x in text.split(",") if x]  # checked by LoadSpec.validate

    p.add_argument("--frontend", help="address to load (default: frontend from config)")
    p.add_argument("--config", metavar="FILE", help="TOML config file (frontend, shm_prefix)")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, metavar="R", help="open loop: R requests/s")
    loop.add_argument("--concurrency", type=int, metavar="C", help="closed loop: C in flight (default 16)")
    p.add_argument("--requests", type=int, metavar="N",
                   help="send at most N requests (default 1000; with --duration, no count limit)")
    p.add_argument("--duration", type=float, metavar="S", help="send for at most S seconds (default 60)")
    p.add_argument("--drain", type=float, default=10.0, metavar="S",
                   help="then wait at most S seconds for outstanding results; the rest are lost (10)")
    p.add_argument("--type", choices=("embed", "generate"), default="embed",
                   help="request type: embed or generate (embed)")
    p.add_argument("--items", type=int, default=1, metavar="K", help="features per request (0: text only)")
    p.add_argument("--item-bytes", type=sizes, default=[64 << 10], metavar="SIZES",
                   help="feature size(s), comma-separated, e.g. 64K,1M (64K)")
    p.add_argument("--transport", type=names, default=["pooled"], metavar="T[,T..]",
                   help="feature transport(s), mixed at random: pooled,shm,inline,cuda_ipc,memfd (pooled; memfd cannot mix with pooled)")
    p.add_argument("--session-turns", type=int, default=1, metavar="T",
                   help="turns per session: the first brings features with ids, later ones refer to them")
    p.add_argument("--fail-rate", type=float, default=0.0, metavar="F",
                   help="fraction of rids starting with 'fail-' (serve with e.g. --fault 0:open:fail-*)")
    p.add_argument("--client-faults", type=float, default=0.0, metavar="F",
                   help="fraction made bad by the client: missing segment, too-small segment, bad name")
    p.add_argument("--abort-rate", type=float, default=0.0, metavar="F", help="fraction aborted right after sending")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true",
                   help="ask for digests and check every 200 against the SHA-256 of the bytes sent; "
                        "a mismatch is a failure (exit 1)")
    p.add_argument("--pool-mb", type=float, metavar="MB", help="size of the client's ShmPool (default: sized to the load)")
    p.add_argument("--json", metavar="FILE", help="write the report (summary and raw per-request rows)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of latency over time (needs mmsched[plot])")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _loadtest(args: argparse.Namespace) -> int:
    """Thin: flags → LoadSpec → run → table (and JSON, plot); exit 1 on a lost result, a leak, a
    status the request's kind should not get, or (``--verify``) a 200 carrying bytes not sent."""
    from . import loadgen

    try:
        cfg = config_mod.load(args.config)
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    spec = loadgen.LoadSpec(
        frontend=args.frontend or cfg.frontend, rate=args.rate, concurrency=args.concurrency,
        requests=args.requests if args.requests is not None else (None if args.duration is not None else 1000),
        duration=args.duration if args.duration is not None else 60.0, drain_s=args.drain, type=args.type, items=args.items,
        item_bytes=args.item_bytes, transports=args.transport, session_turns=args.session_turns,
        fail_rate=args.fail_rate, client_faults=args.client_faults, abort_rate=args.abort_rate, seed=args.seed,
        shm_prefix=cfg.shm_prefix, pool_bytes=int(args.pool_mb * (1 << 20)) if args.pool_mb else None,
        verify=args.verify, progress=not args.quiet and sys.stderr.isatty())
    try:
        spec.validate()
        if args.plot and not loadgen.can_plot():
            raise ValueError(loadgen.PLOT_NEEDS)
    except ValueError as exc:
        print(f"mmsched loadtest: {exc}", file=sys.stderr)
        return 2
    report = loadgen.run_sync(spec)
    if report.summary["sent"]:
        print(loadgen.format_table(report))
    if report.error:
        print(f"mmsched loadtest: {report.error}", file=sys.stderr)
    if args.json:
        loadgen.write_json(report, args.json)
    if args.plot:
        try:
            loadgen.write_plot(report, args.plot)
        except RuntimeError as exc:
            print(f"mmsched loadtest: {exc}", file=sys.stderr)
            return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
