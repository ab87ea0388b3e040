"""Tensor parallelism for the transformers backend: the text model split as its transformers
config's tensor-parallel plan (`base_model_tp_plan`) says, with the engine's collectives.

A "colwise" projection keeps this rank's output rows: its share of the query heads, of the
key/value heads (each head whole on ``world / kv`` ranks when there are fewer KV heads than
ranks, the one its queries read), of the MLP's intermediate columns; a "packed_colwise" one
(gate and up fused) its share of each half. A "rowwise" projection keeps the matching input
columns and all-reduces its product, its bias added once after the sum (the native models'
`layers.tensor_parallel.RowParallelLinear`). A fused experts module the plan splits
("moe_tp_experts", Llama 4's) keeps each expert's share of its intermediate columns and
all-reduces its output. Entries whose module takes its input whole and gives its output
whole (gathered outputs, split inputs, replicated norms) are served as one unsplit module on
every rank: exact, with more memory than a split. So is everything outside the text model's
layers, the vision tower and projector, but for the token embedding and lm_head, which keep
this rank's rows of the vocabulary as the native models' do (`split_vocabulary`).

A plan that does not split the attention heads, or holds a style whose output would be left
split for a consumer this module does not know, is refused in one line before any rank starts
(`check_tensor_parallel`)."""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.tensor_parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from vlmserve.utils import to_device

# styles whose module reads its input whole and leaves its output whole under transformers'
# own tensor parallelism: here the module runs unsplit on every rank
_WHOLE = frozenset({"colwise_gather_output", "rowwise_split_input",
                    "replicated_with_grad_allreduce", "embedding_rowwise", "sequence_parallel",
                    "gather", "ep_router", "moe_tp_experts"})
# styles under which a whole subtree (the experts' weights) is the parent's business: split
# by `_split_experts`, or whole
_SUBTREE = frozenset({"moe_tp_experts"})
_SPLIT = frozenset({"colwise", "rowwise", "packed_colwise"})


def plan_of(text_config) -> dict[str, str]:
    return dict(getattr(text_config, "base_model_tp_plan", None) or {})


def _pattern(key: str) -> re.Pattern:
    """A plan key (``layers.*.self_attn.q_proj``) as a pattern of module names inside the
    text model (its layers may sit under a prefix, BLIP-2's ``decoder.``)."""
    return re.compile(r"(?:.*\.)?" + re.escape(key).replace(r"\*", r"\d+"))


def check_tensor_parallel(hf_config, world: int, vision_weights: bool = False) -> None:
    """Refuse, in one line, a model whose text model this module cannot split over ``world``
    ranks: no plan, a plan that leaves the attention heads whole, a style it does not know,
    a layer whose attention heads or split MLP columns ``world`` does not divide, or whose KV
    heads it neither divides nor is a multiple of."""
    from vlmserve.models.transformers_families import layer_configs, text_config

    name = hf_config.model_type
    if vision_weights:
        raise ValueError(f"{name}: mm_encoder_tp_mode='weights' needs a native model; the "
                         "transformers backend replicates the vision tower (mode 'data' "
                         "splits the images)")
    plan = plan_of(text_config(hf_config))
    styles = {k.rsplit(".", 1)[-1]: v for k, v in plan.items()}
    if not (styles.get("q_proj") == styles.get("k_proj") == "colwise"
            and styles.get("o_proj") == "rowwise"):
        raise ValueError(f"{name}: its transformers config's tensor-parallel plan "
                         f"({plan or 'none'}) does not split the attention heads; "
                         "tensor_parallel_size needs one that does (or a native model)")
    for i, c in enumerate(layer_configs(hf_config)):
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        inter = getattr(c, "intermediate_size", None) if styles.get("down_proj") == "rowwise" \
            else None
        if heads % world or (kv % world and world % kv) or (inter or 0) % world:
            raise ValueError(f"{name}: tensor_parallel_size={world} must divide layer {i}'s "
                             f"{heads} attention heads and {inter or 'unsplit'} MLP columns, "
                             f"and divide or be a multiple of its {kv} KV heads")
    unknown = sorted({v for v in plan.values()} - _WHOLE - _SPLIT - {"packed_rowwise",
                                                                     "local_colwise",
                                                                     "local_rowwise"})
    if unknown:
        raise ValueError(f"{name}: tensor-parallel style(s) {unknown} of its transformers "
                         "plan are not supported by the transformers backend")


def shard_text_model(text_model: nn.Module, text_config, tp: TensorParallel) -> int:
    """Split ``text_model``'s planned projections (weights on the host, whole) to this rank's
    share, in place; returns how many were split. A split style on a module that is not an
    ``nn.Linear`` (experts' packed weights), outside a subtree that reduces its own sum,
    raises."""
    plan = [(_pattern(k), v) for k, v in plan_of(text_config).items()]
    whole_trees: list[str] = []
    split = 0
    for name, module in list(text_model.named_modules()):
        style = next((v for p, v in plan if p.fullmatch(name)), None)
        if style is None or any(name.startswith(t + ".") for t in whole_trees):
            continue
        if style in _SUBTREE:  # experts: each one's share of its columns, or all whole
            whole_trees.append(name)
            split += _split_experts(module, name, plan, tp)
            continue
        if style in _WHOLE:
            continue
        if style not in _SPLIT or type(module) is not nn.Linear:
            raise ValueError(f"{text_config.model_type}: {name} ({type(module).__name__}) "
                             f"has tensor-parallel style {style!r}, which the transformers "
                             "backend cannot split")
        parent_name, _, attr = name.rpartition(".")
        parent = text_model.get_submodule(parent_name)
        setattr(parent, attr, _split(module, style, attr, parent, text_config, tp,
                                     f"{text_config.model_type}: {name}"))
        split += 1
    return split


# a fused experts module's weights [experts, ..., ...]: "colwise" splits their second to last
# axis, "rowwise" their last (as transformers' plans say of them); packed: each half
_EXPERT_AXIS = {"colwise": -2, "rowwise": -1, "packed_colwise": -2, "packed_rowwise": -1}


def _split_experts(module: nn.Module, name: str, plan: list, tp: TensorParallel) -> int:
    """A "moe_tp_experts" module whose every weight the plan splits (Llama 4's: gate_up
    [experts, hidden, 2 x inter] by each half's columns, down [experts, inter, hidden] by
    its rows): this rank's share of every expert's intermediate columns, the module's output
    all-reduced (1). Else, or with submodules holding weights, it stays whole (0)."""
    params = dict(module.named_parameters(recurse=False))
    styles = {n: next((v for p, v in plan if p.fullmatch(f"{name}.{n}")), None) for n in params}
    if not params or any(s not in _EXPERT_AXIS for s in styles.values()) or any(
            True for child in module.children() for _ in child.parameters()):
        return 0
    world, rank = tp.world_size, tp.rank
    shares = {}
    for n, p in params.items():
        axis, halves = _EXPERT_AXIS[styles[n]], 2 if styles[n].startswith("packed") else 1
        size = p.shape[axis]
        if size % (halves * world):  # (the intermediate size: check_tensor_parallel's)
            raise ValueError(f"{name}.{n}: {size} expert columns do not split over "
                             f"tensor_parallel_size={world}")
        k, part = size // halves // world, size // halves
        idx = torch.cat([torch.arange(h * part + rank * k, h * part + (rank + 1) * k)
                         for h in range(halves)])
        shares[n] = p.data.index_select(axis % p.dim(), idx).contiguous()
    for n, share in shares.items():
        setattr(module, n, nn.Parameter(share, requires_grad=False))
    forward = module.forward
    module.forward = lambda *args, **kwargs: tp.all_reduce(forward(*args, **kwargs))
    return 1


def _split(linear: nn.Linear, style: str, attr: str, parent: nn.Module, text_config,
           tp: TensorParallel, where: str) -> nn.Module:
    rank, world = tp.rank, tp.world_size
    w, b = linear.weight.data, None if linear.bias is None else linear.bias.data
    if style == "rowwise":
        cols = _share(w.shape[1], rank, world, where)
        row = RowParallelLinear(cols.stop - cols.start, w.shape[0], b is not None, tp)
        row.weight = nn.Parameter(w[:, cols].clone(), requires_grad=False)
        if b is not None:  # (whole: added once, after the all-reduce)
            row.bias = nn.Parameter(b.clone(), requires_grad=False)
        return row
    if style == "packed_colwise":  # [gate | up]: this rank's share of each half
        half = w.shape[0] // 2
        share = _share(half, rank, world, where)
        rows = torch.cat([torch.arange(half)[share], torch.arange(half, 2 * half)[share]])
    elif attr in ("k_proj", "v_proj"):  # whole KV heads; each on world / kv ranks if fewer
        d = getattr(parent, "head_dim", None) or getattr(text_config, "head_dim", None) \
            or text_config.hidden_size // text_config.num_attention_heads
        kv = w.shape[0] // d
        if kv >= world:
            rows = _share(w.shape[0], rank, world, where)
        else:
            if world % kv:
                raise ValueError(f"{where}: {kv} KV heads neither divide nor are a multiple "
                                 f"of tensor_parallel_size={world}")
            head = rank // (world // kv)
            rows = slice(head * d, (head + 1) * d)
    else:
        rows = _share(w.shape[0], rank, world, where)
    out = nn.Linear.__new__(nn.Linear)  # (uninitialised: it takes this rank's rows)
    nn.Module.__init__(out)
    out.weight = nn.Parameter(w[rows].clone(), requires_grad=False)
    out.bias = None if b is None else nn.Parameter(b[rows].clone(), requires_grad=False)
    out.out_features, out.in_features = out.weight.shape
    return out


def _share(n: int, rank: int, world: int, where: str) -> slice:
    if n % world:
        raise ValueError(f"{where}: {n} features do not split over tensor_parallel_size="
                         f"{world}")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def local_kv_heads(kv: int, world: int) -> int:
    """KV heads a rank holds of ``kv``: its share, or one replicated head."""
    return kv // world if kv >= world else 1


def _vocab_rows(weight: torch.Tensor, tp: TensorParallel) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [vocab, hidden] table (the last rank's padded with zeros) and
    the first of them."""
    n = weight.shape[0]
    rows = -(-n // tp.world_size)
    start = min(tp.rank * rows, n)
    share = weight.new_zeros(rows, weight.shape[1])
    part = weight[start:start + rows]
    share[:part.shape[0]] = part
    return share, start


class VocabShare(VocabParallelEmbedding):
    """This rank's rows of a model's token embedding, looked up as `VocabParallelEmbedding`
    does (an all-reduce: every rank looks up the same ids) and scaled as the model's own
    scales (Gemma's ``embed_scale``). The whole table stays in host memory for the lookups
    one rank makes alone (`rows_alone`)."""

    def __init__(self, embedding: nn.Embedding, tp: TensorParallel) -> None:
        weight, start = _vocab_rows(embedding.weight.data, tp)
        super().__init__(weight.shape[0], weight.shape[1], start, tp)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.whole = embedding.weight.data.cpu()  # (an attribute: it stays on the host)
        scale = getattr(embedding, "embed_scale", None)
        self.register_buffer("embed_scale", None if scale is None else
                             torch.as_tensor(scale).clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._scaled(super().forward(ids))

    def rows_alone(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """The embeddings of ``ids`` without a collective (an image's marker tokens, in an
        encoder step this rank runs alone): from the host table."""
        rows = self.whole[torch.tensor(ids, dtype=torch.int64)]
        return self._scaled(to_device(rows, device))  # (the table's dtype: the weight's)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)


def split_vocabulary(hf_model: nn.Module, tp: TensorParallel) -> bool:
    """The model's token embedding and lm_head (tied or not) cut to this rank's rows of the
    vocabulary, the lm_head's logits all-gathered (`ParallelLMHead`); False, both left whole,
    where either is of a kind this cannot split (an embedding other than `nn.Embedding` or
    Gemma's scaled one, an lm_head with a bias or other than an `nn.Linear`, or of another
    vocabulary than the embedding's), where the model's image features are token embeddings
    (Chameleon's and Emu3's image codes: an encoder step runs on one rank alone) or the model
    does not take them back."""
    if _features_embed_tokens(hf_model):
        return False
    embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    kind = type(embedding)
    if not (kind is nn.Embedding or issubclass(kind, nn.Embedding)
            and kind.__name__.endswith("ScaledWordEmbedding")):
        return False
    if head is not None and (type(head) is not nn.Linear or head.bias is not None
                             or head.weight.shape != embedding.weight.shape):
        return False
    share = VocabShare(embedding, tp)
    new_head = None
    if head is not None:
        weight = share.weight if head.weight is embedding.weight else \
            nn.Parameter(_vocab_rows(head.weight.data, tp)[0], requires_grad=False)
        new_head = ParallelLMHead(weight, head.out_features, tp)
    hf_model.set_input_embeddings(share)
    if new_head is not None:
        hf_model.set_output_embeddings(new_head)
    if hf_model.get_input_embeddings() is share and hf_model.get_output_embeddings() is \
            (new_head if head is not None else None):
        return True
    hf_model.set_input_embeddings(embedding)  # (put back: it keeps both whole)
    if head is not None:
        hf_model.set_output_embeddings(head)
    return False


def _features_embed_tokens(hf_model: nn.Module) -> bool:
    """Whether the model's ``get_image_features`` looks its features up in the text
    embedding (read from its source)."""
    for module in (hf_model, getattr(hf_model, "model", None)):
        method = getattr(type(module), "get_image_features", None)
        try:
            source = inspect.getsource(method) if method is not None else ""
        except (OSError, TypeError):
            return True  # (unread: assumed to)
        if re.search(r"get_input_embeddings\(|embed_tokens", source):
            return True
    return False
