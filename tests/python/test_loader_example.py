"""examples/train_from_nvme.py end to end on the CPU (and CUDA where present): the model learns the
synthetic data's rule from shards streamed by the loader, through the library's train_from_nvme
(optimized_ops.models.training; its own tests are test_training.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from conftest import DEVICES

_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_from_nvme.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_from_nvme", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", DEVICES)
def test_train_from_nvme_learns(tmp_path, device):
    ex = _example()
    path = str(tmp_path / "tokens")
    info = ex.make_synthetic(path, sequences=2048, seq_len=16, vocab=64)
    assert info.num_records == 2048
    result = ex.train_from_nvme(ex.TinyLM(64, dim=32), path,
                                {"batch_size": 64, "epochs": 3, "device": device, "log_every": 0, "lr": 1e-2})
    assert result.steps == 3 * 2048 // 64
    assert result.losses[-1] < 0.25 * result.losses[0], result.losses[::16]
