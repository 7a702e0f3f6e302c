"""temporary re-exports; removed once jaxreplay/train imports the new modules.

``make_optimizer`` here is ``train_step.scheduled_adamw`` (the flat signature the train
package calls); ``train_step.make_optimizer`` takes the ``algo`` section instead.
"""

from jaxreplay.rl.objective import objective, policy_loss  # noqa: F401
from jaxreplay.rl.scoring import LOGP_FLOOR, policy_and_values, token_logprobs  # noqa: F401
from jaxreplay.rl.spec import KL_MODES, SCHEDULES, AlgoSpec  # noqa: F401
from jaxreplay.rl.train_step import TrainState, init_train_state, make_train_step  # noqa: F401
from jaxreplay.rl.train_step import scheduled_adamw as make_optimizer  # noqa: F401
