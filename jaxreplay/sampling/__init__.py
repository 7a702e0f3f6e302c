"""Jitted generation: prefill + KV-cache decode loop, recording behaviour log-probs."""

from jaxreplay.sampling.generate import Generation, generate, postprocess_stops

__all__ = ["Generation", "generate", "postprocess_stops"]
