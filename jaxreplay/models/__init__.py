"""Decoder-only transformer (Flax NNX), KV cache, tokenizer helpers."""

from jaxreplay.models.transformer import (KVCache, Transformer, TransformerConfig,
                                          init_cache, positions_from_mask)

__all__ = ["KVCache", "Transformer", "TransformerConfig", "init_cache", "positions_from_mask"]
