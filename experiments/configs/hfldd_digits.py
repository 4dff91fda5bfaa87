"""The config jfed/configs/hfldd_digits.py by its checkout path
(`--config=hfldd_digits` names it too)."""

from jfed.configs.hfldd_digits import get_config

__all__ = ['get_config']
