"""`python -m services.cli`: the command line under the module name that service files rendered
before it moved to services/ops/ still start (`moe-mesh deploy` now renders services.ops.cli)."""

from services.ops.cli import main

if __name__ == "__main__":
    main()
