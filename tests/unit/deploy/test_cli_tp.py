"""`kvfleet up --tp`: a size the model cannot take, or a device that is not there, is a usage
error (exit 2, the field named) before any process starts."""

from __future__ import annotations

import pytest
import torch

from kvfleet.deploy.cli import main


@pytest.mark.parametrize("value, message", [("0", "--tp must be >= 1, got 0"),
                                            ("abc", "--tp must be an integer")])
def test_tp_must_be_a_positive_integer(capsys, value, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--port", "0", "--tp", value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("tp, field", [(2, "num_attention_heads"), (9, "intermediate_size")])
def test_a_split_smollm2_cannot_take_names_the_rule_and_the_sizes_that_work(
        capsys, smollm2_dir, tp, field) -> None:
    assert main(["up", "--port", "0", "--model", str(smollm2_dir), "--tp", str(tp)]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}: " in err and "9 query / 3 KV heads" in err
    assert "tp sizes that work: 1, 3)" in err


def test_device_cuda_without_cuda_is_refused_at_once(capsys, smollm2_dir, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only host
    assert main(["up", "--port", "0", "--model", str(smollm2_dir), "--tp", "3",
                 "--device", "cuda"]) == 2
    assert "--device cuda: this torch sees no CUDA device" in capsys.readouterr().err
