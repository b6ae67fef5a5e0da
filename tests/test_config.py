import argparse
import json
import os
from pathlib import Path

import pytest

from antiphon.cli import build_parser
from antiphon.configfields import dataclass_from_args
from antiphon.engine_ext.config import (
    CPU_RESERVED_CORES_ENV,
    OMP_SPIN_COUNT_ENV,
    EngineConfig,
    cpu_threading_env,
    set_cpu_threading,
)
from antiphon.engine_ext.model_defaults import cpu_computes_bf16, resolve_dtype
from antiphon.server.auth import Authenticator, key_from_headers
from antiphon.server.config import ServerConfig
from antiphon.server.errors import ApiError, ErrorCode
from antiphon.sessions.config import SessionConfig


def test_non_loopback_needs_api_key() -> None:
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", api_keys=("k" * 16,)).api_keys
    assert ServerConfig(host="0.0.0.0", best_effort_api_keys=("k" * 16,)).accepted_api_keys
    assert ServerConfig(host="::1").host == "::1"


@pytest.mark.parametrize("kwargs", [{"port": 0}, {"max_frame_bytes": 0},
                                    {"default_max_tokens": 10, "max_tokens_limit": 5},
                                    {"api_keys": ("short",)}, {"max_batch_concurrency": 0},
                                    {"best_effort_api_keys": ("short",)},
                                    {"api_keys": ("k" * 16,),
                                     "best_effort_api_keys": ("j" * 16, "k" * 16)},
                                    {"max_batch_file_bytes": 0}])
def test_server_config_rejects_bad_limits(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"max_model_len": 1}, {"kv_cache_gib": 0},
                                    {"dtype": "int3"}, {"num_kv_pages": 0},
                                    {"be_step_limit_s": 0}, {"be_step_limit_s": float("nan")},
                                    {"slo_headroom": 1.0}, {"slo_headroom": -0.1},
                                    {"step_trace": "/no/such/folder/steps.jsonl"},
                                    {"cpu_reserved_cores": -1}, {"cpu_omp_spin_count": -2}])
def test_engine_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_cli_options_build_configs(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "serve", "--port", "9001", "--api-keys", "k" * 12, "--api-keys", "j" * 12,
        "--max-model-len", "1024", "--enforce-eager", "--data-dir", str(tmp_path),
        "--be-step-limit-s", "0.5", "--slo-headroom", "0.2", "--cpu-reserved-cores", "1",
        "--cpu-omp-spin-count", "-1",
        "--step-trace", str(tmp_path / "steps.jsonl")])
    server = dataclass_from_args(ServerConfig, args)
    engine = dataclass_from_args(EngineConfig, args)
    sessions = dataclass_from_args(SessionConfig, args)
    assert server.port == 9001 and server.api_keys == ("k" * 12, "j" * 12)
    assert engine.max_model_len == 1024 and engine.enforce_eager
    assert engine.scheduler_settings.be_step_limit_s == 0.5  # the arrival guard turned on
    assert engine.scheduler_settings.slo_headroom == 0.2
    assert engine.scheduler_settings.step_trace == str(tmp_path / "steps.jsonl")
    assert engine.cpu_reserved_cores == 1
    assert engine.cpu_omp_spin_count == -1  # libgomp's own default
    assert engine.dtype == "auto"  # untouched options keep the dataclass default
    assert sessions.db_path == tmp_path / "sessions.sqlite3"


def test_authenticator() -> None:
    open_auth = Authenticator(())
    assert open_auth.owner_for(None) == "local"
    auth = Authenticator(("a" * 10, "b" * 10))
    assert auth.owner_for("a" * 10) != auth.owner_for("b" * 10)
    for key in (None, "", "c" * 10):
        with pytest.raises(ApiError) as info:
            auth.owner_for(key)
        assert info.value.code == ErrorCode.UNAUTHORIZED


def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 fma\n")
    assert not cpu_computes_bf16(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_computes_bf16(cpuinfo)
    cpuinfo.write_text("Features\t: fp asimd sve bf16 i8mm\n")
    assert cpu_computes_bf16(cpuinfo)
    assert not cpu_computes_bf16(tmp_path / "missing")
    assert resolve_dtype("float16") == "float16"  # an explicit dtype is kept


def test_cpu_threading_env_sets_the_spin_count_unless_told_to_keep_libgomps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_threading_env(0, 10_000) == {CPU_RESERVED_CORES_ENV: "0",
                                            OMP_SPIN_COUNT_ENV: "10000"}
    monkeypatch.setenv(OMP_SPIN_COUNT_ENV, "5")  # both restored after the test
    monkeypatch.setenv(CPU_RESERVED_CORES_ENV, "0")
    set_cpu_threading(1, -1)
    assert OMP_SPIN_COUNT_ENV not in os.environ and os.environ[CPU_RESERVED_CORES_ENV] == "1"
    set_cpu_threading(0, 300)
    assert os.environ[OMP_SPIN_COUNT_ENV] == "300"


def test_every_commands_help_renders() -> None:
    """argparse formats help texts with %: a literal one in an option's text broke `serve
    --help` once."""
    pending = [build_parser()]
    seen = 0
    while pending:
        parser = pending.pop()
        assert parser.format_help()
        seen += 1
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    assert seen > 5  # serve, profile, batch, bench and their subcommands


def test_the_command_line_beats_the_environment(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """ANTIPHON_DATA_DIR, ANTIPHON_MODEL and ANTIPHON_API_KEYS count only where the command
    line says nothing: a restore onto `--data-dir DEST` under a unit that sets the variable
    served the old folder."""
    from antiphon.cli import serve_config

    monkeypatch.setenv("ANTIPHON_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("ANTIPHON_MODEL", "/models/from-env")
    monkeypatch.setenv("ANTIPHON_API_KEYS", "env-key-123456")
    given = serve_config(build_parser().parse_args([
        "serve", "--data-dir", str(tmp_path / "from-flag"), "--model", "/models/from-flag",
        "--api-keys", "flag-key-123456"]))
    assert given.sessions.data_dir == tmp_path / "from-flag"
    assert given.tiering.ssd_dir == tmp_path / "from-flag" / "kv"
    assert given.engine.model == "/models/from-flag"
    assert given.server.api_keys == ("flag-key-123456",)
    unset = serve_config(build_parser().parse_args(["serve"]))
    assert unset.sessions.data_dir == tmp_path / "from-env"
    assert unset.engine.model == "/models/from-env"
    assert unset.server.api_keys == ("env-key-123456",)


@pytest.mark.parametrize("flags", [
    ["--kv-cache-gib", "nan"], ["--kv-cache-gib", "inf"], ["--rt-ttft-slo-s", "nan"],
    ["--rt-tpot-slo-s", "inf"], ["--advisory-ttl-s", "nan"], ["--host-tier-bytes", "0"],
    ["--host-tier-bytes", "99999999999999999999"], ["--seed", "-1"], ["--seed", "4294967296"],
    ["--kv-cache-gib", "1e-12"], ["--step-trace", "/tmp"], ["--host-tier-bytes", "2048"],
    ["--ssd-tier-bytes", "32768"],
    # accepted, they overflowed later: int() at start, SQLite at every request (a reply's
    # save failed, batches never ran), a C size (found by a review)
    ["--kv-cache-gib", "1e300"], ["--max-batch-concurrency", str(2**63)],
    ["--kv-chains-kept", str(2**63)], ["--max-sessions-listed", str(2**63 - 1)],
    ["--advisories-kept", "0"], ["--advisories-kept", str(2**63)],
    ["--dashboard-history", str(2**63)], ["--ssd-tier-bytes", str(2**63)]])
def test_serve_refuses_settings_that_would_fail_in_the_engine(
        tmp_path: Path, flags: list[str]) -> None:
    """Refused with the flag's name before the model loads (they failed in the engine after
    it had, with tracebacks, or left the data folder half written)."""
    from antiphon.cli import serve_config

    with pytest.raises(ValueError, match=flags[0].removeprefix("--").replace("-", "_")):
        serve_config(build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *flags]))
    assert list(tmp_path.iterdir()) == []
    serve_config(build_parser().parse_args(  # without the connector it needs no host tier
        ["serve", "--data-dir", str(tmp_path), "--host-tier-bytes", "0", "--no-kv-tiering"]))


def test_a_max_model_len_past_the_models_own_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM refused it only once the port was bound and the engine half started, in a
    50-line traceback (found by a review); a model with rope scaling is left to vLLM."""
    from antiphon.model import check_max_model_len

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    check_max_model_len(tmp_path, 8192)
    with pytest.raises(ValueError, match="max_model_len 8193 is longer than the model takes"):
        check_max_model_len(tmp_path, 8193)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192,
                                                      "rope_scaling": {"factor": 4.0}}))
    check_max_model_len(tmp_path, 20000)


def test_serve_refuses_an_ssd_dir_that_is_the_data_folder(tmp_path: Path) -> None:
    # Both lock `.lock` in their folder: the server waited 15 s on its own lock, then said
    # another server's SSD tier held it (found by a review).
    from antiphon.cli import serve_config

    with pytest.raises(ValueError, match=r"ssd_dir .* is the data folder"):
        serve_config(build_parser().parse_args(
            ["serve", "--data-dir", str(tmp_path), "--ssd-dir", str(tmp_path / ".")]))
    # nor in its batch files' folder, whose start-up sweep deleted the tier's file and lock
    for inside in ("files", "files/kv"):
        with pytest.raises(ValueError, match=r"ssd_dir .* is in the batch files' folder"):
            serve_config(build_parser().parse_args(
                ["serve", "--data-dir", str(tmp_path), "--ssd-dir", str(tmp_path / inside)]))


def test_folders_named_in_the_environment_are_expanded_and_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~` no shell expanded (a systemd unit's Environment=) stayed a folder named `~` under
    the working directory: cost-model fits went there, the model elsewhere."""
    from antiphon import env

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANTIPHON_CACHE_DIR", "~/cache")
    assert env.cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("ANTIPHON_DATA_DIR", "~/data")
    assert env.data_dir() == tmp_path / "data"
    monkeypatch.delenv("ANTIPHON_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # invalid, the XDG spec says: ignored
    assert env.cache_dir() == tmp_path / ".cache" / "antiphon"


def test_small_cli_mistakes_are_refused_at_once(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from antiphon.cli import main
    from antiphon.private import private_dir

    # --out into no folder: said before minutes of profiling, not as a traceback after them
    assert main(["profile", "--quick", "--out", str(tmp_path / "no" / "fit.json")]) == 2
    assert "no folder" in capsys.readouterr().err
    # --out naming a folder: it passed the check, and the report's write failed after the
    # profile, as a traceback (the fit stored, and not said)
    assert main(["profile", "--quick", "--out", str(tmp_path)]) == 2
    assert "it is a folder" in capsys.readouterr().err
    from antiphon.profile_cli import _unwritable
    assert _unwritable(tmp_path / "fit.json") is None
    assert not (tmp_path / "fit.json").exists()  # (the check leaves nothing behind)
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")  # a link to no file yet
    assert _unwritable(tmp_path / "link.json") is None
    assert (tmp_path / "link.json").is_symlink() and not (tmp_path / "target.json").exists()
    # options profiling would ignore (it runs FCFS, and makes the fit) are not taken (they
    # were listed, "--cost-model (default: 'stored')", and did nothing: found by a review)
    for flags in (["--policy", "hygen"], ["--cost-model", "auto"], ["--rt-ttft-slo-s", "0.2"]):
        with pytest.raises(SystemExit) as refused:
            main(["profile", "--quick", *flags])
        assert refused.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    for flags in (["--poll-interval", "-1"], ["--max-unreachable-s", "nan"]):
        with pytest.raises(SystemExit) as refused:
            main(["batch", "status", "batch_x", "--wait", *flags])
        assert refused.value.code == 2 and "positive and finite" in capsys.readouterr().err
    a_file = tmp_path / "data"
    a_file.touch()
    with pytest.raises(NotADirectoryError):
        private_dir(a_file)


def test_serve_on_a_port_in_use_fails_before_the_engine_starts(tmp_path: Path) -> None:
    """Said at once with status 2 (it was said after the model had loaded, about 30 s, and a
    supervisor restarting it loaded the model again each time)."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "antiphon", "serve", "--port", str(port), "--data-dir",
             str(tmp_path / "data"), "--cost-model", "online", "--enforce-eager"],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert not (tmp_path / "data").exists()  # nothing written, nothing loaded
    assert time.monotonic() - started < 60


def test_the_batch_cli_names_the_server_it_cannot_reach(
        capsys: pytest.CaptureFixture[str]) -> None:
    from antiphon.cli import main

    assert main(["batch", "status", "batch_x", "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:9" in err and "--url" in err


def test_serve_names_a_bad_setting_by_its_option(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The operator typed `--max-frame-bytes 0`; the refusal said `max_frame_bytes`."""
    from antiphon.cli import main

    assert main(["serve", "--data-dir", str(tmp_path), "--max-frame-bytes", "0"]) == 2
    said = capsys.readouterr().err
    assert "--max-frame-bytes must be at least 1" in said and "max_frame_bytes" not in said
    assert main(["serve", "--data-dir", str(tmp_path), "--default-max-tokens", "50",
                 "--max-tokens-limit", "10"]) == 2
    assert "--default-max-tokens (50) must not exceed --max-tokens-limit (10)" in (
        capsys.readouterr().err)
    from antiphon.cli import build_parser, named_as_options

    args = build_parser().parse_args(["serve"])
    assert named_as_options("/srv/data_dir/x and ./data_dir: data_dir", args) == (
        "/srv/data_dir/x and ./data_dir: --data-dir")  # a path's names stay as they are


@pytest.mark.parametrize("key", ["tenant-key-1 ", " tenant-key-1", "tenant-key-1\n",
                                 "tenant\tkey-1", "clé-secrète-1", "tenant-key\x00-1"])
def test_a_key_no_authorization_header_can_carry_is_refused(key: str) -> None:
    """The server strips the Bearer value it reads, and reads a header as Latin-1 where a key
    is hashed as UTF-8: such a key was accepted, and then could never authenticate."""
    for keys in ({"api_keys": (key,)}, {"best_effort_api_keys": (key,)}):
        with pytest.raises(ValueError, match="Authorization header") as refused:
            ServerConfig(**keys)  # type: ignore[arg-type]
        assert key not in str(refused.value)  # a secret: named by its place only
    spaced = "tenant key 1"  # spaces inside are carried, and the value read keeps them
    auth = Authenticator(ServerConfig(api_keys=(spaced,)).accepted_api_keys)
    assert auth.owner_for(key_from_headers(f"Bearer {spaced}")) == auth.fingerprint(spaced)


def test_a_port_another_starting_server_has_bound_is_refused_at_once() -> None:
    """Bound but not listening while its model loads, a `serve` left the port open to a
    second one (SO_REUSEADDR lets sockets not listening share it), and the one that listened
    second served nothing, its engine up, silently."""
    import socket

    from antiphon.cli import bind_listener

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = bind_listener("127.0.0.1", port)  # a serve still loading its model
    try:
        with pytest.raises(OSError):
            bind_listener("127.0.0.1", port).close()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # (a client that connects meanwhile waits to be served)
    finally:
        first.close()
