"""ALBERT (transformers' AlbertForMaskedLM) at a tiny size: one layer's weights reused by every layer."""

import torch
from transformers import AlbertConfig, AlbertForMaskedLM


def build():
    cfg = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                       num_attention_heads=2, intermediate_size=48, max_position_embeddings=32,
                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    model = AlbertForMaskedLM(cfg)
    ids = torch.randint(0, 64, (2, 16))
    labels = torch.randint(0, 64, (2, 16))
    return model, (), {"input_ids": ids, "labels": labels}
