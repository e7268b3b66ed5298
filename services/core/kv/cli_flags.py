"""The `--kv-cache` launch flags shared by `moe-mesh core` and `moe-mesh up`."""

from __future__ import annotations

import argparse

from services.core.kv.settings import KV_CACHE_KINDS, KVCacheSettings

_DEFAULT = KVCacheSettings()


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache")
    group.add_argument(
        "--kv-cache",
        choices=KV_CACHE_KINDS,
        default="fp16",
        help="KV cache of requests that do not choose one (turboquant: ~3.5-4x smaller)",
    )
    for part, bits in (("key", _DEFAULT.key_bits), ("value", _DEFAULT.value_bits)):
        group.add_argument(
            f"--kv-{part}-bits",
            type=int,
            choices=(2, 3, 4),
            default=bits,
            help=f"Lloyd-Max bits per {part} coordinate (default {bits})",
        )
    qjl = group.add_mutually_exclusive_group()
    qjl.add_argument(
        "--kv-qjl",
        dest="kv_qjl",
        action="store_true",
        default=_DEFAULT.key_qjl,
        help="keys with the 1-bit QJL residual stage (the paper's K3+QJL: --kv-key-bits 3 --kv-qjl)"
        + (" (default)" if _DEFAULT.key_qjl else ""),
    )
    without = "keys without it" + ("" if _DEFAULT.key_qjl else " (default)")
    qjl.add_argument("--kv-no-qjl", dest="kv_qjl", action="store_false", help=without)
    group.add_argument(
        "--kv-center-keys",
        action="store_true",
        help="quantize keys minus their mean (halves the key error; helps small windows)",
    )
    group.add_argument(
        "--kv-recent-window",
        type=int,
        default=_DEFAULT.recent_window,
        help=f"newest tokens kept exact; older ones are compressed (default {_DEFAULT.recent_window})",
    )


def kv_settings_from_args(args: argparse.Namespace) -> KVCacheSettings:
    if args.kv_recent_window < 0:
        raise SystemExit(f"--kv-recent-window must be >= 0, got {args.kv_recent_window}")
    return KVCacheSettings(
        key_bits=args.kv_key_bits,
        value_bits=args.kv_value_bits,
        key_qjl=args.kv_qjl,
        center_keys=args.kv_center_keys,
        recent_window=args.kv_recent_window,
    )


def kv_engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig(kv_cache=..., kv_settings=...) from parsed flags."""
    return {"kv_cache": args.kv_cache, "kv_settings": kv_settings_from_args(args)}


def kv_cli_args(args: argparse.Namespace) -> list[str]:
    """The same choice as flags for a child `moe-mesh core` (used by `moe-mesh up`)."""
    out = ["--kv-cache", args.kv_cache, "--kv-key-bits", str(args.kv_key_bits)]
    out += ["--kv-value-bits", str(args.kv_value_bits), "--kv-recent-window", str(args.kv_recent_window)]
    out += ["--kv-qjl"] if args.kv_qjl else ["--kv-no-qjl"]
    return out + (["--kv-center-keys"] if args.kv_center_keys else [])
