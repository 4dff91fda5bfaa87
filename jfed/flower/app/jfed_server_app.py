"""The Flower App's ServerApp: jfed's driver (jfed/flower/server_app.py)."""

from jfed.flower.server_app import server_app

__all__ = ['server_app']
