"""`moe-mesh` command line: split, expert, core, gateway, up, status, and the cluster tools."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

# moe-mesh never runs PyTorch, but transformers (which mlx-lm imports) imports it wherever it is
# installed: seconds of start-up per process on a CUDA machine, and Hugging Face's torch-backed
# image processors in place of the NumPy ones moe-mesh is tested with. MOE_MESH_ALLOW_TORCH=1
# keeps it importable, for a model whose own tokenizer or processor code needs it.
if os.environ.get("MOE_MESH_ALLOW_TORCH") != "1":
    sys.modules.setdefault("torch", None)  # importlib then finds no torch: transformers skips it

from services.common.cli_types import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from services.gateway.cli_flags import add_gateway_flags, gateway_pass_args


def _split(args) -> None:
    from services.common.model_source import resolve_model
    from services.tools.split import split_checkpoint

    manifest = split_checkpoint(resolve_model(args.model), Path(args.out), progress=not args.quiet)
    print(
        f"{args.out}: {len(manifest.layers)} MoE layers x {manifest.num_experts} experts, fingerprint {manifest.fingerprint}"
    )


def _expert(args) -> None:
    from services.common.frames import spin_seconds
    from services.experts.cli_flags import compute_kwargs, streaming_kwargs
    from services.experts.server import run_expert_worker
    from services.ops.cluster_roles import expert_kwargs

    # cluster.toml settings (expert_kwargs) win over the streaming flags' defaults.
    kwargs = {**streaming_kwargs(args), **compute_kwargs(args), **expert_kwargs(args)}
    run_expert_worker(**kwargs, frame_spin_s=spin_seconds(args.frame_spin_us), distributed=args.distributed)


def _core(args) -> None:
    from services.common.frames import spin_seconds
    from services.core.engine import EngineConfig
    from services.core.kv.cli_flags import kv_engine_kwargs
    from services.core.server import run_core
    from services.core.speculative import speculative_config
    from services.ops.cluster_roles import core_kwargs

    cluster_kwargs = core_kwargs(args)  # fills options left at their defaults from --config
    run_core(
        **cluster_kwargs,
        expert_frames=not args.no_expert_frames,
        frame_spin_s=spin_seconds(args.frame_spin_us),
        expert_overlap={"auto": None, "on": True, "off": False}[args.expert_overlap],
        dense_kernel=args.dense_kernel,
        distributed=args.distributed,
        served_model_names=args.served_model_name or (),
        quiet=args.quiet,
        drain_s=args.drain_s,
        mlx_cache_bytes=int(args.mlx_cache_gb * (1 << 30)),
        engine_config=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_queue=args.max_queue,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_step_seconds=args.max_step_seconds,
            prefix_cache_bytes=int(args.prefix_cache_gb * (1 << 30)),
            image_cache_bytes=int(args.image_cache_gb * (1 << 30)),
            max_model_len=args.max_model_len,
            micro_batches=args.micro_batches,
            burst_gather_s=args.burst_gather_ms / 1000,
            speculative=speculative_config(
                args.speculative, args.num_speculative_tokens, args.speculative_config
            ),
            **kv_engine_kwargs(args),
        ),
    )


def _gateway(args) -> None:
    from services.gateway.auth import load_api_keys
    from services.gateway.server import run_gateway
    from services.ops.cluster_roles import gateway_kwargs

    keys = load_api_keys(args.api_key or (), args.api_key_file)
    if args.protect_metrics and not keys:
        raise ValueError("--protect-metrics needs API keys (--api-key, --api-key-file or MOE_MESH_API_KEY)")
    run_gateway(
        **gateway_kwargs(args),
        api_keys=keys,
        protect_metrics=args.protect_metrics,
        allowed_origins=args.allowed_origins,
        max_connections=args.max_connections,
        request_memory_mb=args.max_request_memory_mb,
        allow_image_urls=args.allow_image_urls,
        allow_private_image_urls=args.allow_private_image_urls,
    )


def _up(args) -> None:
    from services.core.kv.cli_flags import kv_cli_args
    from services.core.speculative import speculative_config
    from services.ops.up import run_up

    speculative_config(args.speculative, args.num_speculative_tokens, args.speculative_config)  # refuse early
    if args.speculative and args.speculative.startswith("draft:"):  # core may start elsewhere
        path = Path(args.speculative[len("draft:") :]).expanduser()
        if path.exists():
            args.speculative = f"draft:{path.resolve()}"

    sys.exit(
        run_up(
            model=args.model,
            experts=args.experts,
            port=args.port,
            host=args.host,
            workdir=args.workdir,
            gateway_args=gateway_pass_args(args),
            expert_memory_gb=args.expert_memory_gb,
            core_args=[*kv_cli_args(args), *_serving_cli_args(args)],
            frame_spin_us=args.frame_spin_us,
            log_level=args.log_level,
            local_experts=args.local_experts,
            distributed=args.distributed,
            model_name=(args.served_model_name or [None])[0],
            log_format=args.log_format,
            replicas=args.replicas,
            mlx_cache_gb=args.mlx_cache_gb,
            mps=args.mps,
        )
    )


SERVING_FLAGS = (
    "quiet",
    "max_num_seqs",
    "max_queue",
    "max_num_batched_tokens",
    "max_step_seconds",
    "micro_batches",
    "burst_gather_ms",
    "prefix_cache_gb",
    "image_cache_gb",
    "mlx_cache_gb",
    "max_model_len",
    "served_model_name",
    "speculative",
    "num_speculative_tokens",
    "speculative_config",
)


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """Core's batching and cache flags, on `core` and passed through by `up`."""
    from services.ops.cluster import CoreConfig

    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="sequences decoding at once")
    p.add_argument(
        "--max-queue", type=non_negative_int, default=256, help="requests waiting beyond those (then 429)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=512,
        help="tokens computed per step: one per decoding sequence plus the prefill chunk",
    )
    p.add_argument(
        "--max-step-seconds",
        type=non_negative_float,
        default=1.0,
        help="while sequences decode, cut the prefill chunk to what fits this step time (0: tokens only)",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int,
        default=CoreConfig.micro_batches,
        help="batches the running sequences are split into; with 2, one batch's attention runs "
        "while the other's experts compute on the workers (ping-pong)",
    )
    p.add_argument(
        "--burst-gather-ms",
        type=non_negative_float,
        default=CoreConfig.burst_gather_ms,
        help="from idle, keep admitting requests that arrive this close together before the first "
        "prefill, so a burst shares one step (0: start at the first request)",
    )
    p.add_argument(
        "--prefix-cache-gb",
        type=non_negative_float,
        default=1.0,
        help="byte budget of the prefix cache (0 = off)",
    )
    p.add_argument(
        "--image-cache-gb",
        type=non_negative_float,
        default=1.0,
        help="byte budget of what core keeps per image, for models that take images: the vision tower's "
        "outputs, and an eighth for the processor's (0 = off)",
    )
    p.add_argument(
        "--mlx-cache-gb",
        type=non_negative_float,
        default=CoreConfig.mlx_cache_gb,
        help="GB of freed buffers MLX keeps for reuse: core's memory is its weights, KV and prefix cache, and this",
    )
    p.add_argument("--quiet", action="store_true", help="no stats line every 10 s while busy")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in requests and replies, then aliases (default: the checkpoint's folder name)",
    )
    p.add_argument(
        "--speculative",
        metavar="METHOD",
        default=None,
        help="draft tokens and verify them in one step: 'ngram' (prompt lookup), 'draft:PATH' (a small "
        "model), 'mtp' (the checkpoint's multi-token-prediction layers); default off",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        help="most tokens a sequence drafts per step, with --speculative (default 4)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="tokens a request's prompt and output may fill (default: the model's context)",
    )


def _serving_cli_args(args) -> list[str]:
    """`up`'s serving flags as core's command line (those left unset stay unset)."""
    out = []
    for name in SERVING_FLAGS:
        value = getattr(args, name)
        if isinstance(value, bool):  # a switch: passed on when set
            out += [f"--{name.replace('_', '-')}"] if value else []
        elif value is not None:
            values = value if isinstance(value, list) else [value]
            out += [f"--{name.replace('_', '-')}", *map(str, values)]
    return out


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help names its default, unless it has none or its text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (
            not text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


class _ArgvRecordingParser(argparse.ArgumentParser):
    """Keeps the argument list on the namespace, so cluster.toml settings can yield to the flags a
    user actually typed, even when they typed a flag's default value."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.argv = list(sys.argv[1:] if args is None else args)
        return parsed, rest


def build_parser() -> argparse.ArgumentParser:
    from services.common.data_plane_flag import add_data_plane_flag
    from services.common.frames import add_spin_flag
    from services.common.logging import LOG_FORMATS
    from services.common.version import moe_mesh_version
    from services.core.kv.cli_flags import add_kv_cache_flags
    from services.experts.cli_flags import add_compute_flags, add_streaming_flags
    from services.ops.cluster_roles import add_cluster_flags
    from services.ops.cluster_tools import add_cluster_commands
    from services.ops.status_cli import add_status_command
    from services.ops.storage_cli import add_storage_commands

    parser = _ArgvRecordingParser(
        prog="moe-mesh", description="Serve huge MoE models as a core plus expert workers."
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least level logged",
    )
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="auto: readable on a terminal, JSON lines otherwise",
    )
    parser.add_argument("--version", action="version", version=f"moe-mesh {moe_mesh_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "split", help="split an mlx-lm MoE checkpoint into core weights and expert layer files"
    )
    p.add_argument("model", help="checkpoint folder (config.json + *.safetensors) or Hugging Face repo id")
    p.add_argument("out", help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_split)

    p = sub.add_parser("expert", help="serve a shard of the routed experts")
    p.add_argument("--split", default=None, help="split folder (from `moe-mesh split`)")
    p.add_argument("--listen", default="127.0.0.1:50061", help="host:port or unix:/path.sock")
    p.add_argument("--layers", default=None, help="MoE layers to serve, e.g. 0-23 (default: all)")
    p.add_argument("--experts", default=None, help="experts of each layer to serve, e.g. 0-63 (default: all)")
    p.add_argument(
        "--worker-id",
        default=None,
        help="name in Describe and logs (default: the --name in --config, else host:pid)",
    )
    p.add_argument("--name", default=None, help="this worker's name in --config")
    add_cluster_flags(p)
    add_streaming_flags(p)
    add_compute_flags(p)
    add_spin_flag(p)
    add_data_plane_flag(p, "join core's")
    p.set_defaults(func=_expert, parser=p)

    p = sub.add_parser("core", help="serve the Core gRPC API over the expert workers")
    p.add_argument("--split", default=None, help="split folder (from `moe-mesh split`)")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port or unix:/path.sock")
    p.add_argument(
        "--worker",
        action="append",
        default=None,
        help="expert worker address (repeat or comma-separate); `local`: compute every expert in "
        "core's own process",
    )
    p.add_argument(
        "--local-memory-gb",
        type=positive_float,
        default=None,
        help="RAM budget of the local worker's experts; the rest stream from disk (default: all resident)",
    )
    _add_serving_flags(p)
    add_kv_cache_flags(p)
    p.add_argument(
        "--expert-timeout", type=positive_float, default=60.0, help="seconds a layer call may take"
    )
    p.add_argument(
        "--no-expert-frames",
        action="store_true",
        help="send layer calls to same-host workers over their gRPC streams, not their frame sockets",
    )
    p.add_argument(
        "--expert-overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="build the next layer while a layer's experts compute (auto: on the CPU, off on GPUs)",
    )
    p.add_argument(
        "--dense-kernel",
        choices=["auto", "mlx"],
        default="auto",
        help="quantized projections (attention, shared experts, lm_head at decode) on the CPU: "
        "auto = moe-mesh's C kernel where MLX runs on the CPU, mlx = MLX's own op",
    )
    p.add_argument(
        "--drain-s",
        type=non_negative_float,
        default=1.0,
        help="on SIGTERM, seconds health says NOT_SERVING before new requests are refused, so "
        "health checkers and gateways move away (0 when nothing watches core)",
    )
    add_spin_flag(p)
    add_data_plane_flag(p, "form")
    add_cluster_flags(p)
    p.set_defaults(func=_core, parser=p)

    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API in front of core")
    p.add_argument("--core", default="127.0.0.1:50051", help="core address")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    p.add_argument("--port", type=port_number, default=8000, help="port the HTTP API listens on")
    add_cluster_flags(p, metrics=False, serves_grpc=False)
    add_gateway_flags(p)
    p.set_defaults(func=_gateway, parser=p)

    p = sub.add_parser(
        "up",
        help="start workers, core and gateway on this machine",
        epilog="The demo model and the splits of checkpoints given with --model are built once into "
        "$MOE_MESH_CACHE (default ~/.cache/moe-mesh); set it where HOME is not writable.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint or split folder, or Hugging Face repo id (default: the demo model)",
    )
    p.add_argument("--experts", type=positive_int, default=2, help="number of expert workers")
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="workers holding each expert: with 2, any one worker may die without failing a request",
    )
    p.add_argument(
        "--local-experts",
        action="store_true",
        help="no worker processes: core computes every expert in its own process and graph",
    )
    p.add_argument("--port", type=port_number, default=8000, help="gateway port")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument(
        "--workdir",
        default=None,
        help="where sockets and logs go (default: sockets in a temp folder, logs in "
        "$MOE_MESH_CACHE/logs/<start time>, the last 20 runs kept)",
    )
    p.add_argument(
        "--expert-memory-gb",
        type=positive_float,
        default=None,
        help="each worker's expert RAM budget (default: all)",
    )
    p.add_argument(
        "--mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the services as clients of an NVIDIA MPS daemon of their own, so core and the "
        "workers stop switching GPU contexts at every layer call (auto: on NVIDIA GPUs when "
        "worker processes share them)",
    )
    _add_serving_flags(p)
    add_kv_cache_flags(p)
    add_gateway_flags(p)
    add_spin_flag(p)
    add_data_plane_flag(p, "core and the workers form")
    p.set_defaults(func=_up)
    add_cluster_commands(sub)  # certs, deploy, cluster check
    add_status_command(sub)
    add_storage_commands(sub)  # iobench, plan
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from services.common.logging import configure_logging
    from services.common.manifest import ManifestError
    from services.common.tls import TlsError
    from services.experts.store import ExpertFileError

    configure_logging(args.command, args.log_level, args.log_format)
    if args.command in ("split", "up"):
        # SIGTERM ends a build (a split, the demo model) as Ctrl-C does: its cleanup runs and no
        # half-written folder stays (`up` installs its own handlers once it starts the services).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        args.func(args)
    except (ManifestError, ExpertFileError, TlsError, ValueError, OSError) as error:
        # Bad flags, an unsupported model (a ValueError), a missing or damaged split, a port in
        # use: one line, no traceback.
        raise SystemExit(f"moe-mesh {args.command}: {error}") from None
    except KeyboardInterrupt:
        print(f"moe-mesh {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
