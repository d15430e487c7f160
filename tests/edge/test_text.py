"""TextCodec on a tiny tokenizer made in the test: chat template, streaming decode."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specsplit.edge.text import TextCodec

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path):
    # Byte-level BPE with no merges: every byte is a token, so multi-byte characters span tokens.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_encode_decode_roundtrip(model_dir):
    codec = TextCodec(model_dir)
    assert codec.decode(codec.encode("def f(x): return x * 2")) == "def f(x): return x * 2"


@pytest.mark.parametrize("where", ["inline", "jinja_file"])
def test_chat_prompt_renders_the_models_template(model_dir, where):
    if where == "inline":
        (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    else:
        (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    codec = TextCodec(model_dir)
    ids = codec.chat_prompt("hi")
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == codec.encode(expected)
    assert codec.tokenizer.token_to_id("<|im_start|>") in ids  # special tokens stay whole


def test_chat_prompt_without_template_is_an_error(model_dir):
    with pytest.raises(ValueError, match="no chat template"):
        TextCodec(model_dir).chat_prompt("hi")


def test_stream_holds_back_split_characters(model_dir):
    codec = TextCodec(model_dir)
    text = "añ€😀b"
    ids = codec.encode(text)
    assert len(ids) > len(text)  # multi-byte characters take several tokens
    stream = codec.stream()
    deltas = [stream.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-ids"):
        TextCodec(tmp_path)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # reach object's subclasses
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",  # reach a module's globals
        "{% set xs = [] %}{{ xs.append(1) }}",  # mutate a value (immutable sandbox)
    ],
)
def test_chat_template_cannot_reach_python_internals(model_dir, template):
    (model_dir / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError, match="unsafe operation"):
        TextCodec(model_dir).chat_prompt("hi")


def test_chat_template_can_reject_input_with_raise_exception(model_dir):
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    (model_dir / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError, match="chat template failed: system first"):
        TextCodec(model_dir).chat_prompt("hi")
    assert TextCodec(model_dir).chat_prompt("hi", system="be brief") == []


def test_chat_template_has_loop_controls_and_tojson(model_dir):
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}"
    )
    (model_dir / "chat_template.jinja").write_text(template)
    codec = TextCodec(model_dir)
    assert codec.chat_prompt("<é>", system="skipped") == codec.encode('"<é>"')


def test_the_cli_loads_a_tokenizer_for_text_prompts_only(model_dir):
    """Text in, text out; token ids in, token ids out on every route: no tokenizer is loaded
    for --prompt-ids even where the draft has one (edge.cli._codec)."""
    from argparse import Namespace

    from specsplit.edge.cli import _codec

    assert _codec(Namespace(prompt=None), model_dir) is None
    assert isinstance(_codec(Namespace(prompt="hi"), model_dir), TextCodec)
    with pytest.raises(ValueError, match="--prompt-ids"):
        _codec(Namespace(prompt="hi"), model_dir / "elsewhere")
