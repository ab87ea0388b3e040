"""Lets vLLM 0.26.0 import its LLaVA family under transformers 5.x (the GPU machine's 5.17).

vLLM's pixtral module, imported by its LLaVA models, imports names transformers 5.x renamed
(`PixtralRotaryEmbedding`) or removed; LLaVA-1.5 and LLaVA-NeXT never call them. On
PYTHONPATH ahead of vLLM (benchmarks/run_h200.sh llavanext), this runs at interpreter start,
also in the subprocess vLLM inspects its model registry in.
"""

try:
    import transformers.models.pixtral.modeling_pixtral as _pixtral

    if not hasattr(_pixtral, "PixtralRotaryEmbedding"):
        _pixtral.PixtralRotaryEmbedding = _pixtral.PixtralVisionRotaryEmbedding

    def _removed(*args, **kwargs):
        raise NotImplementedError("removed in transformers 5.x; not used by LLaVA")

    for _name in ("position_ids_in_meshgrid", "apply_rotary_pos_emb",
                  "generate_block_attention_mask"):
        if not hasattr(_pixtral, _name):
            setattr(_pixtral, _name, _removed)
except Exception:  # no transformers, or another layout: leave vLLM to report it
    pass
