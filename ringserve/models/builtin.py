"""The built-in model: a small Llama-architecture model with random weights
and a byte-level BPE tokenizer, so ringserve serves something with no model
downloaded.

It is generated deterministically (fixed seed, fixed training text) into
`$RINGSERVE_CACHE_DIR/<BUILTIN_VERSION>` (default `~/.cache/ringserve`) in
Hugging Face format on first use, and reused afterwards. Several processes
may race to create it: each writes a private temporary directory and renames
it into place, so the directory, once present, is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ringserve.config import UserError
from ringserve.config import cache_dir as default_cache_dir
from ringserve.models.builtin_text import CORPUS

log = structlog.get_logger(__name__)

# Bump whenever anything below changes what is generated.
BUILTIN_VERSION = "builtin-llama-v2"  # v2: a chat template with tools, in the Hermes manner
SEED = 1234
BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)  # ids 0..3 in that order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ARCH = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
# Output-matrix scale: final-normed states have unit RMS, so logits have a
# standard deviation of about sqrt(hidden) * this, ~6.4: peaked next-token
# distributions whose greedy choice is stable under bf16 rounding.
_HEAD_STD = 0.4


def builtin_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The built-in model's directory (under `config.cache_dir()` unless
    given), generating it on first use; UserError when it cannot be
    written there, naming the place and what to set."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / BUILTIN_VERSION
    if (final / "config.json").is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_VERSION}.", dir=root))
    except OSError as exc:
        raise UserError(
            f"cannot write the built-in model into {root} ({exc.strerror}): set "
            "RINGSERVE_CACHE_DIR (or XDG_CACHE_HOME) to a writable directory"
        ) from None
    try:
        write_builtin_model(tmp)
        os.rename(tmp, final)
        log.info("builtin.created", path=str(final))
    except OSError:
        # Another process renamed its copy into place first: use that one.
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_builtin_model(model_dir: Path) -> None:
    """Write every file of the built-in model into an existing directory."""
    vocab = write_tokenizer(model_dir, 2048, _ARCH["max_position_embeddings"])
    config = builtin_config(vocab)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {"bos_token_id": 0, "eos_token_id": [1, 3], "do_sample": False}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(builtin_weights(config), str(model_dir / "model.safetensors"), {"format": "pt"})


def builtin_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **_ARCH,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def builtin_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Random weights from a fixed seed, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(SEED)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # Fan-in scaled, so each block's update is comparable to the residual.
        tensors[p + "self_attn.q_proj.weight"] = normal(q, hidden, hidden**-0.5)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, hidden, hidden**-0.5)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, hidden, hidden**-0.5)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q, q**-0.5)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden, hidden**-0.5)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden, hidden**-0.5)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter, inter**-0.5)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(config["vocab_size"], hidden, _HEAD_STD)
    return tensors


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the fixed built-in text: deterministic, so
    the same vocab_size always gives the same tokenizer. Encoding prepends
    BOS, as Llama tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def write_tokenizer(model_dir: Path, vocab_size: int, model_max_length: int = 2048) -> int:
    """Write tokenizer.json and tokenizer_config.json (with the chat
    template); returns the trained vocabulary size."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()
