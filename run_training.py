"""Train a Gemma-family model: python run_training.py [hydra overrides...] (also `tunix-train`).

Exit codes (tunix_train/exit_codes.py): 0 done, 2 a config error, 3 a non-finite step
(nan_policy=stop), 75 preempted (SIGTERM: checkpoint saved, restart me), other: a failure.

    python run_training.py model=gemma3_1b model.mesh_shape=[[4,1],["fsdp","tp"]] training.micro_batch_size=4
"""

import sys

from tunix_train.run import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
