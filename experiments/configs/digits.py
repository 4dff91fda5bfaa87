"""The config jfed/configs/digits.py by its checkout path
(`--config=digits` names it too)."""

from jfed.configs.digits import get_config

__all__ = ['get_config']
