"""Tiny transformers 5.x architectures as user models (``file.py:function``), random weights.

Each function returns ``(model, args, kwargs)`` with ``use_cache=False`` and labels among
the inputs, so that ``model(*args, **kwargs)``'s first output is the training loss. These
are the real architecture classes from ``transformers`` at test sizes, as a user would
write them; attention is what the config asks for (``ATTENTION``, eager by default).
"""

from __future__ import annotations

import os

import torch
import transformers as tf

ATTENTION = os.environ.get("FTC_TEST_ATTENTION", "eager")
B, S = 2, 16
VOCAB = 128


def _ids(vocab: int = VOCAB, b: int = B, s: int = S, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


_FORCED: list[str] = []     # set by the *_sdpa builders below


def _make(model_cls, cfg_cls, **kw):
    """``model_cls`` in training mode, random weights, attention as ``ATTENTION`` asks where supported."""
    cfg = cfg_cls(**kw)
    wanted = _FORCED[-1] if _FORCED else ATTENTION
    cfg._attn_implementation = wanted if getattr(model_cls, "_supports_sdpa", False) else "eager"
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return model_cls(cfg).train()


def _causal(cfg_cls, model_cls, **kw):
    model = _make(model_cls, cfg_cls, **kw)
    ids = _ids(kw.get("vocab_size", VOCAB))
    # as users write it: the model shifts the labels itself, so they are the very same tensor
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def llama():
    return _causal(tf.LlamaConfig, tf.LlamaForCausalLM, **_DEC)


def mistral():
    return _causal(tf.MistralConfig, tf.MistralForCausalLM, **_DEC, sliding_window=8)


def qwen2():
    return _causal(tf.Qwen2Config, tf.Qwen2ForCausalLM, **_DEC)


def qwen3():
    return _causal(tf.Qwen3Config, tf.Qwen3ForCausalLM, **_DEC, head_dim=8)


# Mixtures of experts as transformers 5.x ships them: the experts run through the custom operator
# torch.ops.transformers.grouped_mm_fallback (transformers.integrations.moe) on the CPU.
def mixtral():
    return _causal(tf.MixtralConfig, tf.MixtralForCausalLM, **_DEC, num_local_experts=4, num_experts_per_tok=2)


def qwen3_moe():
    return _causal(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, **_DEC, head_dim=8, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32)


def deepseek_v3():
    """DeepSeek-V3: multi-head latent attention fills its keys with copy_ into slices of a new tensor
    (the gradient must reach the source), a shared expert and grouped top-k routing."""
    return _causal(tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=8, q_lora_rank=16,
                   qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, n_group=2, topk_group=1,
                   num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64)


def deepseek_v2():
    """DeepSeek-V2: its rotary embedding multiplies complex64 tensors (view_as_complex), which cross
    stage boundaries and must carry gradients like floating-point ones."""
    return _causal(tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=8, q_lora_rank=16,
                   qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, n_group=2, topk_group=1,
                   num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gemma():
    return _causal(tf.GemmaConfig, tf.GemmaForCausalLM, **_DEC, head_dim=8)


def gemma2():
    return _causal(tf.Gemma2Config, tf.Gemma2ForCausalLM, **_DEC, head_dim=8, sliding_window=8)


def phi3():
    kw = dict(_DEC)
    return _causal(tf.Phi3Config, tf.Phi3ForCausalLM, **kw, pad_token_id=0)


def gpt_neox():
    return _causal(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def falcon():
    return _causal(tf.FalconConfig, tf.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, new_decoder_architecture=False, multi_query=True, alibi=False)


def bloom():
    return _causal(tf.BloomConfig, tf.BloomForCausalLM, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)


def gpt2():
    return _causal(tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                   n_positions=64, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def opt():
    return _causal(tf.OPTConfig, tf.OPTForCausalLM, vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)


def phi():
    return _causal(tf.PhiConfig, tf.PhiForCausalLM, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def gpt_neo():
    return _causal(tf.GPTNeoConfig, tf.GPTNeoForCausalLM, vocab_size=VOCAB, hidden_size=32, num_layers=2,
                   num_heads=4, attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                   window_size=8)


def _encdec(cfg_cls, model_cls, **kw):
    base = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2)
    base.update(kw)
    model = _make(model_cls, cfg_cls, **base)
    src = _ids(seed=1)
    labels = _ids(s=8, seed=2)
    return model, (src,), {"labels": labels, "use_cache": False}


def marian():
    return _encdec(tf.MarianConfig, tf.MarianMTModel)


def pegasus():
    return _encdec(tf.PegasusConfig, tf.PegasusForConditionalGeneration)


def mbart():
    return _encdec(tf.MBartConfig, tf.MBartForConditionalGeneration)


def bart():
    return _encdec(tf.BartConfig, tf.BartForConditionalGeneration)


def t5():
    model = _make(tf.T5ForConditionalGeneration, tf.T5Config, vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8,
                  num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return model, (_ids(seed=1),), {"labels": _ids(s=8, seed=2), "use_cache": False}


def _mlm(cfg_cls, model_cls, **kw):
    model = _make(model_cls, cfg_cls, **kw)
    ids = _ids(kw.get("vocab_size", VOCAB))
    labels = _ids(kw.get("vocab_size", VOCAB), seed=5)
    return model, (ids,), {"labels": labels}


_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def bert():
    return _mlm(tf.BertConfig, tf.BertForMaskedLM, **_ENC)


def albert():
    return _mlm(tf.AlbertConfig, tf.AlbertForMaskedLM, **_ENC, embedding_size=16)


def roberta():
    return _mlm(tf.RobertaConfig, tf.RobertaForMaskedLM, **_ENC, pad_token_id=1)


def electra():
    return _mlm(tf.ElectraConfig, tf.ElectraForMaskedLM, **_ENC, embedding_size=16)


def distilbert():
    model = _make(tf.DistilBertForMaskedLM, tf.DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                  hidden_dim=64, max_position_embeddings=64)
    return model, (_ids(),), {"labels": _ids(seed=5)}


def deberta_v2():
    return _mlm(tf.DebertaV2Config, tf.DebertaV2ForMaskedLM, **_ENC)


def bert_token_classification():
    """Tagging as it is fine-tuned: right-padded rows, labels -100 (ignored) on the padding, so the
    example's labels span -100 .. num_labels - 1."""
    model = _make(tf.BertForTokenClassification, tf.BertConfig, **_ENC, num_labels=5)
    ids, mask = _ids(), torch.ones(B, S, dtype=torch.int64)
    mask[1, 9:] = 0
    ids[1, 9:] = 0
    labels = _ids(5, seed=5)
    labels[mask == 0] = -100
    return model, (ids,), {"attention_mask": mask, "labels": labels}


def vit_mae():
    model = _make(tf.ViTMAEForPreTraining, tf.ViTMAEConfig, image_size=32, patch_size=8, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, decoder_hidden_size=32,
                  decoder_num_hidden_layers=1, decoder_num_attention_heads=4, decoder_intermediate_size=64)
    pixels = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    return model, (pixels,), {}


def m2m100():
    """M2M100: its sinusoidal position embedding runs under @torch.no_grad() (a no-grad region)."""
    return _encdec(tf.M2M100Config, tf.M2M100ForConditionalGeneration)


class _Autocast(torch.nn.Module):
    """Mixed-precision training as users write it: the whole forward under ``torch.autocast``."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, input_ids, labels):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.inner(input_ids=input_ids, labels=labels, use_cache=False)


def gpt2_autocast():
    """GPT-2 under autocast(bfloat16), with its upcast attention (an autocast-disabled region inside)."""
    model, _args, kwargs = _causal(tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2,
                                   n_head=4, n_positions=64, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                                   reorder_and_upcast_attn=True)
    return _Autocast(model).train(), (), {"input_ids": kwargs["input_ids"], "labels": kwargs["labels"]}


def m2m100_layerdrop():
    """M2M100 as its config ships (layerdrop 0.05): a layer is skipped when torch.rand([]) says so,
    Python control flow on a tensor's value, which no static pipeline can hold (refused)."""
    return _encdec(tf.M2M100Config, tf.M2M100ForConditionalGeneration, encoder_layerdrop=0.05,
                   decoder_layerdrop=0.05)


# --------------------------------------------------------------------------- more of today's architectures
# (a sweep of transformers 5.24's families beyond the ones above; slow tests)

_TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MIXED_LAYERS = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def gemma3():
    return _causal(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, **_DEC, **_TOK, head_dim=8, query_pre_attn_scalar=8,
                   **_MIXED_LAYERS)


def cohere2():
    return _causal(tf.Cohere2Config, tf.Cohere2ForCausalLM, **_DEC, **_TOK, head_dim=8, **_MIXED_LAYERS)


def olmo2():
    return _causal(tf.Olmo2Config, tf.Olmo2ForCausalLM, **_DEC, **_TOK)


def granite():
    return _causal(tf.GraniteConfig, tf.GraniteForCausalLM, **_DEC, **_TOK, embedding_multiplier=12.0,
                   residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)


def starcoder2():
    return _causal(tf.Starcoder2Config, tf.Starcoder2ForCausalLM, **_DEC, **_TOK, sliding_window=8)


def smollm3():
    return _causal(tf.SmolLM3Config, tf.SmolLM3ForCausalLM, **_DEC, **_TOK, no_rope_layer_interval=2)


def glm4():
    return _causal(tf.Glm4Config, tf.Glm4ForCausalLM, **_DEC, **_TOK, head_dim=8)


def gptj():
    return _causal(tf.GPTJConfig, tf.GPTJForCausalLM, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                   rotary_dim=4, n_positions=64, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def qwen2_moe():
    return _causal(tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, **_DEC, **_TOK, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32)


def olmoe():
    return _causal(tf.OlmoeConfig, tf.OlmoeForCausalLM, **_DEC, **_TOK, num_experts=4, num_experts_per_tok=2)


def gpt_oss():
    return _causal(tf.GptOssConfig, tf.GptOssForCausalLM, **_DEC, **_TOK, head_dim=8, num_local_experts=4,
                   num_experts_per_tok=2, **_MIXED_LAYERS)


def modernbert():
    return _mlm(tf.ModernBertConfig, tf.ModernBertForMaskedLM, **_ENC, **_TOK,
                local_attention=8, global_attn_every_n_layers=2, cls_token_id=1, sep_token_id=2)


def mamba2():
    """Mamba-2 (no attention: the state-space scan in plain PyTorch on the CPU)."""
    model = _make(tf.Mamba2ForCausalLM, tf.Mamba2Config, vocab_size=VOCAB, hidden_size=32, state_size=8,
                  num_hidden_layers=2, expand=2, conv_kernel=4, num_heads=8, head_dim=8, n_groups=1, chunk_size=8,
                  time_step_rank=4)
    ids = _ids()
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def whisper():
    """Whisper: a speech encoder over log-mel features (convolutions) and a text decoder."""
    model = _make(tf.WhisperForConditionalGeneration, tf.WhisperConfig, vocab_size=VOCAB, num_mel_bins=8,
                  d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                  max_target_positions=32, decoder_start_token_id=1, begin_suppress_tokens=None,
                  suppress_tokens=None, **_TOK)
    feats = torch.randn(B, 8, 32, generator=torch.Generator().manual_seed(3))     # 2 x max_source_positions frames
    return model, (feats,), {"labels": _ids(s=8, seed=2), "use_cache": False}


def _sdpa(builder):
    """The same architecture with torch's fused scaled_dot_product_attention (transformers' default)."""
    def build():
        _FORCED.append("sdpa")
        try:
            return builder()
        finally:
            _FORCED.pop()
    build.__doc__ = f"{builder.__name__} with SDPA attention"
    return build


llama_sdpa = _sdpa(llama)
gpt2_sdpa = _sdpa(gpt2)
bert_sdpa = _sdpa(bert)
bart_sdpa = _sdpa(bart)
t5_sdpa = _sdpa(t5)
qwen3_sdpa = _sdpa(qwen3)
