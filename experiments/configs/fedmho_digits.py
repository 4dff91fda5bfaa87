"""jfed/configs/fedmho_digits.py, by its checkout path.

`--config=fedmho_digits` names it too. The module's names are copied here for the scripts
that read them (VARIANTS, ...).
"""

from jfed.configs import fedmho_digits as _config

globals().update({k: v for k, v in vars(_config).items() if not k.startswith('__')})
