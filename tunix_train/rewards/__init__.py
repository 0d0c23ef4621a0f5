"""Verifiable rewards for training.objective=grpo: functions `fn(prompts, completions, **fields)`
returning one number per completion, named in training.rollout.reward as `module:function`."""
