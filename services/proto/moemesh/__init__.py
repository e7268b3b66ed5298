# Generated from protos/ by `python -m services.proto.regenerate`. DO NOT EDIT.
