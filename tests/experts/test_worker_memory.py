"""A worker holds MLX's cache of freed buffers under `--mlx-cache-gb`, as `moe-mesh plan` assumes:
streamed experts come and go, and without a limit their freed buffers would stay cached."""

import argparse

import mlx.core as mx

from services.experts import server
from services.experts.cli_flags import add_compute_flags, compute_kwargs


def test_the_flag_reaches_mlx(monkeypatch):
    parser = argparse.ArgumentParser()
    add_compute_flags(parser)
    kwargs = compute_kwargs(parser.parse_args(["--mlx-cache-gb", "0.25"]))
    assert kwargs["mlx_cache_bytes"] == 1 << 28

    async def serve(**served):
        assert "mlx_cache_bytes" not in served  # the limit is the process's, set before serving

    monkeypatch.setattr(server, "serve_expert_worker", serve)
    monkeypatch.setattr(server, "install_uvloop", lambda: None)
    before = mx.set_cache_limit(1 << 40)
    try:
        server.run_expert_worker(**kwargs)
        assert mx.set_cache_limit(1 << 40) == 1 << 28
    finally:
        mx.set_cache_limit(before)
