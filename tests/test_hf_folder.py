"""Hugging Face model folders (``staleflow.adapters.rlkit.hf_folder``): every problem a folder can
have named with its folder and file before anything loads, and the writer's refusals (a dtype it
does not write, a tied output layer that differs from the embeddings) leaving no folder behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from staleflow.adapters.rlkit.hf_folder import check_model_folder, read_weights, tied_embeddings, weight_shapes, write_hf_folder

WEIGHTS = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2), "model.norm.weight": torch.ones(2)}


def folder_with(tmp_path: Path, files: dict[str, object]) -> Path:
    """A model folder: a config, then each file (a dict of tensors as safetensors, bytes, or JSON)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    for name, content in files.items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        elif name.endswith(".safetensors"):
            save_file(content, str(folder / name))  # type: ignore[arg-type]
        else:
            (folder / name).write_text(json.dumps(content))
    return folder


@pytest.mark.parametrize(("files", "error", "message"), [
    ({"weights.safetensors": WEIGHTS}, FileNotFoundError,
     r"has \['weights.safetensors'\] but neither model.safetensors nor model.safetensors.index.json"),
    ({}, FileNotFoundError, r"has no weights \(model.safetensors or model.safetensors.index.json with its shards\)"),
    ({"model.safetensors.index.json": {"weight_map": {}}}, ValueError,
     r"model.safetensors.index.json is not a safetensors index \(ValueError: empty or not a mapping\)"),
    ({"model.safetensors.index.json": {"metadata": {}}}, ValueError, r"is not a safetensors index \(KeyError: 'weight_map'\)"),
    ({"model.safetensors.index.json": {"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                      "b": "model-00002-of-00002.safetensors"}},
      "model-00001-of-00002.safetensors": WEIGHTS}, FileNotFoundError,
     r"lists 2 shards but 1 are missing: \['model-00002-of-00002.safetensors'\]"),
], ids=["stray-file", "no-weights", "empty-index", "index-without-map", "missing-shard"])
def test_a_folder_that_cannot_load_is_named_before_anything_loads(tmp_path: Path, files: dict[str, object], error: type,
                                                                   message: str) -> None:
    folder = folder_with(tmp_path, files)
    with pytest.raises(error, match=message):
        check_model_folder(folder)


def test_a_shard_without_a_promised_tensor_and_a_damaged_file_are_named(tmp_path: Path) -> None:
    shard = "model-00001-of-00001.safetensors"
    folder = folder_with(tmp_path, {shard: WEIGHTS, "model.safetensors.index.json": {
        "weight_map": {**dict.fromkeys(WEIGHTS, shard), "lm_head.weight": shard}}})
    with pytest.raises(ValueError, match=r"model.safetensors.index.json lists tensors that no shard holds: \['lm_head.weight'\]"):
        read_weights(folder)
    assert weight_shapes(folder) == {"model.embed_tokens.weight": (3, 2), "model.norm.weight": (2,)}
    (folder / shard).write_bytes((folder / shard).read_bytes()[:20])  # truncated inside its header
    with pytest.raises(ValueError, match=f"weights file {folder / shard} cannot be read"):
        weight_shapes(folder)
    with pytest.raises(ValueError, match=f"weights file {folder / shard} cannot be read"):
        read_weights(folder / shard)


def test_tied_embeddings_follow_the_config_or_its_text_config_and_default_to_tied() -> None:
    assert tied_embeddings({"tie_word_embeddings": False}) is False
    assert tied_embeddings({"text_config": {"tie_word_embeddings": False}}) is False
    assert tied_embeddings({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}) is True
    assert tied_embeddings({"text_config": {}}) is True and tied_embeddings({}) is True


def test_the_writer_refuses_a_bad_dtype_and_a_tied_head_that_differs_leaving_nothing(tmp_path: Path) -> None:
    source = folder_with(tmp_path, {"model.safetensors": WEIGHTS, "tokenizer.json": {"model": "bytes"}})
    out = tmp_path / "export"
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp32'\], got 'fp8'"):
        write_hf_folder(out, WEIGHTS, source=source, dtype="fp8")
    head = {**WEIGHTS, "lm_head.weight": WEIGHTS["model.embed_tokens.weight"] + 1}
    with pytest.raises(ValueError, match="the config ties the embeddings but lm_head.weight differs from model.embed_tokens.weight"):
        write_hf_folder(out, head, source=source)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging folder left
    out.mkdir()  # an empty folder is taken
    tied = {**WEIGHTS, "lm_head.weight": WEIGHTS["model.embed_tokens.weight"].clone()}
    assert write_hf_folder(out, tied, source=source, dtype="fp32") == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert read_weights(out).keys() == WEIGHTS.keys()  # the tied head written once, as the embeddings
    with pytest.raises(FileExistsError, match=f"{out} exists and is not empty"):
        write_hf_folder(out, WEIGHTS, source=source)
