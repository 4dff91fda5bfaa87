"""The Flower App's components: jfed's ServerApp and ClientApp (jfed/flower/apps.py)."""

from jfed.flower.apps import client_app, server_app

__all__ = ['client_app', 'server_app']
