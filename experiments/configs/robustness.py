"""The config jfed/configs/robustness.py by its checkout path
(`--config=robustness` names it too)."""

from jfed.configs.robustness import get_config

__all__ = ['get_config']
