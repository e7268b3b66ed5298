"""`--kv-cache` and friends on `moe-mesh core` and `moe-mesh up`."""

from __future__ import annotations

import pytest

from services.core.kv import PAPER_SETTINGS, KVCacheSettings
from services.core.kv.cli_flags import kv_cli_args, kv_engine_kwargs
from services.ops.cli import build_parser


def test_core_defaults_to_fp16_with_the_default_turboquant_settings():
    args = build_parser().parse_args(["core"])
    assert kv_engine_kwargs(args) == {"kv_cache": "fp16", "kv_settings": KVCacheSettings()}


def test_core_turboquant_flags_become_engine_settings():
    argv = ["core", "--kv-cache", "turboquant", "--kv-key-bits", "4", "--kv-value-bits", "2", "--kv-no-qjl"]
    kwargs = kv_engine_kwargs(
        build_parser().parse_args(argv + ["--kv-recent-window", "64", "--kv-center-keys"])
    )
    assert kwargs["kv_cache"] == "turboquant"
    assert kwargs["kv_settings"] == KVCacheSettings(
        key_bits=4, value_bits=2, key_qjl=False, recent_window=64, center_keys=True
    )


@pytest.mark.parametrize("qjl", [[], ["--kv-qjl"], ["--kv-no-qjl"]])
def test_up_passes_the_same_choice_to_its_core(qjl):
    args = build_parser().parse_args(
        ["up", "--kv-cache", "turboquant", "--kv-key-bits", "3", "--kv-center-keys", *qjl]
    )
    core = build_parser().parse_args(["core", *kv_cli_args(args)])
    assert kv_engine_kwargs(core) == kv_engine_kwargs(args)
    assert kv_engine_kwargs(core)["kv_settings"].key_qjl == (qjl == ["--kv-qjl"])


def test_the_papers_k3_qjl_keys_are_two_flags_away():
    args = build_parser().parse_args(["core", "--kv-cache", "turboquant", "--kv-key-bits", "3", "--kv-qjl"])
    assert kv_engine_kwargs(args)["kv_settings"] == PAPER_SETTINGS
    assert PAPER_SETTINGS.describe() == "K3+QJL/V3" and KVCacheSettings().describe() == "K4/V3"


@pytest.mark.parametrize(
    "bad",
    [
        ["--kv-cache", "int8"],
        ["--kv-key-bits", "5"],
        ["--kv-recent-window", "x"],
        ["--kv-qjl", "--kv-no-qjl"],
    ],
)
def test_bad_kv_flags_are_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["core", *bad])
    assert "--kv" in capsys.readouterr().err
