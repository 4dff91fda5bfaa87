"""jfed model zoo: `get_model(name, num_classes, input_shape, **kw)`, `available_models()`."""

from jfed.models import cnn, googlenet, resnet, vgg  # noqa: F401  (register the models)
from jfed.models.layers import BatchNorm
from jfed.models.registry import available_models, get_model, param_count, register_model

__all__ = ['BatchNorm', 'available_models', 'get_model', 'param_count', 'register_model']
