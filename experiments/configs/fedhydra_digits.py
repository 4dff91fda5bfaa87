"""The config jfed/configs/fedhydra_digits.py by its checkout path
(`--config=fedhydra_digits` names it too)."""

from jfed.configs.fedhydra_digits import get_config

__all__ = ['get_config']
