"""Core's side of the expert call: the proxy that replaces SwitchGLU, step merging, the call in
flight, the dispatcher and its routes, one module per data path (frames, gRPC, local), metrics."""
