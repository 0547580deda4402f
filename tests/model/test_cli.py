import pytest
import torch
from typer.testing import CliRunner

import k3sys.model
from k3sys.cli import app
from k3sys.model import ModelConfig, cache_bytes
from k3sys.model.memory import format_bytes, parse_tokens


def test_memory_command_prints_the_calculator_numbers():
    args = ["memory", "--preset", "k3", "--context", "2K", "--dtype", "fp8"]
    result = CliRunner().invoke(app, args, terminal_width=100)
    assert result.exit_code == 0, result.output
    k3 = ModelConfig.from_preset("k3")
    for n, label in ((2048, "2K"), (4096, "4K"), (131072, "128K"), (1 << 20, "1M")):
        row = next(line for line in result.output.splitlines() if line.split()[:1] == [label])
        assert format_bytes(cache_bytes(k3, n, dtype=torch.float8_e4m3fn)["total"]) in row
    assert "69 KDA + 24 MLA" in result.output and "active" in result.output


@pytest.mark.parametrize("args", [["--preset", "k4"], ["--context", "lots"], ["--dtype", "int3"]],
                         ids=["preset", "context", "dtype"])
def test_memory_command_rejects_bad_options(args):
    result = CliRunner().invoke(app, ["memory", *args])
    assert result.exit_code != 0 and args[1] in result.output


def test_parse_tokens_uses_binary_units():
    assert [parse_tokens(s) for s in ("4K", "128k", "1M", "1000")] == [4096, 131072, 1 << 20, 1000]
    with pytest.raises(ValueError, match="0K"):
        parse_tokens("0K")


def test_public_names_are_exported():
    assert set(k3sys.model.__all__) >= {"ModelConfig", "HybridModel", "HybridCache", "GatedMLA", "generate",
                                        "cache_bytes", "count_params", "save_model", "load_model"}
    assert all(hasattr(k3sys.model, name) for name in k3sys.model.__all__)
