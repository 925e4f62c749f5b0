"""The router's chat rendering and tokenization, per family, against transformers'
``apply_chat_template`` on the same model directory (tiny checkpoints of each family carrying
that family's chat format: tests/fixtures/templates/), and each template's part in the cache
identity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvfleet.allocator.fingerprint import fingerprint_model_dir
from kvfleet.errors import InvalidArgument
from kvfleet.router.served_model import ServedModel

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
# template → the tiny checkpoint of its family
FAMILIES = {"qwen3": "tiny_qwen3_dir", "gemma3": "tiny_gemma3_dir", "phi4": "tiny_phi3_dir",
            "llama3": "tiny_llama3_dir", "mixtral": "tiny_mixtral_dir", "gpt_oss": "tiny_gpt_oss_dir"}
SYSTEM = {"role": "system", "content": "You answer in one word."}
USER = {"role": "user", "content": "  Capital of France?  "}
ASSISTANT = {"role": "assistant", "content": "<think>\nParis, surely.\n</think>\n\nParis"}
CHATS = {
    "system-first": [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "And of Italy?"}],
    "no-system": [USER, ASSISTANT, {"role": "user", "content": "Sure?"}],
    "one-turn": [USER],
}


def _with_template(src: Path, d: Path, template: str) -> Path:
    """``src``'s model directory at ``d`` (weights linked) with chat template ``template``."""
    d.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
        else:
            shutil.copy(f, d / f.name)
    shutil.copy(TEMPLATES / f"{template}.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(params=sorted(FAMILIES))
def family(request, tmp_path) -> tuple[str, Path]:
    """``(template name, a model directory)``: the family's tiny checkpoint with that family's
    chat template."""
    src = request.getfixturevalue(FAMILIES[request.param])
    return request.param, _with_template(src, tmp_path / request.param, request.param)


def _hf_tokenizer(model_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_rendered_and_tokenized_as_transformers_does(family, chat) -> None:
    name, d = family
    messages = CHATS[chat]
    model = ServedModel.load(name, d, block_size=16)
    tok = _hf_tokenizer(d)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert model.chat_template.render(messages) == text
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert model.encode_messages(messages) == ids
    assert model.identity.chat_template_fingerprint == fingerprint_model_dir(d).chat_template


def test_gemma_folds_the_system_message_into_the_first_user_turn(tiny_gemma3_dir, tmp_path) -> None:
    d = _with_template(tiny_gemma3_dir, tmp_path / "g", "gemma3")
    model = ServedModel.load("g", d, block_size=16)
    text = model.chat_template.render(CHATS["system-first"])
    bos = json.loads((d / "tokenizer_config.json").read_text())["bos_token"]
    assert text.startswith(f"{bos}<start_of_turn>user\nYou answer in one word.\n\nCapital of France?"
                           "<end_of_turn>\n<start_of_turn>model\n")
    assert "system" not in text
    # A conversation whose roles do not alternate is refused, as transformers' template does.
    wrong = [USER, USER]
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        model.encode_messages(wrong)
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        _hf_tokenizer(d).apply_chat_template(wrong, tokenize=False)


def test_each_family_s_template_is_its_own_cache_identity(tmp_path, tiny_qwen3_dir) -> None:
    """Same weights and tokenizer, one chat format per family: one identity and chain each."""
    roots = set()
    for name in sorted(FAMILIES):
        d = _with_template(tiny_qwen3_dir, tmp_path / name, name)
        roots.add(ServedModel.load("m", d, block_size=16).root_hash("default", ""))
    assert len(roots) == len(FAMILIES)


def test_mixtral_puts_the_system_message_before_the_first_user_turn(tiny_mixtral_dir,
                                                                    tmp_path) -> None:
    d = _with_template(tiny_mixtral_dir, tmp_path / "m", "mixtral")
    model = ServedModel.load("m", d, block_size=16)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    text = model.chat_template.render(CHATS["system-first"])
    assert text.startswith(f"{cfg['bos_token']}[INST] You answer in one word.\n\nCapital of France? [/INST]")
    assert text.count("[INST]") == 2 and text.count(cfg["eos_token"]) == 1
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        model.encode_messages([USER, USER])


def test_gpt_oss_sends_the_system_message_as_a_developer_turn(tiny_gpt_oss_dir, tmp_path) -> None:
    d = _with_template(tiny_gpt_oss_dir, tmp_path / "g", "gpt_oss")
    text = ServedModel.load("g", d, block_size=16).chat_template.render(CHATS["system-first"])
    assert "<|start|>developer<|message|># Instructions\n\nYou answer in one word.<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>" in text
    assert text.endswith("<|start|>user<|message|>And of Italy?<|end|><|start|>assistant")
