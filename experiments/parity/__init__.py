"""The parity harness: jfed side by side with the authors' own code (`python -m
experiments.parity`, its docstring)."""
