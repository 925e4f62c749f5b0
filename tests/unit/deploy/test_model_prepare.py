"""kvfleet.deploy.models: name/path resolution, idempotent and atomic preparation, CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import pytest

from kvfleet.allocator.fingerprint import read_chat_template
from kvfleet.deploy import model_sources, models
from kvfleet.deploy.models import DEFAULT_MODEL, ModelNotPrepared, prepare_model, resolve_model


def test_prepared_dir_is_complete(smollm2_dir) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", models.SOURCE_GGUF):
        assert (smollm2_dir / name).is_file(), name
    template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template and template == read_chat_template(smollm2_dir)
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(smollm2_dir.parent.glob(f".{DEFAULT_MODEL}.*")), "temp dir left behind"


def test_prepare_is_idempotent(smollm2_dir) -> None:
    start = time.monotonic()
    assert prepare_model(DEFAULT_MODEL, smollm2_dir.parent.parent, progress=False) == smollm2_dir
    assert time.monotonic() - start < 1.0


def test_a_directory_prepared_without_its_gguf_gets_it(tmp_path, monkeypatch) -> None:
    """Directories prepared before the GGUF was kept gain it on the next prepare (for
    ``--quantization`` to read its blocks), without a conversion."""
    target = models.prepared_dir(DEFAULT_MODEL, tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"weights")
    gguf = tmp_path / "shipped.gguf"
    gguf.write_bytes(b"GGUF blocks")
    source = dataclasses.replace(models.KNOWN_MODELS[DEFAULT_MODEL],
                                 sha256=hashlib.sha256(b"GGUF blocks").hexdigest())
    monkeypatch.setitem(models.KNOWN_MODELS, DEFAULT_MODEL, source)
    monkeypatch.setattr(model_sources, "part_paths", lambda source: [gguf])
    monkeypatch.setattr(models, "_convert", lambda *a: pytest.fail("converted again"))
    assert prepare_model(DEFAULT_MODEL, tmp_path, progress=False) == target
    assert (target / models.SOURCE_GGUF).read_bytes() == b"GGUF blocks"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors",
                                                        models.SOURCE_GGUF]


def test_resolve_known_name_and_path(smollm2_dir, tiny_llama_dir) -> None:
    assert resolve_model(DEFAULT_MODEL, smollm2_dir.parent.parent) == (DEFAULT_MODEL, smollm2_dir)
    assert resolve_model(str(tiny_llama_dir)) == (tiny_llama_dir.name, tiny_llama_dir.resolve())


def test_unprepared_model_names_the_command(tmp_path) -> None:
    with pytest.raises(ModelNotPrepared, match="kvfleet model prepare"):
        resolve_model(DEFAULT_MODEL, tmp_path)


def test_unknown_model_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model("no-such-model", tmp_path)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        prepare_model("no-such-model", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch) -> None:
    def convert_then_die(gguf, out, bar, needs_template):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(DEFAULT_MODEL, tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(ModelNotPrepared):
        resolve_model(DEFAULT_MODEL, tmp_path)


def test_cache_dir_from_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("KVFLEET_CACHE_DIR")
    assert models.default_cache_dir().name == "kvfleet"


def test_cli_path_and_errors(smollm2_dir, tmp_path, capsys) -> None:
    assert models.main(["path", "--cache-dir", str(smollm2_dir.parent.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    assert models.main(["path", "--cache-dir", str(tmp_path)]) == 1
    assert "kvfleet model prepare" in capsys.readouterr().err
    assert models.main(["prepare", "--cache-dir", str(smollm2_dir.parent.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
