"""Parse "0-3,8,10-12" style index ranges (CLI and cluster.toml)."""

from __future__ import annotations


def means_all(text: str | None) -> bool:
    """None, "" and "all" name every index."""
    return text is None or text.strip() in ("", "all")


def parse_ranges(text: str | None, limit: int, what: str) -> list[int]:
    """Indices in [0, limit) named by `text` (every one where `means_all`)."""
    if means_all(text):
        return list(range(limit))
    chosen: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        try:
            if "-" in part:
                lo_text, hi_text = part.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not an index or a range like 0-7") from None
        if lo > hi:
            raise ValueError(f"{what}: {part!r} runs backwards; write {hi}-{lo}")
        if lo < 0 or hi >= limit:
            raise ValueError(f"{what}: {part!r} is outside 0-{limit - 1}")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)


def format_ranges(indices: list[int]) -> str:
    """The inverse of parse_ranges: [0,1,2,5] -> "0-2,5"."""
    out, indices = [], sorted(indices)
    i = 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        out.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(out)
