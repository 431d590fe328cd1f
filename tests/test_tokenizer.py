"""Tokenizer: encode/decode as Hugging Face does, streaming detokenisation,
chat template rendering."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from ringserve.models.builtin import write_tokenizer
from ringserve.models.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "The river starts as a thin stream high in the hills.",
    "Héllo wörld — naïve café, 你好世界 🎉🚀 and ünïcödé!",
    "  leading spaces,\ttabs\nand new lines  ",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, how are you?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, vocab_size=1024)
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    loaded = Tokenizer.from_dir(model_dir)
    assert loaded is not None
    return loaded


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = IncrementalDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_encode_and_decode_match_transformers(tok: Tokenizer, model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ids[0] == tok.bos_token_id == 0
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids, skip_special_tokens=False).startswith("<|bos|>")


def test_special_token_ids_come_from_tokenizer_config(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.vocab_size == 1024


def test_streamed_deltas_concatenate_to_the_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    sequences = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(200)]
    for ids in sequences:
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_incomplete_utf8_is_held_back_until_completed(tok: Tokenizer) -> None:
    ids = tok.encode("snow 🎉 falls", add_special_tokens=False)
    deltas = stream(tok, ids)
    # The emoji is four bytes in several byte-level pieces: some pushes emit nothing.
    assert "" in deltas[:-1]
    assert not any("\ufffd" in d for d in deltas)
    assert "🎉" in deltas


def test_stream_ending_mid_character_flushes_the_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]
    assert tok.decode(ids).endswith("\ufffd")
    deltas = stream(tok, ids)
    assert deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == tok.decode(ids)


def test_stream_keeps_spaces_a_decoder_drops_at_the_start_of_a_string() -> None:
    # SentencePiece-style Metaspace decoding strips the leading space of a
    # string: each token must be decoded in the context of the one before.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["the river runs to the sea", "hello world"], trainer=trainer)
    tok = Tokenizer(backend, {}, None)
    ids = tok.encode("the river runs to the world")
    assert tok.decode(ids[1:2]) == "river"  # alone, the space is gone
    assert "".join(stream(tok, ids)) == "the river runs to the world"


def test_special_tokens_are_skipped_in_the_stream(tok: Tokenizer) -> None:
    ids = [tok.backend.token_to_id("<|im_start|>")] + tok.encode("hi", add_special_tokens=False)
    assert "".join(stream(tok, ids)) == "hi"


def test_chat_template_renders_as_transformers_does(tok: Tokenizer, model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    for gen in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt.startswith("<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.encode(prompt, add_special_tokens=False).count(tok.bos_token_id) == 1


def test_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_template_is_sandboxed(tmp_path: Path, model_dir: Path) -> None:
    _copy_with_config(model_dir, tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template rejected"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)


def test_model_without_chat_template_says_so(tmp_path: Path, model_dir: Path) -> None:
    _copy_with_config(model_dir, tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)


def test_added_token_dicts_and_template_lists_are_understood(
    tmp_path: Path, model_dir: Path
) -> None:
    _copy_with_config(
        model_dir,
        tmp_path,
        eos_token={"content": "<|im_end|>", "__type": "AddedToken"},
        chat_template=[{"name": "default", "template": "{{ eos_token }}"}],
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == 3
    assert tok.apply_chat_template(MESSAGES) == "<|im_end|>"


def test_directory_without_tokenizer_json_gives_none(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None


def _copy_with_config(src: Path, dst: Path, **changes: object) -> None:
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))


# What real templates lean on: tools and documents defined (as None) when not
# given, `{% generation %}`, tojson's sort_keys, message keys left out when
# None, the reasoning under each of its names.
FEATURES = (
    "{% if tools is not none %}[T{{ tools | tojson(sort_keys=True) }}]{% endif %}"
    "{% if documents is none %}(no docs){% endif %}"
    "{% for m in messages %}<{{ m.role }}:{{ m.content }}"
    "{% if 'tool_calls' in m %} calls {{ m.tool_calls | length }}{% endif %}"
    "{% if m.reasoning_content %} why {{ m.reasoning_content }}{% endif %}>"
    "{% if m.role == 'assistant' %}{% generation %}!{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant:{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CONVERSATIONS = [
    MESSAGES,
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "tool_calls": None, "reasoning": "sum"},
        {"role": "user", "content": None},
    ],
]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_template_features_render_as_transformers_does(
    tmp_path: Path, model_dir: Path, tools: list | None
) -> None:
    _copy_with_config(model_dir, tmp_path, chat_template=FEATURES)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS:
        extra = {} if tools is None else {"tools": tools}
        want = hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert ours.apply_chat_template(messages, True, extra) == want


def test_the_template_file_and_the_tool_use_template_are_hugging_faces_choices(
    tmp_path: Path, model_dir: Path
) -> None:
    named = [
        {"name": "default", "template": "DEFAULT"},
        {"name": "tool_use", "template": "TOOL_USE"},
    ]
    _copy_with_config(model_dir, tmp_path, chat_template=named)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, True, {"tools": tools}) == want
    (tmp_path / "chat_template.jinja").write_text("FROM_FILE")
    _copy_with_config(model_dir, tmp_path, chat_template="FROM_CONFIG")
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False)


def _byte_fallback_dir(path: Path) -> Path:
    """A Llama 2 / Mistral style tokenizer: pieces with Metaspace, and bytes
    the vocabulary lacks as <0xNN> tokens, decoded by ByteFallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(["▁", "H", "i", "o", "k", "▁H"])}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=[("▁", "H")], byte_fallback=True, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_a_byte_fallback_stream_and_its_whole_text_agree(tmp_path: Path) -> None:
    """A character followed by a cut one: the decoder shows the whole run
    as U+FFFD once the cut byte arrives; the stream keeps what it showed,
    and the text of the whole output is the streamed one."""
    from ringserve.engine.textstream import TextStream

    tok = Tokenizer.from_dir(_byte_fallback_dir(tmp_path))
    byte = [tok.backend.token_to_id(f"<0x{b:02X}>") for b in (0xF0, 0x9F, 0x98, 0x80, 0xF0, 0x9F)]
    ids = tok.encode("Hi", add_special_tokens=False) + byte
    streamed = "".join(stream(tok, ids))
    assert streamed.startswith("Hi😀") and streamed.endswith("\ufffd")
    for stops in ((), ("zz",)):
        whole = TextStream(tok, stops, incremental=False)
        for t in ids:
            whole.push(t)
        whole.finish()
        assert whole.text == streamed
    ok = tok.encode("Hi", add_special_tokens=False) + byte[:4]  # no cut: the decode itself
    assert "".join(stream(tok, ok)) == tok.decode(ok) == "Hi😀"
