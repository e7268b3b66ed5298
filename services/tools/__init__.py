"""Offline tools, outside every request's path: `moe-mesh split` (checkpoint -> core/ +
experts/), the demo and synthetic model builders the tests and benches use, and KV-cache
quality and answer evaluation. The services never import this package; `moe-mesh` (ops)
and bench/ do."""
