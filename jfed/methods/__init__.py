"""Federated methods, each a small `Algorithm` module registered by name."""

from jfed.api import Algorithm, RunContext, RunSummary
from jfed.methods.registry import available_methods, get_method, register_method
