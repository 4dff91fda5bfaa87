"""The Flower App's ClientApp (jfed/flower/client_app.py): its own module, so that the process
Flower starts for every message imports no JAX."""

from jfed.flower.client_app import client_app

__all__ = ['client_app']
