"""Numeric flags: a bad value is one usage line naming the flag (argparse exits 2), never a
traceback inside a service or a value that silently means something else."""

from __future__ import annotations

import pytest

from services.ops.cli import build_parser


@pytest.mark.parametrize(
    "argv, words",
    [
        (["up", "--port", "99999"], "not a port number"),
        (["gateway", "--port", "0"], "not a port number"),
        (["up", "--expert-memory-gb", "0"], "must be positive"),
        (["plan", "--model", "m", "--memory-gb", "inf"], "finite"),
        (["plan", "--model", "m", "--memory-gb", "nan"], "finite"),
        (["core", "--split", "s", "--expert-timeout", "0"], "must be positive"),
        (["core", "--split", "s", "--max-step-seconds", "-1"], "0 or more"),
        (["core", "--split", "s", "--max-num-seqs", "0"], "at least 1"),
        (["core", "--split", "s", "--metrics-port", "70000"], "not a port number"),
        (["iobench", "p", "--queue-depths", "1,0"], "at least 1"),
        (["iobench", "p", "--queue-depths", "a"], "not an integer"),
    ],
)
def test_bad_numbers_are_usage_errors_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert words in error and argv[-2] in error


def test_good_numbers_parse():
    args = build_parser().parse_args(["iobench", "p", "--queue-depths", "1,4"])
    assert args.queue_depths == [1, 4]
    assert build_parser().parse_args(["up", "--port", "8001"]).port == 8001
