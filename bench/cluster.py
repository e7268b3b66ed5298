"""Decode speed with expert workers on other hosts vs on this one, in one run.

    sudo python bench/cluster.py                  # demo model, 2 workers, 32 tokens
    sudo python bench/cluster.py --tokens 64 --delay-ms 0.25,1,2

Variants (same split, same prompt, greedy; tokens must be identical across all of them):
- `unix`: core and workers on this host over Unix sockets (what `moe-mesh up` does);
- `loopback_tcp`: the same over 127.0.0.1 TCP;
- `netns_tcp`: core and each worker in its own network namespace, linked by veth pairs, each
  worker on its own address: real separate network stacks, as between Macs;
- `netns_delay_<d>ms`: the same plus d ms of latency each way on every core<->worker link, for
  each d of `--delay-ms`, with `tc netem` when the kernel has it; otherwise through a userspace
  relay (bench/delay_relay.py), in which case `netns_relay0` (the relay with no delay) is
  measured too and is the baseline of the delay curve. The curve also gives the tok/s predicted
  if every MoE layer simply waited one extra round trip (2 x d x layers per token).
Every variant's processes are started first and kept up; decode rounds then interleave over the
variants and the best round of each is kept (this box is shared and noisy). Per variant: decode
tok/s over the decode steps and core's per-layer expert call p50/p99 (total, and transport =
total - worker time). Needs root for the namespaces; without it only the
single-host variants run and the JSON says why. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import timed_decode
from bench.workdir import bench_workdir
from services.common.manifest import Manifest
from services.ops.up import expert_ranges, resolve_split
from tests.cluster.netns import NetnsLab, netns_unavailable
from tests.helpers import spawn, stop, wait_serving

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKER_PORT = 50061
RELAY_BASE_PORT = 56000


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode(core_address: str, prompt: list[int], tokens: int) -> dict:
    out, stamps, calls = timed_decode(core_address, prompt, tokens)
    return {
        "tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 3),
        "layer_call_us": {
            "total_p50": round(calls.total_p50_us),
            "total_p99": round(calls.total_p99_us),
            "transport_p50": round(calls.transport_p50_us),
            "transport_p99": round(calls.transport_p99_us),
            "calls": calls.calls,
        },
        "tokens": out,
    }


class Stack:
    """Processes of all variants, started once and kept up, so decode rounds can interleave."""

    def __init__(self, split: Path, workdir: Path, ranges: list[str]):
        self.split, self.workdir, self.ranges = split, workdir, ranges
        self.procs: list = []
        self.waits: list = []  # (check) callables run before measuring
        self.cores: dict[str, str] = {}  # variant -> core address

    def workers_here(self, tag: str, tcp: bool) -> list[str]:
        addresses = []
        for i, span in enumerate(self.ranges):
            address = f"127.0.0.1:{free_port()}" if tcp else f"unix:{self.workdir / f'{tag}-w{i}.sock'}"
            path = self.workdir / f"{tag}-w{i}.log"
            proc = spawn(["expert", "--split", str(self.split), "--listen", address, "--experts", span], path)
            self.procs.append(proc)
            self.waits.append(
                lambda a=address, p=proc, lp=path: wait_serving(a, p, timeout_s=600, log_path=lp)
            )
            addresses.append(address)
        return addresses

    def workers_in(self, lab: NetnsLab, tag: str) -> list[str]:
        for i, span in enumerate(self.ranges):
            path = self.workdir / f"{tag}-w{i}.log"
            listen = f"{lab.worker_ip(i)}:{WORKER_PORT}"
            args = ["expert", "--split", str(self.split), "--listen", listen, "--experts", span]
            proc = lab.spawn(lab.worker_ns[i], args, path)
            self.procs.append(proc)
            self.waits.append(
                lambda i=i, p=proc, lp=path: lab.wait_port(
                    lab.worker_ns[i], lab.worker_ip(i), WORKER_PORT, p, lp, timeout_s=600
                )
            )
        return [f"{lab.worker_ip(i)}:{WORKER_PORT}" for i in range(len(self.ranges))]

    def relays(self, lab: NetnsLab, targets: list[str], delay_ms: float, base_port: int) -> list[str]:
        """Userspace delay relays in core's namespace in front of `targets`."""
        script = str(Path(__file__).with_name("delay_relay.py"))
        out = []
        for i, target in enumerate(targets):
            listen = f"127.0.0.1:{base_port + i}"
            self.procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", lab.core_ns, sys.executable, script, "--listen", listen]
                    + ["--target", target, "--delay-ms", str(delay_ms)]
                )
            )
            out.append(listen)
        return out

    def core(self, variant: str, workers: list[str], lab: NetnsLab | None = None) -> None:
        address, path = f"unix:{self.workdir / f'{variant}-core.sock'}", self.workdir / f"{variant}-core.log"
        args = ["core", "--split", str(self.split), "--listen", address, "--worker", ",".join(workers)]
        proc = lab.spawn(lab.core_ns, args, path) if lab else spawn(args, path)
        self.procs.append(proc)
        self.waits.append(lambda: wait_serving(address, proc, timeout_s=900, log_path=path))
        self.cores[variant] = address

    def wait(self) -> None:
        for check in self.waits:
            check()

    def stop(self) -> None:
        stop(self.procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint or split (default: the demo model)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--delay-ms", default="1", help="link delays to measure, e.g. 0.25,1,2 (ms each way)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    split = resolve_split(args.model)
    manifest = Manifest.load(split)
    ranges = expert_ranges(manifest.num_experts, args.workers)
    from services.core.model_loader import load_core_tokenizer

    prompt = load_core_tokenizer(split, manifest).encode(PROMPT)
    workdir = bench_workdir("mm-bench-")
    result: dict = {
        "bench": "cluster",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "model": manifest.model_type,
        "split": split.name,
        "moe_layers": len(manifest.layers),
        "workers": args.workers,
        "decode_tokens": args.tokens,
        "variants": {},
    }
    variants = result["variants"]
    stack = Stack(split, workdir, ranges)
    labs: list[NetnsLab] = []
    try:
        stack.core("unix", stack.workers_here("unix", tcp=False))
        stack.core("loopback_tcp", stack.workers_here("tcp", tcp=True))
        reason = netns_unavailable()
        if reason:
            result["netns_skipped"] = reason
        else:
            lab = NetnsLab(workers=args.workers, subnet=77).__enter__()
            labs.append(lab)
            direct = stack.workers_in(lab, "netns")
            stack.core("netns_tcp", direct, lab)
            delays = [float(d) for d in args.delay_ms.split(",")]
            probe = NetnsLab(workers=1, subnet=79).__enter__()
            labs.append(probe)
            if probe.add_delay(delays[0]):  # netem: one lab (namespaces + veths) per delay
                result["delay_method"] = "tc netem, each way on every veth"
                for index, delay in enumerate(delays):
                    delayed = NetnsLab(workers=args.workers, subnet=80 + index).__enter__()
                    labs.append(delayed)
                    delayed.add_delay(delay)
                    stack.core(
                        f"netns_delay_{delay:g}ms", stack.workers_in(delayed, f"netem{index}"), delayed
                    )
            else:
                result["delay_method"] = (
                    "userspace relay, each way (this kernel has no sch_netem): compare "
                    "netns_delay_*ms with netns_relay0, the same relay without delay"
                )
                stack.core("netns_relay0", stack.relays(lab, direct, 0.0, RELAY_BASE_PORT), lab)
                for index, delay in enumerate(delays):
                    relays = stack.relays(lab, direct, delay, RELAY_BASE_PORT + 100 * (index + 1))
                    stack.core(f"netns_delay_{delay:g}ms", relays, lab)
        log(f"starting {len(stack.cores)} variants: {', '.join(stack.cores)}")
        stack.wait()
        for round_ in range(args.rounds):  # interleaved; best round per variant (a noisy shared box)
            for name, address in stack.cores.items():
                log(f"round {round_ + 1}/{args.rounds}: {name}")
                run = decode(address, prompt, args.tokens)
                if name not in variants or run["tok_s"] > variants[name]["tok_s"]:
                    variants[name] = run
    finally:
        stack.stop()
        for lab in labs:
            lab.close()
    shutil.rmtree(workdir, ignore_errors=True)  # kept (logs) only when a variant failed
    reference = variants["unix"]["tokens"]
    result["tokens_identical"] = all(v["tokens"] == reference for v in variants.values())
    for v in variants.values():
        del v["tokens"]
    base = variants["unix"]["tok_s"]
    result["tok_s_vs_unix"] = {name: round(v["tok_s"] / base, 3) for name, v in variants.items()}
    undelayed = variants.get("netns_relay0", variants.get("netns_tcp"))
    curve = []
    for name, v in variants.items():
        if name.startswith("netns_delay_"):
            delay_ms = float(name.removeprefix("netns_delay_").removesuffix("ms"))
            # Every MoE layer waits one round trip per token: 2 x delay x layers on top of the
            # undelayed token time, if nothing overlaps.
            predicted = 1 / (1 / undelayed["tok_s"] + 2 * delay_ms / 1000 * len(manifest.layers))
            curve.append(
                {
                    "delay_ms_each_way": delay_ms,
                    "tok_s": v["tok_s"],
                    "vs_undelayed": round(v["tok_s"] / undelayed["tok_s"], 3),
                    "predicted_tok_s": round(predicted, 3),
                    "added_layer_call_p50_us": v["layer_call_us"]["total_p50"]
                    - undelayed["layer_call_us"]["total_p50"],
                }
            )
    if curve:
        result["delay_curve"] = sorted(curve, key=lambda row: row["delay_ms_each_way"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
