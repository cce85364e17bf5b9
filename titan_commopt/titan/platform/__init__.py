"""The machine and the process around a run: CPU, console noise, torchrun restarts, one-line stops."""
