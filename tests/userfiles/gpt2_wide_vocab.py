"""GPT-2 (transformers' GPT2LMHeadModel) with a vocabulary far wider than its layers: the logits
and the loss dominate what the last stage holds, as in real language models."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    cfg = GPT2Config(vocab_size=8192, n_positions=128, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 8192, (8, 128))
    return model, (), {"input_ids": ids, "labels": ids}
