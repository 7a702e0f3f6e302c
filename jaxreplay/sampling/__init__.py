"""Jitted generation: prefill + KV-cache decode loop, top-k/top-p, behaviour log-probs, sharding."""

from jaxreplay.sampling.generate import Generation, generate, postprocess_stops, sample_token

__all__ = ["Generation", "generate", "postprocess_stops", "sample_token"]
