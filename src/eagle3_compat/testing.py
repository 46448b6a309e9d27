"""Tiny models and independent references, for the tests and the demo.

Nothing here downloads anything: checkpoints get random weights and a
word-level tokenizer built locally.  Sizes are ones vLLM's CPU attention
kernel accepts (head_dim 64).

References:

* :func:`hf_layer_outputs`: Hugging Face transformers in float32, the
  output of decoder layer ``k`` taken by a forward hook on that layer
  (one prompt per forward, no padding).  That is speculators' contract
  (HF ``hidden_states[k + 1]``, except that for the last layer HF's tuple
  holds the normed state and the hook holds the pre-norm one).
* :func:`vllm_layer_outputs`: vLLM's own unpatched engine, its model's own
  forward stopped after layer ``k`` (``end_layer``, final norm replaced; see
  :class:`VllmReference`), one prompt per step.  Shares no code with the
  capture in ``eagle3_compat.worker``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "VllmReference",
    "compare",
    "ensure_applied",
    "gpu_unavailable",
    "hf_layer_outputs",
    "make_tiny_model",
    "max_rel_error",
    "vllm_batching_drift",
    "vllm_layer_outputs",
]

_WORDS = 400


def _config(family: str, vocab: int, layers: int, hidden: int) -> dict[str, Any]:
    heads = hidden // 64
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if family == "llama":
        return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "rope_theta": 10000.0}
    if family == "qwen3":
        return {**common, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False}
    if family == "qwen2":
        # Qwen2 / Qwen2.5: dense, biases on q/k/v (random, see _PERTURBED).
        return {**common, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                "rope_theta": 1000000.0, "use_sliding_window": False}
    if family == "mistral":
        # vLLM runs MistralForCausalLM on its Llama classes.  A window shorter
        # than the longer prompts, so that sliding-window attention shows.
        return {**common, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "rope_theta": 1000000.0, "sliding_window": 128}
    if family == "gemma2":
        # Alternating sliding-window (64) and full layers, attention and final
        # logit soft-capping, embeddings scaled by sqrt(hidden), four norms per
        # layer ((1 + weight) RMSNorm), tied embeddings, tanh GELU (vLLM reads
        # hidden_act, transformers hidden_activation; Google's configs hold both).
        return {**common, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                "rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 64, "sliding_window": 64,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(layers)],
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True, "attention_bias": False}
    if family == "gpt_oss":
        # gpt-oss, unquantized (the real checkpoints' experts are MXFP4): every
        # layer MoE (4 experts, top 2, biased experts and router), attention
        # sinks, q/k/v/o biases, sliding window 128 on alternate layers, YaRN
        # rope.  vLLM's CPU attention takes sinks in bfloat16 only: run there in
        # bfloat16.
        return {**common, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                "intermediate_size": hidden, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 128, "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 128},
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(layers)]}
    if family == "qwen3_moe":
        # Every layer MoE: 8 experts, top 2 (no shared expert in this family).
        return {**common, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if family == "olmo2":
        # vLLM's Olmo2 decoder layer returns one tensor (no fused residual).
        return {**common, "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"],
                "rope_theta": 10000.0, "attention_bias": False}
    if family == "llava":
        # A vision-language model: the Llama text model sits behind
        # get_language_model() in vLLM (model.language_model.model.layers).
        text = _config("llama", vocab, layers, hidden)
        return {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                "text_config": text, "image_token_index": 4 + _WORDS, "torch_dtype": "float32",
                "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
                "projector_hidden_act": "gelu", "tie_word_embeddings": False,
                "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "image_size": 32, "patch_size": 16,
                                  "projection_dim": 64}}
    if family in ("deepseek_v3", "deepseek_v3_l4s"):
        # Kimi-K2 / DeepSeek-V3 layout at toy size: dense first layer, MoE after
        # it, MLA dimensions (qk 64 + 32 rope, v 64).  vLLM's loader needs
        # noaux_tc + sigmoid for the e_score_correction_bias weights.  On the CPU
        # the engine runs it with VLLM_MLA_DISABLE=1 (same decoder layers).
        cfg = {**common, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
               "num_key_value_heads": heads, "moe_intermediate_size": hidden // 2,
               "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
               "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
               "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 64,
               "qk_rope_head_dim": 32, "v_head_dim": 64, "rope_theta": 10000.0,
               "rope_scaling": None, "attention_bias": False}
        cfg.pop("head_dim")
        if family == "deepseek_v3_l4s":
            # Mistral-Large-3 style: queries scaled by position past 16 tokens.
            cfg["llama_4_scaling"] = {"original_max_position_embeddings": 16, "beta": 0.5}
        return cfg
    if family == "deepseek_v3_mla":
        # The same layout with the real model's latent sizes (kv_lora_rank 512,
        # qk_rope_head_dim 64, 128-wide nope/v heads), so that vLLM's CUDA MLA
        # backends (FlashMLA, FA3-MLA) accept it as they do Kimi-K2.5 /
        # DeepSeek-V3; bfloat16 only there (no float32 MLA backend on CUDA).
        cfg = _config("deepseek_v3_l4s", vocab, layers, hidden)
        cfg.update({"num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128})
        return cfg
    if family == "kimi_k25":
        return _kimi_k25_config(vocab, layers, hidden)
    raise ValueError(f"unknown tiny-model family {family!r}; known: {FAMILIES}")


FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss", "qwen3", "qwen3_moe", "olmo2", "llava",
            "deepseek_v3", "deepseek_v3_l4s", "deepseek_v3_mla", "kimi_k25")
# Families whose one-dimensional weights (biases, norm scales) get random
# values too, so that a misplaced bias or norm shows: the default init leaves
# biases at 0 and norm scales at 1 (Gemma's (1 + weight) norms at 0).
_PERTURBED = ("qwen2", "mistral", "gemma2", "gpt_oss")

# Kimi-K2.5's media placeholder ("<|media_pad|>"): a special token of the
# tiny tokenizer, right after its words (vLLM's processor looks for this id).
_KIMI_MEDIA_TOKEN = 4 + _WORDS
# The latent sizes of the real Kimi-K2.5 / DeepSeek-V3 attention (MLA), which
# vLLM's CUDA MLA backends require; ``make_tiny_model(..., mla=True)``.
_REAL_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def _kimi_k25_config(vocab: int, layers: int, hidden: int, *, mla: bool = False,
                     llama_4_scaling: bool = False) -> dict[str, Any]:
    """Kimi-K2.5 at toy size: vLLM's ``KimiK25Config`` layout (MoonViT vision
    tower + patch-merging projector in front of a DeepseekV3 text model).

    The text model is the ``deepseek_v3`` family's (dense first layer, MoE
    after it, MLA), with YaRN rope scaling as the real checkpoint has it
    (``max_position_embeddings`` = original positions x factor, which vLLM
    takes as the longest sequence).  ``auto_map``
    names the configuration module written next to config.json (as the real
    checkpoint's), so that ``AutoConfig`` with ``trust_remote_code`` reads it
    offline; vLLM uses its own ``KimiK25Config`` for ``model_type`` kimi_k25.
    """
    text = _config("deepseek_v3_l4s" if llama_4_scaling else "deepseek_v3", vocab, layers, hidden)
    text.pop("architectures")
    text["rope_scaling"] = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 64,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    if mla:
        text.update({"num_attention_heads": 16, "num_key_value_heads": 16, **_REAL_MLA})
    vision = {"model_type": "kimi_k25_vision", "patch_size": 14, "init_pos_emb_height": 8,
              "init_pos_emb_width": 8, "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
              "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 64,
              "intermediate_size": 128, "merge_kernel_size": [2, 2],
              "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
              "mm_projector_type": "patchmerger", "mm_hidden_size": hidden,
              "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5}
    return {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
            "text_config": text, "vision_config": vision,
            "media_placeholder_token_id": _KIMI_MEDIA_TOKEN, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
            "use_unified_vision_chunk": False, "torch_dtype": "float32"}


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    fast.save_pretrained(path)


def make_tiny_model(
    path: str | Path,
    family: str = "llama",
    *,
    layers: int = 6,
    hidden: int = 256,
    vocab: int = 512,
    seed: int = 0,
    mla: bool = False,
    llama_4_scaling: bool = False,
) -> Path:
    """Write a random-weight HF checkpoint (float32) with a local tokenizer to ``path``.

    ``mla`` and ``llama_4_scaling`` (family ``kimi_k25`` only): the real
    model's MLA latent sizes (16 heads; for vLLM's CUDA MLA backends), and
    Mistral-Large-3's query scaling past 16 positions in the text model.
    """
    import torch  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    path = Path(path)
    if family == "kimi_k25":
        return _make_kimi_k25(path, layers=layers, hidden=hidden, vocab=vocab, seed=seed, mla=mla,
                              llama_4_scaling=llama_4_scaling)
    if mla or llama_4_scaling:
        raise ValueError(f"mla/llama_4_scaling are options of the kimi_k25 family, not of {family!r} "
                         "(use deepseek_v3_mla / deepseek_v3_l4s)")
    path.mkdir(parents=True, exist_ok=True)
    cfg_dict = _config(family, vocab, layers, hidden)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    cls = _hf_class(config)
    model = (cls.from_config(config, torch_dtype=torch.float32) if hasattr(cls, "from_config")
             else cls(config).to(torch.float32))
    # Larger-than-default init so that layers differ clearly from each other.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.06)
            elif family in _PERTURBED:
                p.add_(torch.randn_like(p) * 0.06)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    if family == "llava":
        _llava_processor(path)
    return path


# The checkpoint's own configuration module (``auto_map``), as the real
# Kimi-K2.5 repository ships one: transformers has no kimi_k25 model type.
_KIMI_CONFIG_MODULE = '''"""Kimi-K2.5 configuration of a tiny test checkpoint (eagle3_compat.testing)."""

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=0,
                 pad_token_id=0, **kwargs):
        if not isinstance(text_config, DeepseekV3Config):
            text_config = DeepseekV3Config(**(text_config or {}))
        self.text_config = text_config
        self.vision_config = dict(vision_config or {})
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    @property
    def hidden_size(self):
        return self.text_config.hidden_size

    @property
    def vocab_size(self):
        return self.text_config.vocab_size

    @property
    def num_hidden_layers(self):
        return self.text_config.num_hidden_layers
'''

# The image processor vLLM's Kimi-K2.5 processing builds at engine start
# (``trust_remote_code``, from preprocessor_config.json's ``auto_map``), even
# for text prompts.  Every image and frame is resized to a fixed grid of
# patches: a few vision tokens, so that vLLM's encoder profiling stays small.
_KIMI_PROCESSOR_MODULE = '''"""Image processor of a tiny Kimi-K2.5 test checkpoint (eagle3_compat.testing)."""

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class TinyKimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, patch_size=14, merge_kernel_size=(2, 2), grid=(4, 4),
                 num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = int(patch_size)
        self.merge_kernel_size = list(merge_kernel_size)
        self.grid = list(grid)
        self.num_frames_per_chunk = int(num_frames_per_chunk)

    def _frames(self, chunk):
        if chunk["type"] == "image":
            return [chunk["image"]]
        if chunk["type"] == "video_chunk":
            return list(chunk["video_chunk"])
        raise ValueError(f"unknown vision chunk type {chunk['type']!r}")

    def media_tokens_calculator(self, chunk):
        # temporal pooling: one set of merged patches per chunk
        return (self.grid[0] // self.merge_kernel_size[0]) * (self.grid[1] // self.merge_kernel_size[1])

    def split_video_chunks(self, video):
        n = self.num_frames_per_chunk
        return [{"type": "video_chunk", "video_chunk": list(video[i:i + n])} for i in range(0, len(video), n)]

    def preprocess(self, chunks, **kwargs):
        p, (gh, gw) = self.patch_size, self.grid
        patches, grids = [], []
        for chunk in chunks:
            frames = self._frames(chunk)
            for frame in frames:
                img = frame.convert("RGB").resize((gw * p, gh * p))
                x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
                x = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
                patches.append(x)
            grids.append([len(frames), gh, gw])
        return BatchFeature({"pixel_values": torch.cat(patches), "grid_thws": torch.tensor(grids)})
'''


def _make_kimi_k25(path: Path, *, layers: int, hidden: int, vocab: int, seed: int, mla: bool,
                   llama_4_scaling: bool) -> Path:
    """The ``kimi_k25`` checkpoint: the text model's weights from transformers'
    DeepseekV3 (under ``language_model.``), the vision tower's and projector's
    random, in the names and shapes of vLLM's Kimi-K2.5 modules."""
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    cfg = _kimi_k25_config(vocab, layers, hidden, mla=mla, llama_4_scaling=llama_4_scaling)
    (path / "configuration_kimi_k25.py").write_text(_KIMI_CONFIG_MODULE)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    # the checkpoint's configuration reads back (offline, from the local module)
    loaded = AutoConfig.from_pretrained(path, trust_remote_code=True)
    if loaded.text_config.num_hidden_layers != layers:
        raise RuntimeError(f"{path}: configuration_kimi_k25 read {loaded.text_config.num_hidden_layers} "
                           f"layers, wrote {layers}")
    torch.manual_seed(seed)
    text = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg["text_config"]), torch_dtype=torch.float32)
    weights: dict[str, Any] = {}
    with torch.no_grad():
        # Larger-than-default init so that layers differ clearly from each other.
        for p in text.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.06)
        for name, t in text.state_dict().items():
            weights["language_model." + name] = t.contiguous()
        v = cfg["vision_config"]
        hv, iv, ps = v["hidden_size"], v["intermediate_size"], v["patch_size"]
        merged = hv * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
        shapes = {
            "vision_tower.patch_embed.proj.weight": (hv, 3, ps, ps),
            "vision_tower.patch_embed.proj.bias": (hv,),
            "vision_tower.patch_embed.pos_emb.weight": (v["init_pos_emb_height"], v["init_pos_emb_width"], hv),
            "vision_tower.encoder.final_layernorm.weight": (hv,),
            "vision_tower.encoder.final_layernorm.bias": (hv,),
            "mm_projector.pre_norm.weight": (hv,),
            "mm_projector.pre_norm.bias": (hv,),
            "mm_projector.proj.0.weight": (merged, merged),
            "mm_projector.proj.0.bias": (merged,),
            "mm_projector.proj.2.weight": (hidden, merged),
            "mm_projector.proj.2.bias": (hidden,),
        }
        for i in range(v["num_hidden_layers"]):
            b = f"vision_tower.encoder.blocks.{i}."
            shapes.update({
                b + "norm0.weight": (hv,), b + "norm0.bias": (hv,),
                b + "norm1.weight": (hv,), b + "norm1.bias": (hv,),
                b + "wqkv.weight": (3 * hv, hv), b + "wqkv.bias": (3 * hv,),
                b + "wo.weight": (hv, hv), b + "wo.bias": (hv,),
                b + "mlp.fc0.weight": (iv, hv), b + "mlp.fc0.bias": (iv,),
                b + "mlp.fc1.weight": (hv, iv), b + "mlp.fc1.bias": (hv,),
            })
        for name, shape in shapes.items():
            norm_weight = name.endswith("norm0.weight") or name.endswith("norm1.weight") or (
                "layernorm.weight" in name or "pre_norm.weight" in name)
            weights[name] = torch.ones(shape) if norm_weight else torch.randn(shape) * 0.06
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer(path)
    _kimi_k25_processor(path)
    return path


def _kimi_k25_processor(path: Path) -> None:
    """The media token in the tokenizer, and the image processor vLLM loads."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|media_pad|>"]})
    if tok.convert_tokens_to_ids("<|media_pad|>") != _KIMI_MEDIA_TOKEN:
        raise RuntimeError(f"{path}: <|media_pad|> is not token {_KIMI_MEDIA_TOKEN}")
    tok.save_pretrained(path)
    (path / "kimi_k25_vision_processing.py").write_text(_KIMI_PROCESSOR_MODULE)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "TinyKimiK25VisionProcessor",
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.TinyKimiK25VisionProcessor"},
        "patch_size": 14, "merge_kernel_size": [2, 2], "grid": [4, 4], "num_frames_per_chunk": 4,
    }, indent=1))


def _hf_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    if getattr(config, "model_type", "") == "llava":
        from transformers import LlavaForConditionalGeneration  # noqa: PLC0415

        return LlavaForConditionalGeneration
    return AutoModelForCausalLM


def _hf_decoder_layers(model: Any) -> Any:
    base = model.model
    return base.layers if hasattr(base, "layers") else base.language_model.layers


def _llava_processor(path: Path) -> None:
    """The image processor + tokenizer vLLM needs to start a Llava engine."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == 4 + _WORDS
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=16, image_token="<image>",
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   ).save_pretrained(path)


def ensure_applied(dtype: str | None = "float32") -> Any:
    """apply() with ``dtype`` in effect, re-applying if other options are active.

    Generator methods are looked up on the class at call time, so generators
    built earlier keep working across a revert/re-apply.
    """
    import eagle3_compat  # noqa: PLC0415

    st = eagle3_compat.status()
    if not (st.applied and st.options == {"dtype": dtype}):
        eagle3_compat.revert()
        st = eagle3_compat.apply(dtype=dtype)
    if not st.applied:
        raise RuntimeError(f"eagle3_compat did not apply:\n{st}")
    return st


def _layer_out(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def hf_layer_outputs(
    model_path: str | Path,
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[list[Any]]:
    """Reference (1): HF outputs of decoder layers ``layer_ids``, per prompt,
    computed on ``device`` in ``dtype`` (float32 unless told), returned on the CPU."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(model_path)
    # transformers' SDPA path drops attention logit soft-capping (Gemma 2):
    # the eager one applies it.
    softcapped = getattr(config, "attn_logit_softcapping", None)
    extra = {"attn_implementation": "eager"} if softcapped else {}
    model = _hf_class(config).from_pretrained(
        model_path, torch_dtype=torch_dtype, **extra
    ).to(device)
    model.eval()
    layers = _hf_decoder_layers(model)
    captured: dict[int, Any] = {}
    handles = [
        layers[k].register_forward_hook(
            lambda _m, _a, out, k=k: captured.__setitem__(k, _layer_out(out)[0].to("cpu", copy=True))
        )
        for k in layer_ids
    ]
    out = []
    try:
        with torch.no_grad():
            for ids in prompts:
                captured.clear()
                model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device))
                out.append([captured[k] for k in layer_ids])
    finally:
        for h in handles:
            h.remove()
        del model
    return out


# Reference (2) runs vLLM's own model with nothing of the capture in it.  The
# functions below marked "runs in the worker" run in the reference engine's
# worker (LLM.apply_model); they import nothing from eagle3_compat, hook no
# decoder layer and never sum a layer's (hidden, residual) pair themselves.
# They travel to the worker by value (:func:`_shipped_by_value`): the worker
# runs exactly the code the driver reads its results with, never a copy of
# this module it imports from disk itself.


def _ref_base_model(model: Any) -> Any:  # runs in the worker
    """The one module of ``model`` that runs the decoder stack: vLLM's
    ``*Model`` class (LlamaModel, Qwen2Model, Qwen3MoeModel, Olmo2Model,
    DeepseekV2Model, ...), recognised by what its ``forward`` uses on vLLM
    0.11 to 0.16: ``islice(self.layers, self.start_layer, self.end_layer)``,
    then ``self.norm``.  Found by a search of the module tree (not through
    ``get_language_model``), and refused loudly when it is not unique or not
    the whole stack."""
    import torch  # noqa: PLC0415

    found = [
        m for m in model.modules()
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
        and all(hasattr(m, a) for a in ("norm", "start_layer", "end_layer"))
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"vLLM reference: expected exactly one module with layers (ModuleList), norm, "
            f"start_layer and end_layer in {type(model).__name__}, found "
            f"{[type(m).__name__ for m in found]}; this model is not supported by the reference"
        )
    base = found[0]
    if (base.start_layer, base.end_layer) != (0, len(base.layers)):
        raise RuntimeError(
            f"vLLM reference: {type(base).__name__} runs layers {base.start_layer}..{base.end_layer} "
            f"of {len(base.layers)} (pipeline parallel, or already truncated); not supported"
        )
    return base


def _ref_truncate(model: Any, k: int) -> None:  # runs in the worker
    """Make the model's own forward stop after decoder layer ``k`` and return
    that layer's output instead of the final norm of the last layer's.

    * ``end_layer = k + 1``: the model's own loop runs layers ``0..k``; the
      layers after ``k`` are swapped for modules that raise if called, so a
      model that ignores ``end_layer`` fails instead of running them.
    * the final ``norm`` is replaced by a module returning what that norm
      would have normalised.  Called as ``norm(hidden, residual)`` (vLLM's
      layers return a pair, the residual add fused into the next norm) it
      calls the original ``RMSNorm`` and returns its second result, the
      residual *after* the fused add: vLLM's own kernel computes the sum.
      Called with one tensor (Olmo2's layers return their output whole), it
      returns that tensor.
    * the top-level model's returned tensor (what the runner gets) is
      recorded, and checked to be the very tensor that module returned: a
      model doing anything after its final norm, or a compiled graph that
      does not run the replaced modules, is an error, not a silent result.
    """
    import torch  # noqa: PLC0415

    if getattr(model, "_e3c_ref_undo", None) is not None:
        raise RuntimeError("vLLM reference: the model is already truncated")
    base = _ref_base_model(model)
    n = len(base.layers)
    if not 0 <= k < n:
        raise ValueError(f"layer id {k} out of range for {n} decoder layers")
    rec: dict[str, Any] = {"pre_norm": None, "outputs": []}
    final_norm = base.norm

    class PreNorm(torch.nn.Module):
        def forward(self, x: Any, residual: Any = None) -> Any:
            if residual is None:
                rec["pre_norm"] = x
                return x
            _, summed = final_norm(x, residual)
            rec["pre_norm"] = summed
            return summed, summed

    class NotRun(torch.nn.Module):
        def __init__(self, j: int) -> None:
            super().__init__()
            self.j = j

        def forward(self, *_a: Any, **_kw: Any) -> Any:
            raise RuntimeError(
                f"vLLM reference: decoder layer {self.j} ran although end_layer = {k + 1}: "
                "this model's forward does not stop at end_layer"
            )

    def on_output(_m: Any, _args: Any, out: Any) -> None:
        same = out is not None and out is rec["pre_norm"]
        rows = out.detach().to("cpu", copy=True) if isinstance(out, torch.Tensor) else None
        rec["outputs"].append((same, rows, type(out).__name__))
        rec["pre_norm"] = None

    tail = {j: base.layers[j] for j in range(k + 1, n)}
    end = base.end_layer
    handle = model.register_forward_hook(on_output)
    base.norm = PreNorm()
    base.end_layer = k + 1
    for j in tail:
        base.layers[j] = NotRun(j)
    model._e3c_ref_undo = (base, final_norm, end, tail, handle, rec)


def _ref_restore(model: Any) -> bytes:  # runs in the worker
    """Undo :func:`_ref_truncate`; the model's outputs recorded meanwhile, as
    ``torch.save`` bytes (``collective_rpc``'s msgpack would hand tensors
    nested in a list back as raw buffers); read them with :func:`_ref_load`."""
    import io  # noqa: PLC0415

    import torch  # noqa: PLC0415

    undo = getattr(model, "_e3c_ref_undo", None)
    if undo is None:
        raise RuntimeError("vLLM reference: the model is not truncated")
    base, final_norm, end, tail, handle, rec = undo
    handle.remove()
    base.norm = final_norm
    base.end_layer = end
    for j, layer in tail.items():
        base.layers[j] = layer
    model._e3c_ref_undo = None
    buf = io.BytesIO()
    torch.save([list(o) for o in rec["outputs"]], buf)
    return buf.getvalue()


def _ref_load(data: bytes) -> list[tuple[bool, Any, str]]:
    """The outputs :func:`_ref_restore` recorded, from its bytes; anything else
    (another reply shape, another record format) is an error naming what came."""
    import io  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RuntimeError(
            f"vLLM reference: the worker's record is a {type(data).__name__}, not the bytes "
            "_ref_restore returns"
        )
    loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    if not isinstance(loaded, list) or not all(
        isinstance(o, (list, tuple)) and len(o) == 3 and isinstance(o[0], bool)
        and (o[1] is None or isinstance(o[1], torch.Tensor)) and isinstance(o[2], str)
        for o in loaded
    ):
        raise RuntimeError(
            "vLLM reference: the worker's record is not a list of (same, tensor, kind) entries"
        )
    return [tuple(o) for o in loaded]


def _ref_reply(reply: Any) -> Any:
    """The one worker's result from an ``apply_model`` reply (a list with one
    entry per worker on every vLLM release; the reference engine has one)."""
    if not isinstance(reply, list) or len(reply) != 1:
        raise RuntimeError(
            f"vLLM reference: apply_model replied with a {type(reply).__name__}"
            f"{f' of {len(reply)} entries' if isinstance(reply, list) else ''}, "
            "expected a list with the one worker's result"
        )
    return reply[0]


# vLLM releases whose engine core pickles worker functions again (plain
# pickle, by reference) for its workers: the reference ships them by reference.
BY_REFERENCE_FROM = (0, 25)


@contextlib.contextmanager
def _shipped_by_value() -> Any:
    """While open, functions of this module are pickled (cloudpickle, as
    vLLM's ``apply_model`` sends them) by value, not by reference.

    By reference, the engine's worker would import ``eagle3_compat.testing``
    from disk when it unpickles ``_ref_truncate``/``_ref_restore`` (the engine
    process starts long after the driver imported this module): a file edited
    meanwhile gives a worker running other code than the driver that reads its
    record.  Seen as "vLLM reference, layer 0: 618653 forwards for 4 prompts"
    (also 249949 for 4, 127905 for 3): exactly the lengths of the
    ``torch.save`` bytes of those prompts' rows (hidden 256, float32), i.e.
    the worker's bytes counted as the list of entries by a driver from
    another version of this module.  By value, the worker runs exactly the
    driver's code and imports nothing of eagle3_compat for it."""
    import sys  # noqa: PLC0415

    import cloudpickle  # noqa: PLC0415

    if _by_reference():
        # vLLM's engine core (seen on 0.25 and 0.32; 0.19 still ships by value)
        # unpickles the function and pickles it again
        # for its workers with plain pickle, by reference: a by-value copy is
        # then "not the same object as eagle3_compat.testing._ref_restore".
        # By reference there (the worker imports this module itself).
        yield
        return
    module = sys.modules[__name__]
    registered = __name__ in cloudpickle.list_registry_pickle_by_value()
    if not registered:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        if not registered:
            cloudpickle.unregister_pickle_by_value(module)


def _by_reference() -> bool:
    """Whether this vLLM's engine core re-pickles worker functions by
    reference (:data:`BY_REFERENCE_FROM`)."""
    from .versions import detect, minor  # noqa: PLC0415

    found = detect().vllm_version
    return found is not None and minor(found) >= BY_REFERENCE_FROM


def _truncate_at(k: int) -> Any:
    """The worker function that truncates the model after layer ``k``.

    Up to 0.24 vLLM's encoder sends a plain function with cloudpickle (by
    value for this module, :func:`_shipped_by_value`) but any other callable,
    a ``functools.partial`` included, with plain pickle, i.e. by reference:
    the worker would import this module from disk.  So there: a closure, a
    plain function.  From 0.25 the engine core pickles the function again
    with plain pickle, which cannot pickle a closure: a ``functools.partial``
    of the module function, by reference (the worker imports this module)."""
    if _by_reference():
        return functools.partial(_ref_truncate, k=k)

    def truncate(model: Any) -> None:
        _ref_truncate(model, k)

    return truncate


def _ref_rows(outputs: list[tuple[bool, Any, str]], prompts: Sequence[Sequence[int]], k: int) -> list[Any]:
    if not isinstance(outputs, list) or not all(isinstance(o, tuple) and len(o) == 3 for o in outputs):
        raise RuntimeError(
            f"vLLM reference, layer {k}: the worker's record is a {type(outputs).__name__}, "
            "not the list _ref_load returns"
        )
    if len(outputs) != len(prompts):
        raise RuntimeError(
            f"vLLM reference, layer {k}: {len(outputs)} forwards for {len(prompts)} prompts "
            "(expected one prefill step per prompt)"
        )
    rows = []
    for i, ((same, out, kind), p) in enumerate(zip(outputs, prompts)):
        if not same:
            raise RuntimeError(
                f"vLLM reference, layer {k}, prompt {i}: the model returned a {kind} that is not "
                "what its final norm returned (the model does something after its final norm, "
                "or the replaced norm did not run)"
            )
        if out.dim() != 2 or out.shape[0] < len(p):
            raise RuntimeError(
                f"vLLM reference, layer {k}, prompt {i}: model output of shape {tuple(out.shape)} "
                f"for {len(p)} tokens"
            )
        rows.append(out[: len(p)])
    return rows


def _reference_model_len(model_path: str | Path, max_len: int) -> int:
    """The reference engine's ``max_model_len`` for prompts of up to ``max_len``
    tokens: a few positions of headroom, but never past the model's own
    ``max_position_embeddings`` (vLLM refuses a longer one), which still
    leaves room for the one token a prompt-only request generates."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    limit = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    want = max_len + 8
    if limit and want > int(limit) >= max_len + 1:
        return int(limit)
    return want


class VllmReference:
    """vLLM's own, unpatched engine as a reference (reference (2)); one engine start.

    ``layer_outputs`` obtains the output of decoder layer ``k`` as what the
    model itself returns when its own forward is stopped after layer ``k``
    (:func:`_ref_truncate`: ``end_layer = k + 1``, the final norm replaced by
    a module that returns the state the norm would have normalised), one
    prompt per step.  That is independent of the capture under test
    (``eagle3_compat.worker``): nothing of it is imported or copied, no
    decoder layer is hooked, the layers are found by another route, and the
    ``hidden + residual`` sum comes from vLLM's own fused-add ``RMSNorm``
    (the engine worker never even imports ``eagle3_compat.worker``;
    ``tests/test_reference_independent.py`` checks that, and that breaking
    the capture's helpers changes nothing here).  The worker functions travel
    by value (:func:`_shipped_by_value`), so the worker runs the driver's
    own version of them whatever the files on disk hold by then.  It relies only on vLLM's
    base-model ``forward`` (``islice(self.layers, self.start_layer,
    self.end_layer)``, then ``self.norm``; the same on 0.11 to 0.16) and
    fails loudly where that does not hold.

    ``batching_drift`` measures how much vLLM's own prompt log-probabilities
    depend on batching.  Both may run on the same engine (the model is
    truncated only inside ``layer_outputs``).  Use as a context manager.
    """

    def __init__(self, model_path: str | Path, max_len: int, dtype: str = "float32",
                 gpu_memory_utilization: float | None = None) -> None:
        from vllm import LLM  # noqa: PLC0415
        from vllm.platforms import current_platform  # noqa: PLC0415

        from .cpu_attention import engine_kwargs  # noqa: PLC0415
        from .cuda_engine import cuda_engine_environment  # noqa: PLC0415

        # apply_model ships functions to the engine process with pickle; allow
        # it while this reference engine lives (the driver reads it on every
        # call, the engine when it is spawned); close() restores it.
        self._saved_env = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.llm: Any = None
        # A CUDA engine starts as the generator's does (spawned, float32 Triton products).
        cuda = cuda_engine_environment(dtype) if current_platform.is_cuda() else contextlib.nullcontext()
        try:
            with cuda:
                self.llm = LLM(
                    model=str(model_path),
                    dtype=dtype,
                    enforce_eager=True,
                    compilation_config=0,
                    enable_prefix_caching=False,
                    max_model_len=_reference_model_len(model_path, max_len),
                    max_num_batched_tokens=max(8192, max_len + 8),
                    seed=0,
                    **engine_kwargs(dtype, str(model_path)),  # as the generator starts on this CPU build
                    **({} if gpu_memory_utilization is None else
                       {"gpu_memory_utilization": gpu_memory_utilization}),
                )
        except BaseException:
            self.close()
            raise

    def layer_outputs(self, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[list[Any]]:
        """Per prompt, per layer id: the decoder layer's output rows, one prompt per step
        (one truncated forward per prompt and distinct layer id)."""
        from vllm import SamplingParams  # noqa: PLC0415

        ids = list(layer_ids)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        by_layer: dict[int, list[Any]] = {}
        for k in dict.fromkeys(ids):
            self._apply(_truncate_at(k))
            try:
                for p in prompts:
                    self.llm.generate([{"prompt_token_ids": list(p)}], params, use_tqdm=False)
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    self._apply(_ref_restore)
                raise
            by_layer[k] = _ref_rows(_ref_load(_ref_reply(self._apply(_ref_restore))), prompts, k)
        return [[by_layer[k][i] for k in ids] for i in range(len(prompts))]

    def _apply(self, func: Any) -> Any:
        """``apply_model`` with this module's functions shipped by value
        (:func:`_shipped_by_value`)."""
        with _shipped_by_value():
            return self.llm.apply_model(func)

    def batching_drift(self, prompts: Sequence[Sequence[int]]) -> float:
        """Largest difference (nats) between vLLM's prompt log-probabilities when
        the prompts run one per call and all in one call.  No capture involved:
        a non-zero value is vLLM's behaviour, not ours."""
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

        def logprobs(outs: Any) -> list[list[float]]:
            return [[next(iter(d.values())).logprob if d else 0.0 for d in o.prompt_logprobs]
                    for o in outs]

        single = [logprobs(self.llm.generate([{"prompt_token_ids": list(p)}], params, use_tqdm=False))[0]
                  for p in prompts]
        batched = logprobs(self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                             use_tqdm=False))
        return max(abs(a - b) for s, b_ in zip(single, batched) for a, b in zip(s, b_))

    def close(self) -> None:
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
        finally:
            if self._saved_env is None:
                os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
            else:
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = self._saved_env

    def __enter__(self) -> VllmReference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def vllm_layer_outputs(
    model_path: str | Path,
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    dtype: str = "float32",
) -> list[list[Any]]:
    """Reference (2): vLLM's own forward stopped after each layer id, one prompt per step
    (see :class:`VllmReference`)."""
    with VllmReference(model_path, max(len(p) for p in prompts), dtype) as ref:
        return ref.layer_outputs(prompts, layer_ids)


def vllm_batching_drift(
    model_path: str | Path, prompts: Sequence[Sequence[int]], dtype: str = "float32"
) -> float:
    """How much vLLM's *own* results depend on batching (see :meth:`VllmReference.batching_drift`)."""
    with VllmReference(model_path, max(len(p) for p in prompts), dtype) as ref:
        return ref.batching_drift(prompts)


def gpu_unavailable() -> str | None:
    """Why the GPU suite cannot run here, or None where it can: a CUDA GPU
    that torch sees and vLLM's CUDA platform.  Checks the device count
    before importing vLLM, so a machine without a GPU never imports it."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return "torch is not installed"
    if not torch.cuda._is_compiled():
        return f"torch {torch.__version__} is built without CUDA"
    if torch.cuda.device_count() < 1:
        return "no CUDA GPU is visible (torch.cuda.device_count() == 0)"
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415
    except ImportError as exc:
        return f"vLLM does not import: {exc}"
    if not current_platform.is_cuda():
        return f"vLLM's platform is {type(current_platform).__name__}, not CUDA (a CPU build of vLLM?)"
    return None


def max_rel_error(got: Any, ref: Any) -> float:
    """``max|got - ref| / max|ref|`` (float64); inf when shapes differ."""
    import torch  # noqa: PLC0415

    if tuple(got.shape) != tuple(ref.shape):
        return float("inf")
    g = got.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    return float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))


def compare(
    results: Sequence[dict[str, Any]],
    reference: Sequence[Sequence[Any]],
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    tol: float,
) -> float:
    """Check generator results against a reference; raise AssertionError naming what differs.

    Returns the largest relative error seen.
    """
    if len(results) != len(prompts):
        raise AssertionError(f"{len(results)} results for {len(prompts)} prompts")
    worst = 0.0
    for i, (res, ref, ids) in enumerate(zip(results, reference, prompts)):
        if res["input_ids"].tolist() != list(ids):
            raise AssertionError(f"prompt {i}: input_ids differ from the prompt")
        states = res["hidden_states"]
        if len(states) != len(layer_ids):
            raise AssertionError(f"prompt {i}: {len(states)} tensors for {len(layer_ids)} layers")
        for j, k in enumerate(layer_ids):
            err = max_rel_error(states[j], ref[j])
            worst = max(worst, err)
            if not err <= tol:
                raise AssertionError(
                    f"prompt {i} (len {len(ids)}), layer {k}: relative error {err:.3g} > {tol:g}; "
                    f"shape {tuple(states[j].shape)} vs {tuple(ref[j].shape)}"
                )
    return worst
