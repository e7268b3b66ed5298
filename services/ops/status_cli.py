"""`moe-mesh status [--url URL]`: the status page's picture as tables on a terminal, from the
gateway's `/status.json`. Exits 0 when core serves, 1 when it does not or cannot be reached."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


def render(status: dict) -> str:
    core = status["core"]
    out = [
        f"moe-mesh {status.get('version', '')}  model {status.get('model') or '-'}  core {core['state'].replace('_', ' ')} ({core['address']})"
    ]
    out += [f"  problem: {problem}" for problem in core["problems"]]
    capacity = core["kv_cache_capacity_bytes"]
    kv = _size(core["kv_cache_bytes"]) + (
        f" of {_size(capacity)} ({core['kv_cache_bytes'] / capacity:.1%})" if capacity else ""
    )
    prefix = core["prefix_cache"]
    out.append(
        f"requests: {core['running']} running, {core['waiting']} waiting   KV cache: {kv}   prefix cache: "
        f"{prefix['hits']}/{prefix['lookups']} hits ({_pct(prefix['hit_rate'])}), {prefix['entries']} entries, "
        f"{_size(prefix['bytes'])}"
    )
    rates = status.get("throughput") or []
    if rates:
        last, peak = rates[-1], max(r["generation_tok_s"] for r in rates)
        span = rates[-1]["t"] - rates[0]["t"]
        over = f"{span / 60:.0f} min" if span >= 120 else f"{span:.0f} s"
        out.append(
            f"throughput: generation {last['generation_tok_s']} tok/s now ({peak} peak over the last "
            f"{over}), prompt {last['prompt_tok_s']} tok/s"
        )
    out.append("")
    rows = [
        [
            "core",
            "",
            "up" if core["state"] != "unreachable" else "DOWN",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ]
    ]
    rows[0][1] = core["address"]
    rows.insert(0, ["gateway", status["gateway"]["address"], "up", *[""] * 10])
    for w in status["workers"]:
        budget = "all" if not w["memory_budget_bytes"] else _size(w["memory_budget_bytes"])
        rows.append(
            [
                w["name"], w["address"], "up" if w["up"] else "DOWN", w["layers"] or "?", w["experts"] or "?",
                str(w["min_replicas"]), _size(w["resident_bytes"]), budget, _pct(w["cache_hit_rate"]),
                f"{w['read_gbps']:.2f}", str(w["calls"]), str(w["errors"]), w["last_error"][:60],
            ]
        )  # fmt: skip
    headers = ["SERVICE", "ADDRESS", "STATE", "LAYERS", "EXPERTS", "REPLICAS", "RESIDENT", "BUDGET",
               "CACHE HITS", "SSD GB/s", "CALLS", "ERRORS", "LAST ERROR"]  # fmt: skip
    out.append(table(headers, rows))
    if status["layers"]:
        out.append("")
        layer_rows = [
            [str(e["layer"]), str(e["calls"]), f"{e['p50_us']:.0f}", f"{e['p99_us']:.0f}"]
            for e in status["layers"]
        ]
        out.append(table(["LAYER", "CALLS", "HOP P50 us", "HOP P99 us"], layer_rows))
    return "\n".join(out)


def fetch_status(url: str, api_key: str | None, timeout_s: float = 10.0) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/status.json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    # the URL is the operator's own gateway (http or https), given on the command line
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # nosec B310
        return json.load(reply)


def run_status(args: argparse.Namespace) -> int:
    from services.gateway.auth import API_KEY_ENV

    key = args.api_key or os.environ.get(API_KEY_ENV, "").split(",")[0].strip() or None
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, not {args.url!r}")
    try:
        status = fetch_status(args.url, key)
    except urllib.error.HTTPError as error:
        hint = " (give --api-key or set MOE_MESH_API_KEY)" if error.code == 401 else ""
        print(f"moe-mesh status: {args.url} answered {error.code}{hint}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as error:
        print(
            f"moe-mesh status: cannot reach the gateway at {args.url}: {getattr(error, 'reason', error)}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status["core"]["state"] == "serving" else 1


def add_status_command(sub) -> None:
    p = sub.add_parser("status", help="show the cluster's state (what the gateway's /status page shows)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's address")
    p.add_argument("--api-key", default=None, help="when the gateway has keys (default: MOE_MESH_API_KEY)")
    p.add_argument("--json", action="store_true", help="print /status.json as it came")
    p.set_defaults(func=lambda args: sys.exit(run_status(args)))
