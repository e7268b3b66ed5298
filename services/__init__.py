"""moe-mesh: a core plus expert workers over gRPC, OpenAI-compatible HTTP in front.

gRPC's EventEngine-based client and listener (grpcio's default) add latency to our
small, frequent bidi messages when the peer has just been busy computing, which is
every expert layer call: `bench/grpc_echo.py` on the 2-core CI VM, server busy
2.5 ms per call, round-trip overhead p50 250-317 us with them off vs 338-403 us on
(three runs; with an idle server the two are within noise). The expert layer call
is the hottest path we have, so every moe-mesh process turns them off before gRPC
loads (a value the user set in GRPC_EXPERIMENTS wins).
"""

import os

os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
