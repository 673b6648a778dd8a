"""The kernel-check harness both kernel modules use: the comparison, the lengths and the choice of implementation."""

from __future__ import annotations

import pytest
import torch

from videosft.kernels import checks

CPU = torch.device("cpu")


def test_relative_errors_are_norm_ratios():
    ref = {"a": torch.tensor([3.0, 4.0]), "z": torch.zeros(2)}
    errors = checks.relative_errors({"a": torch.tensor([3.0, 4.5]), "z": torch.zeros(2)}, ref)
    assert errors == {"a": pytest.approx(0.1), "z": 0.0}
    assert checks.relative_errors({"z": torch.ones(2)}, {"z": torch.zeros(2)})["z"] == float("inf")


def test_a_row_passes_only_with_every_error_within_the_bound():
    passed = checks.verdict({"out": 1e-3, "dx": checks.RELATIVE_ERROR_BOUND})
    assert passed == {"relative_errors": {"out": 1e-3, "dx": checks.RELATIVE_ERROR_BOUND},
                      "max_relative_error": checks.RELATIVE_ERROR_BOUND, "bound": checks.RELATIVE_ERROR_BOUND,
                      "passed": True}
    assert not checks.verdict({"out": 1e-3, "dx": 0.03})["passed"]


def test_check_lengths_cap_at_8192_and_include_a_short_odd_one():
    assert checks.check_lengths(13386) == [8192, 201]
    assert checks.check_lengths(150) == [150]
    # three full 64-token chunks and a partial one, and odd
    assert checks.CHECK_SHORT_TOKENS // 64 == 3 and checks.CHECK_SHORT_TOKENS % 64 and checks.CHECK_SHORT_TOKENS % 2


def test_torch_is_taken_with_its_reason_and_fla_asked_for_where_it_cannot_run_is_an_error():
    importable, missing = {"importable": True}, {"importable": False, "error": "ModuleNotFoundError: fla"}
    assert checks.torch_reason("auto", importable, torch.device("cuda"), "X=fla") is None
    assert checks.torch_reason("torch", importable, torch.device("cuda"), "X=fla") == "asked for"
    assert checks.torch_reason("auto", missing, torch.device("cuda"), "X=fla") == "fla does not import"
    assert checks.torch_reason("auto", importable, CPU, "X=fla") == "no CUDA device"
    with pytest.raises(checks.KernelCheckError, match="X=fla but fla cannot run here: ModuleNotFoundError"):
        checks.torch_reason("fla", missing, torch.device("cuda"), "X=fla")


def test_the_standalone_checks_default_to_the_run_lengths():
    args = checks.check_parser("a check", "time it").parse_args(["--model-config", "config.json"])
    assert args.tokens == [checks.CHECK_MAX_TOKENS, checks.CHECK_SHORT_TOKENS] and args.device == "cuda"


def test_the_switch_overrides_the_argument_and_a_bad_value_is_a_config_error(monkeypatch):
    from videosft.errors import ConfigError

    monkeypatch.delenv("VIDEOSFT_TEST_SWITCH", raising=False)
    assert checks.requested_choice("auto", "VIDEOSFT_TEST_SWITCH") == ("auto", False)
    monkeypatch.setenv("VIDEOSFT_TEST_SWITCH", "torch")
    assert checks.requested_choice("fla", "VIDEOSFT_TEST_SWITCH") == ("torch", True)
    monkeypatch.setenv("VIDEOSFT_TEST_SWITCH", "fast")  # the stage prints this line, no traceback
    with pytest.raises(ConfigError, match="^VIDEOSFT_TEST_SWITCH='fast': choose one of auto, fla, torch$"):
        checks.requested_choice("auto", "VIDEOSFT_TEST_SWITCH")
    monkeypatch.delenv("VIDEOSFT_TEST_SWITCH")
    with pytest.raises(ConfigError, match="^requested='fast': choose one of"):
        checks.requested_choice("fast", "VIDEOSFT_TEST_SWITCH")
