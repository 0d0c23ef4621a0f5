"""What a training process's exit code tells a launcher or a scheduler. run_training.py returns
these; the launchers' --max_restarts (launch/restart.py) and the Kubernetes manifest's
podFailurePolicy (scripts/k8s/) act on them."""

OK = 0
FAILED = 1  # anything else that went wrong: a crash, a lost peer
CONFIG_ERROR = 2  # bad config or input, or out of memory: a restart would fail the same way
NON_FINITE = 3  # training.nan_policy=stop ended the run: a restart would meet the same step
PREEMPTED = 75  # SIGTERM: a checkpoint of the current step was saved; restart me (EX_TEMPFAIL, sysexits.h)

NOT_RESTARTED = (OK, CONFIG_ERROR, NON_FINITE)
