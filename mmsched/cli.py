"""The ``mmsched`` command: serve, config."""

from __future__ import annotations

import argparse
import sys

from . import config as config_mod
from .errors import ConfigError
from .group import env_rank


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    for name, f in config_mod.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = type(f.default) if not isinstance(f.default, type(config_mod.dataclasses.MISSING)) else list
        if name == "fault":
            p.add_argument(flag, action="append", metavar="RANK:STAGE:RID_GLOB", help=f.metadata["help"])
        elif kind is bool:
            p.add_argument(flag, action="store_const", const=True, default=None, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=kind, metavar=name.upper(), help=f.metadata["help"],
                           choices=f.metadata["choices"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmsched", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the scheduler (tp ranks)")
    _add_config_flags(serve)
    cfgp = sub.add_parser("config", help="print the effective configuration")
    _add_config_flags(cfgp)
    cfgp.add_argument("--print", action="store_true", dest="do_print", help="print it as TOML")
    kg = sub.add_parser("keygen", help="write a CurveZMQ key pair: NAME.key (public) and NAME.key_secret")
    kg.add_argument("--out", default=".", metavar="DIR", help="directory to write into")
    kg.add_argument("--name", default="mmsched", help="file name stem")
    sw = sub.add_parser("sweep", help="reclaim orphaned segments (unlocked, old, prefixed)")
    sw.add_argument("--shm-prefix", default=None, help="segment name prefix (default from config)")
    sw.add_argument("--grace", type=float, default=None, metavar="S", help="minimum age in seconds")
    sw.add_argument("--dry-run", action="store_true", help="list what would be reclaimed, unlink nothing")
    sw.add_argument("--config", metavar="FILE", help="TOML config file")
    return parser


def _load(args: argparse.Namespace) -> config_mod.Config:
    flags = {k: getattr(args, k) for k in config_mod.FIELDS if getattr(args, k, None) is not None}
    return config_mod.load(args.config, flags=flags)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "keygen":
        from .auth import keygen

        public, secret = keygen(args.out, args.name)
        print(f"public key: {public}\nsecret key: {secret} (keep it private)")
        return 0
    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        sys.stdout.write(cfg.to_toml())
        return 0
    from .auth import check_frontend

    try:
        check_frontend(cfg)
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    from .server import launch_group, run_rank

    placed = env_rank()
    if placed is not None:
        rank, world = placed
        return run_rank(cfg, rank, world)
    if cfg.tp == 1:
        return run_rank(cfg, 0, 1)
    return launch_group(cfg, argv)


def _sweep(args: argparse.Namespace) -> int:
    from . import log
    from .sweep import sweep

    try:
        cfg = config_mod.load(args.config, flags={"shm_prefix": args.shm_prefix, "sweep_grace": args.grace})
    except ConfigError as exc:
        print(f"mmsched: config error: {exc}", file=sys.stderr)
        return 2
    log.setup(-1, cfg.log_format, cfg.log_level)
    report = sweep(cfg.shm_prefix, cfg.sweep_grace, dry_run=args.dry_run)
    verb = "would reclaim" if args.dry_run else "reclaimed"
    for name in report.reclaimed:
        print(f"{verb} {name}")
    print(f"sweep {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
