"""Qwen3.5 and Qwen3.5-MoE (models/qwen3_5.py) run directly, without the engine: a text prompt
from fresh states then greedy decodes, equal to transformers' logits and `generate`; the
prompt in chunks equal to it at once; the checkpoint's MTP weights kept."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from vlmserve.layers.attention import build_attention_metadata
from vlmserve.layers.linear_metadata import build_linear_metadata
from vlmserve.models.builtin import resolve_model
from vlmserve.models.loader import load_hf_config, load_model

CPU = torch.device("cpu")
BLOCK = 16
MODELS = {"qwen3.5": ("tiny-qwen3.5", "Qwen3_5ForConditionalGeneration"),
          "qwen3.5-moe": ("tiny-qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration")}


class Harness:
    """One sequence through the model: its full-attention layers' KV in blocks 0.., its
    linear layers' states at slot 1 of 3."""

    def __init__(self, model) -> None:
        self.model = model
        conv, ssm = model.linear_state_shapes()
        self.caches = [torch.zeros(model.kv_cache_shape(8, BLOCK)) if kind == "full_attention"
                       else (torch.zeros(3, *conv), torch.zeros(3, *ssm))
                       for kind in model.language_model.layer_types]
        self.done = 0
        self.kernel = conv[0] + 1

    @torch.no_grad()
    def step(self, ids: list[int]) -> torch.Tensor:
        """The next tokens of the sequence -> their logits."""
        n, end = len(ids), self.done + len(ids)
        meta = build_attention_metadata([n], [end], [list(range(-(-end // BLOCK)))], BLOCK, CPU)
        meta.linear = build_linear_metadata([n], [1], [self.done > 0], self.kernel, CPU)
        pos = torch.arange(self.done, end)[None].expand(3, -1)
        hidden = self.model(self.model.embed_tokens(torch.tensor(ids)), pos, self.caches, meta)
        self.done = end
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, vlmserve_cache):
    import transformers

    name, arch = MODELS[request.param]
    path = resolve_model(name)
    ours = load_model(path, load_hf_config(path), torch.float32, CPU).eval()
    theirs = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    return path, ours, theirs


PROMPT = [(i * 37) % 300 + 5 for i in range(70)]


def test_layers_of_both_kinds(pair):
    _, ours, _ = pair
    assert [k.kind for k in ours.layer_kinds] == ["linear", "full", "linear"]


@torch.no_grad()
def test_a_prompt_then_decodes_equal_transformers(pair):
    _, ours, theirs = pair
    ids = torch.tensor([PROMPT])
    harness = Harness(ours)
    logits = harness.step(PROMPT)
    torch.testing.assert_close(logits, theirs(input_ids=ids).logits[0], rtol=1e-3, atol=2e-3)
    want = theirs.generate(input_ids=ids, max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    got = [int(logits[-1].argmax())]
    while len(got) < 12:
        got.append(int(harness.step([got[-1]])[-1].argmax()))
    assert got == want


@torch.no_grad()
def test_the_prompt_in_chunks_equals_it_at_once(pair):
    """Chunks of 3, 1, 50, 16 tokens carry the linear layers' states (and the KV)."""
    _, ours, _ = pair
    whole = Harness(ours).step(PROMPT)
    harness, parts, at = Harness(ours), [], 0
    for n in (3, 1, 50, 16):
        parts.append(harness.step(PROMPT[at:at + n]))
        at += n
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-3, atol=1e-3)


def test_mtp_weights_are_loaded_and_kept(pair, tmp_path):
    path, _, _ = pair
    folder = tmp_path / "with-mtp"
    shutil.copytree(path, folder)
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(256, 64)}
    save_file(mtp, str(folder / "model-mtp.safetensors"))
    model = load_model(folder, load_hf_config(folder), torch.float32, CPU)
    kept = model.mtp.tensors()
    assert kept.keys() == {n[len("mtp."):] for n in mtp}
    for name, tensor in mtp.items():
        assert torch.equal(kept[name[len("mtp."):]], tensor)

