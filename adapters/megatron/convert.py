"""Hugging Face <-> Megatron-core: the ``TransformerConfig``, the ``GPTModel`` and the weights.

Qwen2 (qkv bias), Qwen3 (``q_norm``/``k_norm`` as ``q_layernorm``/``k_layernorm``, an explicit
``head_dim``) and Llama-style models, as full (TP = PP = 1) state dicts (``parallel.py`` splits them). Each direction refuses a
tensor it has no rule for, so a weight is never silently dropped (``tests/test_megatron_trainer.py``
checks that every weight of a Qwen2 and a Qwen3 model maps both ways). Mixture-of-experts models
(Qwen3-MoE, Mixtral, DeepSeek) have no conversion of their router and experts and are refused by
their model type before any rank starts (:func:`check_convertible`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from staleflow.adapters.megatron.parallel import MEGATRON_LAYER, Stage

#: config attributes that give a model's number of routed experts (Qwen3-MoE/Qwen2-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")


class UnsupportedModelError(ValueError):
    """A Hugging Face model the Megatron conversion has no rules for."""


def check_convertible(hf_config: Any) -> None:
    """Refuse, naming the model type, a model whose weights this conversion cannot map: a
    mixture-of-experts model (its router and experts), or per-projection q/k norms."""
    model_type = str(getattr(hf_config, "model_type", "unknown"))
    experts = next((int(n) for a in EXPERT_COUNT_ATTRIBUTES if (n := getattr(hf_config, a, None))), 0)
    if experts:
        raise UnsupportedModelError(
            f"train.backend=megatron cannot train model_type={model_type!r}: a mixture-of-experts model ({experts} experts) "
            "whose router and expert weights have no Hugging Face <-> Megatron conversion here; Megatron converts dense "
            "SwiGLU decoders (llama, qwen2, qwen3 and alike). Use train.backend=fsdp for this model"
        )
    qk_norm(hf_config)


def transformer_config_from_hf(hf_config: Any, *, bf16: bool = False, use_cpu_initialization: bool = False,
                               tensor_parallel: int = 1, pipeline_parallel: int = 1) -> Any:
    """A Megatron ``TransformerConfig`` equal to a Hugging Face Qwen2/Qwen3/Llama config, split over
    ``tensor_parallel x pipeline_parallel`` ranks."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_convertible(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SwiGLU (hidden_act=silu) models are supported, got {hf_config.hidden_act!r}")
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=_head_dim(hf_config),
        qk_layernorm=qk_norm(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=use_cpu_initialization,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def _head_dim(hf_config: Any) -> int:
    """Qwen3 states ``head_dim`` (it may differ from hidden / heads); older configs imply it."""
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def qk_norm(hf_config: Any) -> bool:
    """Whether the model normalises each query and key head (``q_norm``/``k_norm``, RMSNorm over
    ``head_dim``: Qwen3, Qwen3-MoE and alike), read from the modules transformers builds for the
    config on the meta device, not from its model type. A q/k norm over a whole projection (OLMo-2)
    is not Megatron's per-head ``q_layernorm`` and is refused."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    norms = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    shapes = {tuple(p.shape) for name, p in model.named_parameters() if name.endswith(norms)}
    if not shapes:
        return False
    head_dim = _head_dim(hf_config)
    if shapes != {(head_dim,)}:
        raise UnsupportedModelError(
            f"model_type={getattr(hf_config, 'model_type', 'unknown')!r} normalises queries and keys over {sorted(shapes)}, "
            f"not per head ({head_dim},): Megatron's q_layernorm/k_layernorm have no equivalent"
        )
    return True


def _has_qkv_bias(hf_config: Any) -> bool:
    if hf_config.model_type == "qwen2":
        return True
    return bool(getattr(hf_config, "attention_bias", False))


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def build_gpt_model(hf_config: Any, transformer_config: Any) -> Any:
    """A Megatron ``GPTModel`` with the architecture of ``hf_config`` (local, Megatron-only layer spec):
    this rank's part of it when the model is split (:mod:`~staleflow.adapters.megatron.parallel`).

    Needs ``parallel_state.initialize_model_parallel`` to have run. The logits stay split over the
    tensor-parallel ranks (``parallel_output``): :func:`vocab_parallel_cross_entropy` reads them so.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=transformer_config.qk_layernorm),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(_rope_theta(hf_config)),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_output=True,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


# ------------------------------------------------------------------------------ weight conversion
def hf_to_megatron(hf: Mapping[str, torch.Tensor], hf_config: Any, stage: Stage | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen2/Qwen3/Llama weights -> the local-spec GPTModel's state dict (TP = PP = 1).

    Megatron keeps q, k and v in one ``linear_qkv`` whose rows are grouped by key/value head: for
    each group, its query heads, then its key head, then its value head. ``linear_fc1`` holds the
    gate projection then the up projection (SwiGLU applies the activation to the first half).
    Qwen3's ``q_norm``/``k_norm`` become ``q_layernorm``/``k_layernorm``. A Hugging Face tensor that
    no rule maps is an error (never silently dropped); a tied ``lm_head.weight`` is the embedding.
    ``stage``: convert only what that pipeline stage holds, from ``hf`` holding only the tensors
    :func:`stage_reads` selects (the embedding too on a tied last stage, which keeps its own copy).
    """
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = _head_dim(hf_config)
    per_group = heads // groups
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    stage = stage if stage is not None else Stage(range(hf_config.num_hidden_layers))
    hf = _Reads(hf)
    out: dict[str, torch.Tensor] = {}
    if stage.first or (tied and stage.last):
        out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
    for i in stage.layers:
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" not in hf:
                continue
            q = hf[attn + f"q_proj.{kind}"]
            k = hf[attn + f"k_proj.{kind}"]
            v = hf[attn + f"v_proj.{kind}"]
            tail = q.shape[1:]
            qkv = torch.cat(
                [
                    q.reshape(groups, per_group * head_dim, *tail),
                    k.reshape(groups, head_dim, *tail),
                    v.reshape(groups, head_dim, *tail),
                ],
                dim=1,
            )
            out[dst + f"self_attention.linear_qkv.{kind}"] = qkv.reshape(-1, *tail)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        for norm, layernorm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            if attn + f"{norm}.weight" in hf:
                out[dst + f"self_attention.{layernorm}.weight"] = hf[attn + f"{norm}.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    if stage.last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if "lm_head.weight" in hf and not tied:
            out["output_layer.weight"] = hf["lm_head.weight"]
    hf.check_all_read("Hugging Face", ignore=("lm_head.weight",))
    return out


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stage_reads(name: str, stage: Stage, tied: bool) -> bool:
    """Whether pipeline stage ``stage`` needs the Hugging Face tensor ``name`` (so a rank reads only
    its stage's part of a checkpoint). A tensor no rule knows is read, so that the conversion refuses it."""
    layer = _HF_LAYER.match(name)
    if layer:
        return int(layer.group(1)) in stage.layers
    if name == "model.embed_tokens.weight":
        return stage.first or (tied and stage.last)
    if name in ("model.norm.weight", "lm_head.weight"):
        return stage.last
    return True


class _Reads(dict):  # type: ignore[type-arg]
    """A state dict that records which tensors a conversion read, to refuse the ones it dropped."""

    def __init__(self, source: Mapping[str, torch.Tensor]) -> None:
        super().__init__(source)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return dict.__getitem__(self, key)  # type: ignore[no-any-return]

    def check_all_read(self, kind: str, ignore: tuple[str, ...] = (), prefix: str = "", extra: list[str] | None = None) -> None:
        """Refuse the tensors nobody read (named with ``prefix``), and the ``extra`` names the caller found unread."""
        dropped = sorted(prefix + k for k in set(self) - self.read if k not in ignore and not k.endswith("_extra_state"))
        dropped += extra or []
        if dropped:
            raise ValueError(f"the weight conversion has no rule for these {kind} tensors: {dropped[:5]}")


#: the weights outside the decoder layers: Megatron name -> Hugging Face name
OUTER_WEIGHTS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def megatron_to_hf(mg: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron` (``_extra_state`` entries are ignored), one decoder
    layer at a time (:func:`layer_to_hf`)."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    outer = _Reads({})
    for name, tensor in mg.items():
        if name.endswith("_extra_state"):
            continue
        match = MEGATRON_LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            dict.__setitem__(outer, name, tensor)
    out: dict[str, torch.Tensor] = {OUTER_WEIGHTS["embedding.word_embeddings.weight"]: outer["embedding.word_embeddings.weight"]}
    for i in range(hf_config.num_hidden_layers):
        out.update(layer_to_hf(layers.pop(i), hf_config, i))
    out[OUTER_WEIGHTS["decoder.final_layernorm.weight"]] = outer["decoder.final_layernorm.weight"]
    if "output_layer.weight" in outer:
        out[OUTER_WEIGHTS["output_layer.weight"]] = outer["output_layer.weight"]
    outer.check_all_read("Megatron", extra=[f"decoder.layers.{i}.*" for i in sorted(layers)])
    return out


def layer_to_hf(layer: Mapping[str, torch.Tensor], hf_config: Any, index: int) -> dict[str, torch.Tensor]:
    """One decoder layer's Megatron tensors (named as after ``decoder.layers.N.``) -> the Hugging
    Face tensors of layer ``index``; a tensor no rule maps is an error."""
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = _head_dim(hf_config)
    per_group = heads // groups
    mg = _Reads(layer)
    dst = f"model.layers.{index}."
    attn = dst + "self_attn."
    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        key = f"self_attention.linear_qkv.{kind}"
        if key not in mg:
            continue
        qkv = mg[key]
        tail = qkv.shape[1:]
        grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *tail)
        q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
        out[attn + f"q_proj.{kind}"] = q.reshape(-1, *tail)
        out[attn + f"k_proj.{kind}"] = k.reshape(-1, *tail)
        out[attn + f"v_proj.{kind}"] = v.reshape(-1, *tail)
    out[attn + "o_proj.weight"] = mg["self_attention.linear_proj.weight"]
    for norm, layernorm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        if f"self_attention.{layernorm}.weight" in mg:
            out[attn + f"{norm}.weight"] = mg[f"self_attention.{layernorm}.weight"]
    out[dst + "input_layernorm.weight"] = mg["input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = mg["pre_mlp_layernorm.weight"]
    gate, up = torch.chunk(mg["mlp.linear_fc1.weight"], 2, dim=0)
    out[dst + "mlp.gate_proj.weight"] = gate
    out[dst + "mlp.up_proj.weight"] = up
    out[dst + "mlp.down_proj.weight"] = mg["mlp.linear_fc2.weight"]
    mg.check_all_read("Megatron", prefix=f"decoder.layers.{index}.")
    return out


def full_megatron_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the full (TP = PP = 1) Megatron model of ``hf_config``: the
    conversion of the Hugging Face model built on the meta device (no memory, no rank asked)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(t.shape) for name, t in hf_to_megatron(model.state_dict(), hf_config).items()}


def load_hf_into_megatron(model: Any, hf: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy Hugging Face weights into a built GPTModel; every parameter must be covered."""
    converted = hf_to_megatron(hf, hf_config)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing}, unexpected {list(unexpected)}")
