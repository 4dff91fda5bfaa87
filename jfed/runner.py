"""The command line's path into the driver (kept for existing imports): see jfed.driver."""

from jfed.driver import partition_clients, run_experiment, run_in_memory

__all__ = ['partition_clients', 'run_experiment', 'run_in_memory']
