"""A method of one's own: FedAvg with server momentum (FedAvgM, Hsu et al. 2019), on jfed.

Every round the clients train from the global model and the server averages their models
(weighted by client size, `jfed.methods.common.fedavg_round`). FedAvg's step, model − average,
lands on the average; FedAvgM adds momentum: velocity = step + β·velocity, model −= velocity
(BatchNorm statistics are the average's, as in FedAvg). jfed's own `fedavg` does the same with
`server_optimizer.name='fedavgm'`; this file shows how a method is built, registered and run
from outside the repository (docs/driver.md). The uploads go through `common.Server` (upload
validation, the aggregation rule, simulated attacks); add `server_round = True` to the class to
let runs set a rule or an attack other than the defaults, which the driver refuses otherwise.

`rounds` has no default, so `jfed.config(...)` has no `fedavgm.rounds` key and a run must set it
(otherwise: ConfigError 'fedavgm.rounds is missing from the config ...').

    python examples/custom_method.py        # digits, 5 clients, Dir(0.5), 5 rounds: about 95%

Or `import custom_method` (it registers 'fedavgm'), then `jfed.run('fedavgm', config)`.
"""

from typing import NamedTuple

import jax

import jfed
from jfed import engine
from jfed.keys import Purpose
from jfed.methods import common


class FedAvgMConfig(NamedTuple):
  rounds: int  # no default: a run sets config.fedavgm.rounds
  local_epochs: int = 1
  server_momentum: float = 0.5


@jfed.register_method('fedavgm')
class FedAvgM(jfed.Algorithm):
  section, Config = 'fedavgm', FedAvgMConfig

  def num_steps(self, ctx):
    return self.config.rounds

  def setup(self, ctx):
    common.single_architecture(ctx)  # ConfigError unless every client has the same model
    g, key = common.client_groups(ctx)[0], ctx.derive_key(Purpose.MODEL_INIT, 0)
    init = engine.init_model(g.module, ctx.dataset.input_shape, key)
    trainer, server = common.make_trainers(ctx, [g])[0], common.make_server(ctx)
    return g, common.RoundParts(trainer, self.config.local_epochs, init, server), init

  def init(self, ctx, aux):
    return aux[2], jax.tree.map(jax.numpy.zeros_like, aux[2].params)  # (model, velocity)

  def step(self, ctx, aux, state, i):
    (group, parts, _), (model, velocity), m = aux, state, self.config.server_momentum
    key, data = ctx.derive_key(Purpose.ROUNDS, i), ctx.dataset
    avg, record = common.fedavg_round(parts, group, model, key, i)
    velocity = jax.tree.map(lambda g, a, v: g - a + m * v, model.params, avg.params, velocity)
    model = avg._replace(params=jax.tree.map(lambda g, v: g - v, model.params, velocity))
    accuracy = engine.TrainedModel(group.module, model).accuracy(data.test_x, data.test_y)
    return (model, velocity), [{'round': i + 1, 'test_accuracy': accuracy, **record}]

  def trained_model(self, ctx, aux, state):  # what jfed.run(...).model returns
    return engine.TrainedModel(aux[0].module, state[0])


if __name__ == '__main__':
  config = jfed.config('digits', 'smoke')
  config.fedavgm.rounds = 5
  print('FedAvgM test accuracy:', jfed.run('fedavgm', config).summary['final_test_accuracy'])
