"""jfed/configs/fashion_mnist.py, by its checkout path.

`--config=fashion_mnist` names it too. The module's names are copied here for the scripts
that read them (VARIANTS, ...).
"""

from jfed.configs import fashion_mnist as _config

globals().update({k: v for k, v in vars(_config).items() if not k.startswith('__')})
