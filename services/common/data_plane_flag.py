"""The `--distributed BACKEND` flag of `moe-mesh core|expert|up`: light to import, since the
command line reads it before MLX loads (services/common/data_plane.py is the data plane)."""

from __future__ import annotations

import argparse

BACKENDS = ("ring", "nccl", "jaccl", "any")
DATA_PLANE_STUCK = 70  # core's exit code when a step its data plane left blocked cannot finish


def add_data_plane_flag(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--distributed",
        choices=BACKENDS,
        default=None,
        help=f"{role} MLX's distributed group on this backend and carry layer calls as collectives "
        "inside the model's graph (NCCL between GPUs, JACCL between Macs over RDMA, ring over TCP); "
        "gRPC stays the control plane and the fallback. Membership comes from MLX's environment, as "
        "mlx.launch sets it; core is rank 0 (default: off, layer calls over gRPC or frame sockets)",
    )
