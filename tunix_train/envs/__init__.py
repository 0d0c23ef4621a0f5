"""Multi-turn environments for RL (training.rollout.environment, training.rollout.tools): the model talks
with an environment over several turns, and the loss covers its own tokens only.

- environment.py: `Environment`, reset(record) -> messages and step(messages) -> (observation
  messages, reward or None, done); `ToolEnvironment`, the one that runs tools;
- tools.py: tools as plain Python functions, their JSON schemas (transformers' get_json_schema),
  the tool-call formats, and calls under a timeout;
- rollout.py: the turns of many conversations at once through the inference engine.
"""
