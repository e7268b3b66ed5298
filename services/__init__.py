"""moe-mesh: a core plus expert workers over gRPC, OpenAI-compatible HTTP in front.

gRPC's EventEngine-based client and listener (grpcio's default) are turned off in every
moe-mesh process before gRPC loads (a value the user set in GRPC_EXPERIMENTS wins): the
expert layer call is small, frequent and follows a busy peer, the case where they were
slower on the 2-core CI VM. `bench/grpc_echo.py` measures both settings; the runs differ
from one another (docs/benchmarks.md, "Transport floors"). Same-host workers answer over
frame sockets (services/common/frames.py), outside gRPC.
"""

import os

os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")
