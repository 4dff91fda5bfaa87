"""The config jfed/configs/fedmho_digits.py by its checkout path
(`--config=fedmho_digits` names it too)."""

from jfed.configs.fedmho_digits import get_config

__all__ = ['get_config']
