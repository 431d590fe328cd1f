"""Tiny random-weight Hugging Face model directories, written by
`transformers` itself, for comparing ringserve's models with the reference.

Each function writes `<tmp>/<name>/` (config.json + float32 safetensors) from
a fixed seed and returns the path; the same call always writes the same
weights. Beyond the library's own init, every norm weight is drawn around 1
and every bias around 0, so a norm or bias that is skipped or misplaced shows
in the logits. `initializer_range` is large (0.15) and the output matrix is
scaled by HEAD_GAIN, so logit margins are healthy and greedy decoding is
stable.

    llama_gqa     Llama, 4 layers, hidden 64, 4 heads / 2 KV heads (GQA),
                  vocab 512, untied head, rope_theta 50000; optionally
                  Llama-3 rope scaling with original context 256, so the
                  three frequency bands all occur. Saved SHARDED (about 200
                  KB shards with an index) and with a byte-level BPE
                  tokenizer (vocab 512) and a chat template.
    qwen2_tied    Qwen2, 3 layers, hidden 96, 4 heads / 2 KV heads
                  (head_dim 24), q/k/v biases, tied embeddings, vocab 384.
    qwen3_qknorm  Qwen3, 2 layers, hidden 64, head_dim 32 (q width 128 is
                  not hidden), 4 heads / 2 KV heads, q/k RMSNorm, vocab 256.
    llama_deep    Llama, 8 layers, hidden 64, 4 heads / 2 KV heads, vocab
                  256: deep enough for the memory planner to split unevenly.
    bigcode_mqa   GPT-BigCode, 3 layers, n_embd 64, 4 heads, multi-query,
                  n_inner 160, gelu_pytorch_tanh, vocab 320.
    llama_100m    Llama, 8 layers, hidden 1024, 16 heads / 8 KV heads,
                  intermediate 2816, vocab 8192, untied: about 111M
                  parameters, for benchmarks (bench/roofline.py), not tests.
    llama_copy    A Llama whose greedy continuation of a token is, mostly, a
                  fixed successor of it (a random permutation): the token
                  embeddings dominate the residual stream and the head maps
                  each token's embedding to its successor's logit. So a text
                  the model wrote, given again in a prompt, is what its
                  answer repeats (as summaries and edits repeat their
                  source), while a random prompt's answer is new text. The
                  layers still run and perturb the logits. Sizes are the
                  caller's: tiny for tests, `copy_100m` for benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ringserve.models.builtin import write_tokenizer

INIT_RANGE = 0.15
# The output matrix (lm_head, or the embedding when tied) is scaled up further
# so next-token distributions are peaked: mean top-1 probability ~0.3 rather
# than ~0.05, and top-1/top-2 margins far above float32 error.
HEAD_GAIN = 3.0
MAX_POSITIONS = 1024


# Two layers of hidden 64 with grouped KV heads: the shapes of the models
# that vary one thing of their family (a rope scaling, a sliding window);
# the Llamas below have more layers (and one a larger vocabulary).
_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    initializer_range=INIT_RANGE,
)


def llama_gqa(tmp: Path, *, rope_scaling: bool = False) -> Path:
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    cfg = LlamaConfig(
        **{**_SMALL, "vocab_size": 512, "num_hidden_layers": 4},
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    name = "llama_gqa_llama3" if rope_scaling else "llama_gqa"
    path = _save(LlamaForCausalLM, cfg, tmp / name, seed=11, shard=True)
    write_tokenizer(path, vocab_size=512, model_max_length=MAX_POSITIONS)
    return path


def qwen2_rope(tmp: Path, rope: dict) -> Path:
    """Qwen2 with the rope parameters `rope` (a scaling's type and terms)."""
    cfg = Qwen2Config(rope_parameters={"rope_theta": 10000.0, **rope}, **_SMALL)
    return _save(Qwen2ForCausalLM, cfg, tmp / f"qwen2_{rope['rope_type']}", seed=17)


def llama_deep(tmp: Path) -> Path:
    """An 8-layer Llama (otherwise tiny), deep enough for an uneven plan."""
    cfg = LlamaConfig(
        **{**_SMALL, "num_hidden_layers": 8},
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    return _save(LlamaForCausalLM, cfg, tmp / "llama_deep", seed=13)


def llama_100m(tmp: Path) -> Path:
    """A Llama of benchmark size (about 111M parameters, 445 MB in float32)."""
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    return _save(LlamaForCausalLM, cfg, tmp / "llama_100m", seed=15)


def llama_copy(
    tmp: Path,
    name: str = "llama_copy",
    *,
    vocab: int = 256,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    embed_std: float = 1.0,
    seed: int = 16,
    scramble: float = 0.0,
) -> Path:
    """A Llama that mostly continues a token with its fixed successor (see
    above); `scramble` of the tokens get another successor (a draft that
    disagrees with its target that often)."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).float().eval()
        embed = model.get_input_embeddings().weight
        embed.normal_(0.0, embed_std)
        unit = embed / embed.norm(dim=-1, keepdim=True)
        # the successor map depends on the seed and the vocabulary only, so a
        # smaller model of the same seed (a draft) continues text the same way
        successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        if scramble > 0:
            other = torch.Generator().manual_seed(seed + 1)
            moved = torch.rand(vocab, generator=other) < scramble
            successor[moved] = successor[moved][torch.randperm(int(moved.sum()), generator=other)]
        head = model.get_output_embeddings().weight
        head.zero_()
        head[successor] = unit * (4.0 * hidden**0.5)
    path = tmp / name
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="1GB")
    return path


def copy_100m(tmp: Path) -> Path:
    """`llama_copy` at `llama_100m`'s size (about 111M parameters)."""
    return llama_copy(
        tmp,
        "copy_100m",
        vocab=8192,
        hidden=1024,
        intermediate=2816,
        layers=8,
        heads=16,
        kv_heads=8,
        embed_std=0.2,  # the layers still move some logits: not every step follows
        seed=15,
    )


def copy_draft(tmp: Path) -> Path:
    """A draft for `copy_100m`: its vocabulary and, for 80% of the tokens,
    its successor map; 2 layers of hidden 256 (about 5M parameters, most of
    them the embeddings)."""
    return llama_copy(
        tmp,
        "copy_draft",
        vocab=8192,
        hidden=256,
        intermediate=512,
        layers=2,
        heads=4,
        kv_heads=2,
        embed_std=0.2,
        seed=15,
        scramble=0.2,
    )


def qwen2_tied(tmp: Path) -> Path:
    cfg = Qwen2Config(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
    )
    return _save(Qwen2ForCausalLM, cfg, tmp / "qwen2_tied", seed=12)


def qwen3_qknorm(tmp: Path) -> Path:
    cfg = Qwen3Config(
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        tie_word_embeddings=False,
        **_SMALL,
    )
    return _save(Qwen3ForCausalLM, cfg, tmp / "qwen3_qknorm", seed=13)


def bigcode_mqa(tmp: Path) -> Path:
    return _bigcode(
        tmp / "bigcode_mqa", layers=3, seed=14, multi_query=True, bos_token_id=0, eos_token_id=0
    )


def bigcode_untied(tmp: Path) -> Path:
    """GPT-BigCode with its own head (`lm_head.weight`), not the embedding."""
    return _bigcode(tmp / "bigcode_untied", multi_query=True, tie_word_embeddings=False)


def bigcode_mha(tmp: Path) -> Path:
    """GPT-BigCode without multi-query: a K and V head per query head, its
    c_attn rows laid out head by head."""
    return _bigcode(tmp / "bigcode_mha", multi_query=False, tie_word_embeddings=True)


def _bigcode(path: Path, *, layers: int = 2, seed: int = 15, **options: object) -> Path:
    cfg = GPTBigCodeConfig(
        vocab_size=320,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_inner=160,
        n_positions=MAX_POSITIONS,
        activation_function="gelu_pytorch_tanh",
        initializer_range=INIT_RANGE,
        **options,
    )
    return _save(GPTBigCodeForCausalLM, cfg, path, seed=seed)


def mistral_window(tmp: Path, window: int) -> Path:
    """Mistral whose every layer attends to a sliding window of `window`."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = MistralConfig(sliding_window=window, rope_parameters=rope, **_SMALL)
    return _save(MistralForCausalLM, cfg, tmp / "mistral_window", seed=16)


def _save(model_cls: type, cfg: object, path: Path, *, seed: int, shard: bool = False) -> Path:
    # fork_rng: the caller's global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg).float().eval()
        _perturb_norms_and_biases(model)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(HEAD_GAIN)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="200KB" if shard else "1GB")
    return path


@torch.no_grad()
def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        is_norm = "norm" in name or ".ln_" in name
        if is_norm and name.endswith(".weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn_like(param))


def _llama3_scaled(tmp: Path) -> Path:
    return llama_gqa(tmp, rope_scaling=True)


# every family the engine serves, as the equality tests build them
FAMILIES = {
    "llama_gqa": llama_gqa,
    "llama3_rope_scaling": _llama3_scaled,
    "qwen2_tied": qwen2_tied,
    "qwen3_qknorm": qwen3_qknorm,
    "bigcode_mqa": bigcode_mqa,
}
