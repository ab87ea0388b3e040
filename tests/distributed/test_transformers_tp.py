"""Tensor parallelism through the transformers backend on the CPU (ranks in separate processes
over gloo): each rank holds its share of the text model's attention heads and MLP columns, as
the architecture's transformers plan splits them, and the greedy tokens equal transformers'
own `generate`, batched, from the prefix cache, and chunked through images."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch import nn

from tests.models.hf_tiny import FLAT_IMAGES, NEEDS_TORCHVISION, build_tiny
from tests.models.test_transformers_backend import HAS_TORCHVISION, Reference, _prompts, _run
from vlmserve import LLM
from vlmserve.layers.tensor_parallel import RowParallelLinear
from vlmserve.models.transformers_parallel import shard_text_model

KW = dict(model_impl="transformers", dtype="float32", device="cpu")


def _marks(name: str) -> list:
    return [pytest.mark.skipif(name in NEEDS_TORCHVISION and not HAS_TORCHVISION,
                               reason="its processor needs torchvision")]


def _archs(*names: str) -> list:
    return [pytest.param(n, marks=_marks(n)) for n in names]


# what each brings (a plain qwen2 text, InternVL's, is split four ways below): sliding and
# full layers, q/k norms, images read both ways (Gemma 3); layers of two head sizes and KV
# heads, shared KV, per-layer inputs (Gemma 4); experts split by their intermediate columns
# beside a split shared expert, chunked attention (Llama 4); a fused gate/up the plan leaves
# whole, mRoPE (GLM-4V)
@pytest.mark.parametrize("name", _archs("gemma3", "gemma4", "llama4", "glm4v"))
def test_tp2_matches_transformers(name, vlmserve_cache, tmp_path):
    path = str(build_tiny(name, tmp_path / name))
    ref = Reference(path, flat=name in FLAT_IMAGES)
    llm = LLM(path, tensor_parallel_size=2, enable_prefix_caching=True, **KW)
    try:
        model = llm.engine.core.executor.runner.model
        attn = model.text_model.layers[0].self_attn
        assert attn.q_proj.out_features == 2 * attn.head_dim  # 4 heads split over 2
        assert model.kv_heads == 1  # 2 KV heads (Gemma 4's full layers: 1, on both ranks)
        assert isinstance(attn.o_proj, RowParallelLinear)
        vocab = model.embedding.num_embeddings  # each rank's rows of the vocabulary
        assert model.embedding.weight.shape[0] == -(-vocab // 2)
        assert model.lm_head.weight.shape[0] == -(-model.lm_head.vocab_size // 2)
        if name == "llama4":  # every expert's intermediate columns split (gate and up each)
            (experts,) = [layer.feed_forward.experts for layer in model.text_model.layers
                          if hasattr(layer.feed_forward, "experts")][:1]
            full = model.text_config.intermediate_size
            assert experts.gate_up_proj.shape[-1] == full and experts.down_proj.shape[-2] == (
                full // 2)
        prompts = _prompts(llm, name)
        expected = [ref.generate(p, imgs) for p, imgs in prompts]
        assert _run(llm, prompts) == expected
        assert _run(llm, prompts[1:]) == expected[1:]  # cached prefixes and images
        assert llm.engine.get_stats()["prefix_cache_hit_tokens"] > 0
        processed = [llm.engine.input_processor.process(
            {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p)
            for p, imgs in prompts]
        longest = max(f.length for pp in processed for f in pp.images)
        whole = llm.engine.core.scheduler.whole_images
    finally:
        llm.engine.shutdown()
    # chunks that cut through images (or end right before one the model reads both ways)
    budget = longest if whole else max(longest // 4, 8)
    chunked = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=budget, max_num_seqs=2,
                  **KW)
    try:
        assert _run(chunked, prompts) == expected, f"chunked at {budget}"
    finally:
        chunked.engine.shutdown()


@pytest.mark.parametrize("name", _archs("internvl"))
def test_tp4_replicates_kv_heads(name, vlmserve_cache, tmp_path):
    """2 KV heads over 4 ranks: each rank holds the one its 1 query head reads."""
    path = str(build_tiny(name, tmp_path / name))
    ref = Reference(path)
    llm = LLM(path, tensor_parallel_size=4, **KW)
    try:
        model = llm.engine.core.executor.runner.model
        attn = model.text_model.layers[0].self_attn
        assert (attn.q_proj.out_features, attn.k_proj.out_features) == (16, 16)
        prompts = _prompts(llm, name)
        assert _run(llm, prompts) == [ref.generate(p, imgs) for p, imgs in prompts]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name,kw,line", [pytest.param(*case, marks=_marks(case[0])) for case in [
    ("lfm2_vl", {}, "does not split the attention heads"),
    ("internvl", {"mm_encoder_tp_mode": "weights"}, "needs a native model"),
    ("llama4", {"enable_expert_parallel": True}, "expert parallelism needs a native model"),
    ("internvl", {"tensor_parallel_size": 3}, "must divide layer 0's 4 attention heads"),
]])
def test_refused_in_one_line_before_ranks_start(name, kw, line, vlmserve_cache, tmp_path,
                                                monkeypatch):
    from vlmserve.distributed import ranks

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(ranks.Followers, "__init__", no_ranks)
    path = str(build_tiny(name, tmp_path / name))
    with pytest.raises(ValueError, match=line) as e:
        LLM(path, **{"tensor_parallel_size": 2, **KW, **kw})
    assert "\n" not in str(e.value)


class _Group:
    """A `TensorParallel` of rank ``rank`` of 2 whose all-reduce adds the other rank's part
    (given beforehand): the collective without processes."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank, self.other = rank, None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.other


def test_shard_splits_heads_columns_and_adds_a_rowwise_bias_once():
    """Two ranks' shares of a planned attention and MLP (with biases) sum to the whole."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1)
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(config, 0)
    layer.self_attn.o_proj.bias = nn.Parameter(torch.randn(32))
    text = nn.Module()
    text.layers = nn.ModuleList([layer])
    shares = []
    for rank in range(2):
        copy = deepcopy(text)
        assert shard_text_model(copy, config, _Group(rank)) == 7
        shares.append(copy.layers[0])
    x = torch.randn(5, 32)
    a, b = (s.self_attn for s in shares)
    assert a.q_proj.weight.shape == (16, 32) and a.k_proj.weight.shape == (8, 32)
    assert torch.equal(torch.cat([a.k_proj.weight, b.k_proj.weight]),
                       layer.self_attn.k_proj.weight)
    h = torch.randn(5, 32)  # attention outputs: each rank's o_proj reads its heads' columns
    a.o_proj.tp.other = torch.nn.functional.linear(h[:, 16:], b.o_proj.weight)
    torch.testing.assert_close(a.o_proj(h[:, :16]), layer.self_attn.o_proj(h))
    m0, m1 = (s.mlp for s in shares)
    part1 = torch.nn.functional.linear(m1.act_fn(m1.gate_proj(x)) * m1.up_proj(x),
                                       m1.down_proj.weight)
    m0.down_proj.tp.other = part1
    torch.testing.assert_close(m0(x), layer.mlp(x))


class _Alone:
    """A `TensorParallel` of rank ``rank`` of 2 whose collectives leave the other rank's
    part zero: two ranks' results sum to what the collectives would give."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, parts: list[torch.Tensor], local: torch.Tensor) -> None:
        for i, part in enumerate(parts):
            part.copy_(local if i == self.rank else torch.zeros_like(local))


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_vocabulary_split_into_two_ranks_rows(family):
    """Each rank keeps its rows of the embedding and lm_head (a vocabulary of 101: the last
    rank's padded): the ranks' lookups (Gemma's scaled) and logits sum to the whole model's;
    a tied lm_head stays tied to its rank's embedding rows; an lm_head with a bias is left
    whole, and the embedding with it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    from vlmserve.models.transformers_parallel import split_vocabulary

    small = dict(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    model = (Gemma3ForCausalLM(Gemma3TextConfig(**small)) if family == "gemma3" else
             Qwen2ForCausalLM(Qwen2Config(**small, tie_word_embeddings=False))).eval()
    ids, hidden = torch.arange(101), torch.randn(3, 16)
    with torch.no_grad():
        embeds, logits = model.get_input_embeddings()(ids), model.lm_head(hidden)
        ranks = []
        for rank in range(2):
            copy = deepcopy(model)
            assert split_vocabulary(copy, _Alone(rank))
            emb, head = copy.get_input_embeddings(), copy.get_output_embeddings()
            assert emb.weight.shape == (51, 16) and (head.weight is emb.weight) == (
                family == "gemma3")
            ranks.append((emb(ids), head(hidden)))
    torch.testing.assert_close(ranks[0][0] + ranks[1][0], embeds)
    torch.testing.assert_close(ranks[0][1] + ranks[1][1], logits)
    model.lm_head.bias = nn.Parameter(torch.zeros(101))
    embedding = model.get_input_embeddings()
    assert not split_vocabulary(model, _Alone(0)) and model.get_input_embeddings() is embedding


def test_image_codes_embedded_as_text_keep_the_vocabulary_whole():
    """Chameleon's image features are its text embedding's rows (its encoder step may run on
    one rank alone, without the others' all-reduce): its vocabulary is not split."""
    from transformers import (
        ChameleonConfig,
        ChameleonForConditionalGeneration,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
    )

    from vlmserve.models.transformers_parallel import _features_embed_tokens, split_vocabulary

    small = dict(num_hidden_layers=1)
    with torch.device("meta"):
        chameleon = ChameleonForConditionalGeneration(
            ChameleonConfig(**small, vocabulary_map={"<image>": 3}))
        gemma3 = Gemma3ForConditionalGeneration(Gemma3Config(text_config=small))
    assert _features_embed_tokens(chameleon) and not _features_embed_tokens(gemma3)
    embedding = chameleon.get_input_embeddings()
    assert not split_vocabulary(chameleon, _Alone(0))
    assert chameleon.get_input_embeddings() is embedding
