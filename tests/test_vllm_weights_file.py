"""The files a vLLM instance reloads weights from: a file, a folder, a sharded folder, a state dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from staleflow.adapters.vllm.llm import weights_file


def test_a_sharded_folder_becomes_one_temporary_file(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    path, temporary = weights_file(str(folder), tmp_path / "weights", "i0")
    assert temporary and path.parent == tmp_path / "weights"
    loaded = load_file(str(path))
    assert torch.equal(loaded["a"], torch.ones(2)) and torch.equal(loaded["b"], torch.zeros(3))


def test_a_single_file_folder_is_used_in_place_and_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "single").mkdir()
    save_file({"a": torch.ones(1)}, str(tmp_path / "single" / "model.safetensors"))
    assert weights_file(str(tmp_path / "single"), tmp_path, "i0") == (tmp_path / "single" / "model.safetensors", False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="i0: no safetensors weights"):
        weights_file(str(tmp_path / "empty"), tmp_path, "i0")
