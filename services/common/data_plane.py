"""The in-graph expert data plane's wire contract, shared by core and the workers.

Core (rank 0) and the expert workers (ranks 1..N) of one `mx.distributed` group exchange each
layer call as three `all_sum`s inside their graphs, so neither side synchronises per layer:

1. the header, int32 [HEADER_LEN]: (CALL or STOP, layer, tokens T, top-k, width H, dtype code),
   given by core, zeros from the workers;
2. the inputs, uint32 words: the states [T, H] as raw bits, then the expert ids [T, k] and the
   rank that computes each pair [T, k] (int32 bits), given by core, zeros from the workers;
3. the rows [T, k, H] in the states' dtype: each worker gives the rows of the pairs assigned to
   its rank and zeros elsewhere, core gives zeros, so the sum is every pair's row, bit-exact.

Adding zeros is exact in every dtype, so the exchange changes no number. Collectives run in the
order the graph's dependencies force, not program order: each exchange takes its input through
`mx.depends` on the previous one, on both sides (bench/collective_hop.py).

Group membership comes from MLX's own environment, as `mlx.launch` sets it (MLX_HOSTFILE and
MLX_RANK for ring, NCCL_HOST_IP/NCCL_PORT/MLX_RANK/MLX_WORLD_SIZE for nccl, MLX_IBV_DEVICES and
MLX_JACCL_COORDINATOR for jaccl); `moe-mesh up --distributed ring` sets it for one host.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from services.common.data_plane_flag import BACKENDS

CALL, STOP = 1, 2
HEADER_LEN = 6
DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # index = the header's dtype code
CORE_RANK = 0
GROUP_TIMEOUT_S = 30.0  # how long a member waits for the others to join
JOIN_RETRY_S = 0.5


class DataPlaneError(RuntimeError):
    """The group could not form, or lost a member."""


def join_group(
    backend: str,
    timeout_s: float = GROUP_TIMEOUT_S,
    on_joined: Callable[[mx.distributed.Group], None] | None = None,
) -> mx.distributed.Group:
    """This process's group, once every member has joined (a first collective completes, so
    each member takes part in the next); raises DataPlaneError when it does not form in
    `timeout_s`. Members start at different times, so a refused connection is tried again.
    MLX holds the interpreter while it connects: call it when the peers are about to join.
    `on_joined(group)` runs before that first collective (a worker then reports its rank)."""
    if backend not in BACKENDS:
        raise DataPlaneError(f"data plane backend must be one of {BACKENDS}, got {backend!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            group = mx.distributed.init(strict=True, backend=backend)
            break
        except (RuntimeError, ValueError) as error:
            if "connect" not in str(error).lower() or time.monotonic() > deadline:
                raise DataPlaneError(f"the {backend} data plane group did not form: {error}") from error
            time.sleep(JOIN_RETRY_S)
    if group.size() < 2:
        raise DataPlaneError(f"the {backend} data plane group has {group.size()} member: nobody to talk to")
    if on_joined is not None:
        on_joined(group)
    mx.eval(mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=group))
    return group


def abort_ring_sockets() -> int:
    """Shut down this process's TCP connections to the ring group's addresses (MLX_HOSTFILE).

    A ring whose member dies can leave the others blocked on live neighbours that wait in
    turn; a member that sees the loss shuts its connections down, so that those neighbours'
    pending collectives can fail too and they fall back. MLX keeps
    owning the descriptors (they are shut down, not closed). Returns how many it shut down."""
    ports = _ring_ports()
    count = 0
    for name in os.listdir("/dev/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            if sock.type == socket.SOCK_STREAM and _touches(sock, ports):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def _ring_ports() -> set[int]:
    try:
        hosts = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
    except (KeyError, OSError, ValueError):
        return set()
    return {int(address.rsplit(":", 1)[1]) for member in hosts for address in member}


def _touches(sock: socket.socket, ports: set[int]) -> bool:
    for read in (sock.getsockname, sock.getpeername):
        try:
            address = read()
        except OSError:
            continue
        if isinstance(address, tuple) and address[1] in ports:
            return True
    return False


def state_words(tokens: int, width: int, dtype: mx.Dtype) -> int:
    return tokens * width * dtype.size // 4


def packable(width: int, dtype: mx.Dtype) -> bool:
    """Whether states of this width and dtype fill whole uint32 words for every token count."""
    return dtype in DTYPES and (width * dtype.size) % 4 == 0


def pack_inputs(states: mx.array, ids: mx.array, ranks: mx.array) -> mx.array:
    """states [T, H], ids and ranks [T, k] int32 -> one uint32 vector (see the module docstring)."""
    return mx.concatenate(
        [
            states.reshape(-1).view(mx.uint32),
            ids.reshape(-1).view(mx.uint32),
            ranks.reshape(-1).view(mx.uint32),
        ]
    )


def unpack_inputs(words: mx.array, tokens: int, top_k: int, width: int, dtype: mx.Dtype):
    """The inverse of `pack_inputs`: (states [T, H], ids [T, k], ranks [T, k])."""
    n = state_words(tokens, width, dtype)
    pairs = tokens * top_k
    states = words[:n].view(dtype).reshape(tokens, width)
    ids = words[n : n + pairs].view(mx.int32).reshape(tokens, top_k)
    ranks = words[n + pairs : n + 2 * pairs].view(mx.int32).reshape(tokens, top_k)
    return states, ids, ranks


def after(array: mx.array, previous: mx.array | None) -> mx.array:
    """`array`, ordered after the collective `previous` (see the module docstring)."""
    return array if previous is None else mx.depends(array, previous)
