"""Known models beyond the default: name resolution, the GGUF put together from packages and
refused on a wrong sha256 before any conversion, a chat template given at prepare, and the
router's refusal of chat requests to a model without one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kvfleet.allocator.fingerprint import read_chat_template
from kvfleet.deploy import model_sources, models
from kvfleet.deploy.model_sources import ChecksumMismatch, GgufSource
from kvfleet.deploy.models import ModelNotPrepared, prepare_model, resolve_model
from kvfleet.errors import FailedPrecondition
from kvfleet.router.served_model import ServedModel

CHUNKS = (b"GGUF\x03\x00\x00\x00first chunk|", b"second chunk|", b"third")


@pytest.fixture
def chunked(tmp_path, monkeypatch) -> GgufSource:
    """A known model ``chunked-test`` whose GGUF is three chunks in two packages on sys.path
    (already installed: nothing is pip-installed)."""
    site = tmp_path / "site"
    for pkg, files in (("fake_chunks_a", {"data/g.part00": CHUNKS[0], "data/g.part01": CHUNKS[1]}),
                       ("fake_chunks_b", {"data/g.part02": CHUNKS[2], "data/TERMS.html": b"terms"})):
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
        for rel, data in files.items():
            (site / pkg / rel).parent.mkdir(exist_ok=True)
            (site / pkg / rel).write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    source = GgufSource(
        requirements=("fake-chunks==0",),
        parts=(("fake_chunks_a", "data/g.part00"), ("fake_chunks_a", "data/g.part01"),
               ("fake_chunks_b", "data/g.part02")),
        sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(), chat_template=False,
        terms="test terms", terms_package="fake_chunks_b", terms_files=("data/TERMS.html",))
    monkeypatch.setitem(model_sources.KNOWN_MODELS, "chunked-test", source)
    monkeypatch.setattr(model_sources, "_install", lambda s: pytest.fail("pip install attempted"))
    return source


def test_gemma3_is_known_beside_the_default(tmp_path, capsys) -> None:
    source = model_sources.known_source("gemma3-270m")
    assert len(source.parts) == 4 and not source.chat_template and "Gemma Terms" in source.terms
    assert models.DEFAULT_MODEL == "smollm2-135m-instruct"  # the demo's model is unchanged
    with pytest.raises(ModelNotPrepared, match="run `kvfleet model prepare gemma3-270m --cache-dir"):
        resolve_model("gemma3-270m", tmp_path)
    # The CLI takes the name as an argument (or --name), and names the command when unprepared.
    assert models.main(["path", "gemma3-270m", "--cache-dir", str(tmp_path)]) == 1
    assert "kvfleet model prepare gemma3-270m" in capsys.readouterr().err
    assert models.main(["path", "--name", "gemma3-270m", "--cache-dir", str(tmp_path)]) == 1
    assert "gemma3-270m" in capsys.readouterr().err
    assert models.main(["path", "gemma3-270m", "--name", "other", "--cache-dir", str(tmp_path)]) == 1
    assert "two model names" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="gemma3-270m, smollm2-135m-instruct"):
        model_sources.known_source("gemma3")


def test_chunks_are_joined_and_verified(chunked, tmp_path) -> None:
    gguf = model_sources.materialize_gguf(chunked, tmp_path)
    assert gguf == tmp_path / models.SOURCE_GGUF
    assert gguf.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site", models.SOURCE_GGUF]


def test_a_corrupted_chunk_is_refused_before_conversion(chunked, tmp_path, monkeypatch, capsys) -> None:
    part = Path(model_sources._package_dir("fake_chunks_a")) / "data" / "g.part01"
    part.write_bytes(b"second chunK|")  # one byte changed, same length
    monkeypatch.setattr(models, "_convert", lambda *a, **k: pytest.fail("converted a corrupted file"))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatch, match=f"is not the expected {chunked.sha256}.*fake-chunks==0"):
        prepare_model("chunked-test", cache, progress=False)
    assert list((cache / "models").iterdir()) == []  # no model, no temp dir, no GGUF
    assert models.main(["prepare", "chunked-test", "--cache-dir", str(cache)]) == 1
    assert "sha256" in capsys.readouterr().err


def test_a_single_file_source_is_verified_too(tmp_path, monkeypatch) -> None:
    (tmp_path / "site" / "one_file_pkg").mkdir(parents=True)
    (tmp_path / "site" / "one_file_pkg" / "m.gguf").write_bytes(b"GGUF one file")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    good = GgufSource(("one-file==0",), (("one_file_pkg", "m.gguf"),),
                      hashlib.sha256(b"GGUF one file").hexdigest(), True, "")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChecksumMismatch):
        model_sources.materialize_gguf(dataclasses.replace(good, sha256="0" * 64), out)
    assert list(out.iterdir()) == []
    assert model_sources.materialize_gguf(good, out).read_bytes() == b"GGUF one file"


def test_prepare_writes_a_supplied_template_and_the_terms(chunked, tmp_path, monkeypatch) -> None:
    def convert(gguf, out, bar, needs_template):
        assert gguf.read_bytes() == b"".join(CHUNKS) and not needs_template
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert", convert)
    target = prepare_model("chunked-test", tmp_path, progress=False)
    assert sorted(p.name for p in target.iterdir()) == ["TERMS.html", "config.json",
                                                        "model.safetensors", models.SOURCE_GGUF]
    assert read_chat_template(target) == ""
    # A template given later lands in both places readers look, without a new conversion.
    monkeypatch.setattr(models, "_convert", lambda *a, **k: pytest.fail("converted again"))
    template_file = tmp_path / "chat.jinja"
    template_file.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert models.main(["prepare", "chunked-test", "--cache-dir", str(tmp_path),
                        "--chat-template", str(template_file)]) == 0
    assert (target / "chat_template.jinja").read_text() == template_file.read_text()
    assert json.loads((target / "tokenizer_config.json").read_text())["chat_template"] \
        == template_file.read_text()
    with pytest.raises(ValueError, match="empty"):
        prepare_model("chunked-test", tmp_path, progress=False, chat_template="  ")


def _without_template(src: Path, out: Path) -> Path:
    out.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(src / f, out / f)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out


def test_chat_to_a_model_without_a_template_is_refused_by_name(tiny_llama_dir, tmp_path) -> None:
    d = _without_template(tiny_llama_dir, tmp_path / "base")
    model = ServedModel.load("base-model", d, block_size=16)
    assert model.chat_template is None
    with pytest.raises(FailedPrecondition, match="'base-model' has no chat template") as err:
        model.encode_messages([{"role": "user", "content": "hi"}])
    assert err.value.field == "messages" and "--chat-template" in str(err.value)
    assert model.encode_text("The capital of France is")  # completions work either way
    # Given a template, the same directory serves chat (under another identity).
    models.write_chat_template(d, read_chat_template(tiny_llama_dir))
    with_template = ServedModel.load("base-model", d, block_size=16)
    assert with_template.encode_messages([{"role": "user", "content": "hi"}])
    assert with_template.identity.digest() != model.identity.digest()
