"""DENSE (Zhang et al., NeurIPS 2022), `github.com/zj-jayzhang/DENSE`, `loop_df_fl.py`.

Stage `pretrain`: every client trains a copy of one initial CNNMnist (SGD, momentum 0.9, batch
`local_bs`) and is tested after each local epoch; then the uniform parameter average (the code's
FedAvg, `average_weights`) and the mean-logit ensemble are tested. Stage `kd_train`: DENSE's
data-free distillation into a fresh student, tested after every epoch (README's flags).
"""

from typing import Any, Dict, Mapping

from experiments.parity.references import (
  SHIMS,
  Budget,
  ParityMethod,
  Reference,
  local_rows,
)

DEFAULT_BUDGET: Budget = {
  'local_epochs': 10,
  'local_lr': 0.01,
  'local_batch': 128,
  # jfed's side: 'eval_after_first_epoch' is what the code does ('train': jfed's default)
  'local_bn': 'eval_after_first_epoch',
  'kd_epochs': 30,  # README: 200
  'g_steps': 30,
  'synthesis_batch': 256,
  'kd_batch': 256,
  'kd_lr': 0.005,
  'kd_T': 20.0,
  'lr_g': 1e-3,
  'bn': 1.0,
  'oh': 1.0,
  'adv': 1.0,
}


def stage_args(stage: str, names: Mapping[str, str], b: Budget, seed: int, clients: int):
  common = [
    f'--type={stage}',
    '--iid=0',
    f'--model={names["model"]}',
    f'--dataset={names["dataset"]}',
    f'--seed={seed}',
    f'--num_users={clients}',
  ]
  if stage == 'pretrain':
    return common + [
      f'--lr={b["local_lr"]}',
      f'--local_ep={b["local_epochs"]}',
      f'--local_bs={b["local_batch"]}',
    ]
  return common + [
    f'--epochs={b["kd_epochs"]}',
    f'--lr={b["kd_lr"]}',
    f'--batch_size={b["kd_batch"]}',
    f'--synthesis_batch_size={b["synthesis_batch"]}',
    f'--g_steps={b["g_steps"]}',
    f'--lr_g={b["lr_g"]}',
    f'--bn={b["bn"]}',
    f'--oh={b["oh"]}',
    f'--adv={b["adv"]}',
    f'--T={b["kd_T"]}',
    '--save_dir=run/synthesis',
    '--other=parity',
  ]


def read(stage: str, recorded: Mapping[str, Any], clients: int, b: Budget) -> Dict[str, Any]:
  """What the shim's recorded `test` calls mean, in the order the reference makes them."""
  acc = [float(t['accuracy']) for t in recorded['tests']]
  if stage == 'pretrain':
    e = int(b['local_epochs'])
    expected = clients * e + 2
    if len(acc) != expected:
      raise ValueError(f'DENSE pretrain recorded {len(acc)} tests, expected {expected}')
    curves = [acc[k * e : (k + 1) * e] for k in range(clients)]
    return {
      'rows': local_rows([c[-1] for c in curves], acc[-1], acc[-2]),
      'client_curves': curves,
    }
  expected = 2 + int(b['kd_epochs'])
  if len(acc) != expected:
    raise ValueError(f'DENSE kd_train recorded {len(acc)} tests, expected {expected}')
  curve = acc[2:]
  return {'rows': {'DENSE final': curve[-1], 'DENSE best': max(curve)}, 'curve': curve}


def _local(b: Budget) -> Dict[str, Any]:
  return {
    'model': 'cnn_mnist',
    'optimizer.name': 'sgd',
    'optimizer.lr': b['local_lr'],
    'optimizer.momentum': 0.9,
    'optimizer.weight_decay': 0.0,
    'batch_size': b['local_batch'],
    # LocalUpdate tests after every epoch, and `test` leaves the model in eval mode
    'local_bn': b['local_bn'],
    'local.epochs': b['local_epochs'],
    'fedavg.rounds': 1,
    'fedavg.local_epochs': b['local_epochs'],
    'fedavg.reuse_local_models': True,
  }


def _dense(b: Budget) -> Dict[str, Any]:
  return {
    **_local(b),
    'dense.local_epochs': b['local_epochs'],
    'dense.epochs': b['kd_epochs'],
    'dense.g_steps': b['g_steps'],
    'dense.synthesis_batch': b['synthesis_batch'],
    'dense.kd_batch': b['kd_batch'],
    'dense.kd_lr': b['kd_lr'],
    'dense.kd_T': b['kd_T'],
    'dense.lr_g': b['lr_g'],
    'dense.bn': b['bn'],
    'dense.oh': b['oh'],
    'dense.adv': b['adv'],
    # DENSE's code attaches no BN hook (its models sit in a plain list): its BN loss is 0
    'dense.bn_loss_mode': 'code',
  }


REFERENCE = Reference(
  name='dense',
  repository='zj-jayzhang/DENSE',
  marker='loop_df_fl.py',
  shim=SHIMS / 'dense_shim.py',
  datasets={'fashion_mnist': {'dataset': 'fmnist', 'model': 'fmnist_cnn'}},
  torchvision_folder={'fashion_mnist': 'FashionMNIST'},
  default_budget=DEFAULT_BUDGET,
  stage_args=stage_args,
  read=read,
  methods={
    # one-shot FedAvg: the clients, their ensemble and their average
    'fedavg': ParityMethod(('pretrain',), ('fedavg',), {'fedavg': 'FedAvg (jfed fedavg)'}, _local),
    'dense': ParityMethod(
      ('pretrain', 'kd_train'),
      ('fedavg', 'dense'),
      {'fedavg': 'FedAvg (jfed fedavg)', 'dense': 'DENSE'},
      _dense,
    ),
  },
)
