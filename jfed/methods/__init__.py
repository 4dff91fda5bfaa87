"""Federated methods, each a small module registered by name."""
from jfed.methods.context import RunContext
from jfed.methods.registry import available_methods, get_method, register_method
