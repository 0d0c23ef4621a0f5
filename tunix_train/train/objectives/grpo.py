"""Group relative policy optimization: not built yet (issue 22 continues)."""

from tunix_train.config import ConfigError


class GroupRelative:
    def __init__(self, cfg):
        raise ConfigError("training.objective=grpo is not available yet")
