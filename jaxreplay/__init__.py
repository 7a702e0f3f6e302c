"""jaxreplay: RL post-training of LLMs with experience replay, in JAX.

Pipeline (one package per stage): ``tasks`` (prompts + verifiable rewards) →
``sampling`` (jitted generation with behaviour log-probs) → ``replay`` (device
ring buffer) → ``rl`` (advantages, off-policy losses, train step) → ``train``
(the loop, checkpointing, evaluation). ``models`` holds the decoder.
"""

__version__ = "0.1.0"
