"""bfloat16 matmul weights packed into oneDNN's layout: the same bits as
F.linear on the plain weight, every family's matmul weights packed (and the
tied head left plain), the engine packing them where it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringserve import LLM, SamplingParams
from ringserve.cache.pool import KVPool
from ringserve.kernels import packed_linear
from ringserve.kernels.batch import ForwardBatch
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model
from tests import model_factory

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("biased", [False, True])
def test_a_packed_weight_gives_the_plain_matmul_bit_for_bit(rows, biased):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(259, 100, generator=gen).to(torch.bfloat16)  # no block multiple
    bias = torch.randn(259, generator=gen).to(torch.bfloat16) if biased else None
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    packed = packed_linear.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    got = packed_linear.linear(x, packed, bias)
    assert torch.equal(got, F.linear(x, weight, bias))
    assert torch.equal(packed_linear.linear(x, weight, bias), got)  # a plain weight passes through


def test_only_plain_bfloat16_matrices_on_the_cpu_are_packed():
    bf16 = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert packed_linear.can_pack(bf16)
    assert not packed_linear.can_pack(bf16.float())
    assert not packed_linear.can_pack(torch.zeros(16, dtype=torch.bfloat16))
    assert not packed_linear.can_pack(packed_linear.pack(bf16))


def _forward(model, cfg: ModelConfig, prompt: list[int]) -> torch.Tensor:
    pool = KVPool(cfg.num_layers, len(prompt) + 1, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    batch = ForwardBatch.build([list(range(1, len(prompt) + 1))], [len(prompt)], [True])
    with torch.inference_mode():
        return model.logits(model(torch.tensor(prompt), batch, pool)[batch.sample_rows])


@pytest.mark.parametrize(
    "make,packs_head",
    [
        (model_factory.llama_gqa, True),
        (model_factory.qwen2_tied, False),  # the head is the embedding: it stays plain
        (model_factory.bigcode_mqa, False),  # one stage holds both: the head is wte
    ],
    ids=["llama", "qwen2-tied", "bigcode"],
)
def test_packing_a_model_changes_no_logit(tmp_path, make, packs_head):
    path = make(tmp_path)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, range(cfg.num_layers), torch.bfloat16)
    prompt = [3, 17, 5, 9, 11, 2, 30]
    before = _forward(model, cfg, prompt)
    packed = model.pack_linear_weights()
    assert packed == 4 * cfg.num_layers + packs_head
    embeddings = ("embed", "wte", "wpe")
    assert not any(p.is_mkldnn for n, p in model.named_parameters() if n in embeddings)
    assert torch.equal(_forward(model, cfg, prompt), before)
    assert model.pack_linear_weights() == 0  # packed once


@pytest.mark.timeout(240)
def test_the_engine_packs_bfloat16_weights_with_native_kernels_only():
    prompts = [[5, 9, 14, 3], list(range(3, 30))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs, packed = {}, {}
    for dtype, choice in (("bfloat16", "native"), ("bfloat16", "torch"), ("float32", "native")):
        with LLM(dtype=dtype, cpu_kernels=choice, torch_threads=1) as llm:
            model = llm._ring.conductor.stage.runner.model
            packed[dtype, choice] = model.layers[0].qkv.is_mkldnn
            outputs[dtype, choice] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # fmt: skip
    assert packed == {("bfloat16", "native"): True, ("bfloat16", "torch"): False,
                      ("float32", "native"): False}  # fmt: skip
    assert outputs["bfloat16", "native"] == outputs["bfloat16", "torch"]


def test_a_cpu_onednn_cannot_serve_keeps_every_weight_plain(tmp_path, monkeypatch):
    path = model_factory.llama_gqa(tmp_path)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, range(cfg.num_layers), torch.bfloat16)
    prompt = [3, 17, 5, 9]
    before = _forward(model, cfg, prompt)

    def refuse(weight):
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(packed_linear, "pack", refuse)
    assert model.pack_linear_weights() == 0
    assert not any(p.is_mkldnn for p in model.parameters())
    assert torch.equal(_forward(model, cfg, prompt), before)
    monkeypatch.setattr(packed_linear, "_onednn_bf16", lambda: False)
    assert not packed_linear.can_pack(torch.zeros(8, 16, dtype=torch.bfloat16))
