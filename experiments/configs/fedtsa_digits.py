"""The config jfed/configs/fedtsa_digits.py by its checkout path
(`--config=fedtsa_digits` names it too)."""

from jfed.configs.fedtsa_digits import get_config

__all__ = ['get_config']
