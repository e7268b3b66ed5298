"""Operating moe-mesh: the `moe-mesh` command line, `up`, cluster files and checks, memory
plans, deploy (launchd/systemd) and the status console. Nothing here runs in a request's path."""
