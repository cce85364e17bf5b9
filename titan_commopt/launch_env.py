"""What ``python -m titan_commopt.run`` puts in its workers' environment, named once for both sides:
the launcher (``titan_commopt/run.py``) sets these and the workers (``titan/platform/``) read them.
Plain constants, so that neither side imports the other."""

LAUNCHER_ENV = "TITAN_COMMOPT_LAUNCHER"  # =<its pid>: the workers leave printing our stop lines to the launcher,
# and die with it under fault tolerance (titan/platform/launcher_death.py)
WARNED_ENV = "TITAN_COMMOPT_WARNED"  # =1: the launcher printed the config warnings; the workers do not
FRESH_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # a fresh rendezvous store per torchrun restart
