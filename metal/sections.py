"""Reading a kernel source file made of "//// <name>" sections (metal/turboquant.metal,
metal/turboquant.cu): every kernel body is one section, "header" is shared by all."""

from __future__ import annotations

from pathlib import Path


def read_sections(path: Path) -> dict[str, str]:
    """{section name: text} of `path`; lines before the first marker (the file's comment) are dropped."""
    sections, name, lines = {}, None, []
    for line in path.read_text().splitlines():
        if line.startswith("//// "):
            if name:
                sections[name] = "\n".join(lines)
            name, lines = line[5:].strip(), []
        elif name:
            lines.append(line)
    if name:
        sections[name] = "\n".join(lines)
    return sections
