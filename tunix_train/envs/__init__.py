"""Multi-turn environments for RL (training.rollout.environment, training.rollout.tools): the model talks
with an environment over several turns, and the loss covers its own tokens only.

- environment.py: `Environment`, reset(record) -> messages and step(messages) -> (observation
  messages, reward or None, done); `ToolEnvironment`, the one that runs tools;
- tools.py: tools as plain Python functions, their JSON schemas (transformers' get_json_schema),
  the tool-call formats, and calls under a timeout;
- openenv.py: an OpenEnv environment server as the environment (training.rollout.environment=openenv);
- rollout.py: the turns of many conversations at once through the inference engine.
"""


def environment_for(rollout) -> type:
    """training.rollout's environment class: an OpenEnv server's (openenv), else environment_class's."""
    if rollout.environment == "openenv":
        from tunix_train.envs.openenv import bound_class

        return bound_class(rollout.openenv, rollout.tool_timeout_s)
    from tunix_train.envs.environment import environment_class

    return environment_class(rollout.environment)
