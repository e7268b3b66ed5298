"""moe-mesh: a core plus expert workers over gRPC, OpenAI-compatible HTTP in front.

gRPC's EventEngine-based client and listener (the default since grpcio 1.6x) cost
about twice the per-message latency and CPU of the classic iomgr path for our
small, frequent bidi messages: measured on a 2-core box, an echo round trip over a
Unix socket fell from ~240 us to ~110 us when they were turned off. The expert
layer call is the hottest path we have, so every moe-mesh process turns them off
before gRPC loads (a value the user set in GRPC_EXPERIMENTS wins).
"""

import os

os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
