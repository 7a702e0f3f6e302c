"""Device-resident FIFO replay buffer of rollouts: pure ``init`` / ``add`` / ``sample``.

See ``buffer`` (state and functions), ``config`` (``SamplerConfig``), ``samplers`` (pure
sampling pieces), ``rate_limiter`` (replay-ratio control) and ``stats`` (batch statistics).
"""

from jaxreplay.replay.buffer import (SAMPLERS, BufferState, ReplayBuffer, SampleResult, add,
                                     can_sample, evict, init, make_replay_buffer, probabilities,
                                     sample, set_columns, shard, size, state_sharding)
from jaxreplay.replay.config import SamplerConfig, from_config

__all__ = ["SAMPLERS", "BufferState", "ReplayBuffer", "SampleResult", "SamplerConfig", "add",
           "can_sample", "evict", "from_config", "init", "make_replay_buffer", "probabilities",
           "sample", "set_columns", "shard", "size", "state_sharding"]
