"""Decoder-only transformer (Flax NNX), KV cache, Hugging Face checkpoints and tokenizers."""

from jaxreplay.models.transformer import (KVCache, Transformer, TransformerConfig,
                                          init_cache, positions_from_mask)
from jaxreplay.models.hf import (CheckpointMismatchError, config_from_hf, from_pretrained,
                                 load_params, save_pretrained)
from jaxreplay.models.hf_tokenizer import HFTokenizer
from jaxreplay.models.logit_processing import process_logits, token_logprobs_from_logits

__all__ = ["CheckpointMismatchError", "HFTokenizer", "KVCache", "Transformer", "TransformerConfig",
           "config_from_hf", "from_pretrained", "init_cache", "load_params", "positions_from_mask",
           "process_logits", "save_pretrained", "token_logprobs_from_logits"]
