"""Regenerate the gRPC/protobuf Python code from protos/.

    python -m services.proto.regenerate            # writes services/proto/
    python -m services.proto.regenerate --out DIR  # writes elsewhere (the up-to-date test)

protoc emits `from moemesh.v1 import x_pb2`; the package lives at
`services.proto.moemesh.v1`, so imports are rewritten and every file gets a
do-not-edit header. The versions the files demand of grpcio and protobuf at import
are stamped as pyproject.toml's floors, not as the generator's own release: code made
by a newer grpcio-tools is the same, and users on the floor can still import it.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
HEADER = "# Generated from protos/ by `python -m services.proto.regenerate`. DO NOT EDIT.\n"


def dependency_floor(name: str) -> str:
    """The `>=` version pyproject.toml gives `name`."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for spec in dependencies:
        found = re.fullmatch(rf"{re.escape(name)}\s*>=\s*([0-9.]+)\s*", spec.split(";")[0])
        if found:
            return found.group(1)
    raise SystemExit(f"pyproject.toml gives {name} no >= floor")


def stamp_floors(text: str) -> str:
    """The grpcio and protobuf versions the generated code checks at import, set to the floors."""
    text = re.sub(
        r"^GRPC_GENERATED_VERSION = '[^']*'",
        f"GRPC_GENERATED_VERSION = '{dependency_floor('grpcio')}'",
        text,
        flags=re.MULTILINE,
    )
    major, minor, patch = dependency_floor("protobuf").split(".")
    return re.sub(
        r"(ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.PUBLIC,\n)"
        r"\s*\d+,\n\s*\d+,\n\s*\d+,\n",
        rf"\g<1>    {major},\n    {minor},\n    {patch},\n",
        text,
    )


def regenerate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted((out / "moemesh").rglob("*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = path.read_text()
        text = re.sub(
            r"^from moemesh\.v1 import", "from services.proto.moemesh.v1 import", text, flags=re.MULTILINE
        )
        text = stamp_floors(text)
        if not text.startswith(HEADER):
            text = HEADER + text
        path.write_text(text)
        written.append(path)
    for pkg in (out / "moemesh", out / "moemesh" / "v1"):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text(HEADER)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    for path in regenerate(args.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
