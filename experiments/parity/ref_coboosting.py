"""Co-Boosting (Dai et al., ICLR 2024), `github.com/rong-dai/Co-Boosting`.

Stage `pretrain`, `fl_pretrain.py` (`fl_pretrain.sh`'s flags): every client trains a copy of one
initial `cnn` (CNNCifar; SGD, momentum 0.9, batch `local_bs`, gradient norm clipped to 10), the
shim tests it after each local epoch; then the script tests the uniform parameter average
(`average_weights`) and the mean-logit ensemble (`Ensemble`). Stage `kd`, `datafree_kd.py
--method co_boosting` (`co_boosting.sh`'s flags): hard-sample synthesis against the weighted
ensemble, ensemble-weight updates, ODS distillation into a fresh `cnn`, the student tested after
every epoch; 'Co-Boosting final' is the last epoch's accuracy, 'Co-Boosting best' the script's
`best_acc1`.

Both stages run in one working directory: `datafree_kd.py` loads the client models that
`fl_pretrain.py` saved, by the identity `--fl_model` that names them (`fl_model` below).
The partition arguments of `fl_pretrain.py` only name that file: the split is jfed's.

The code's set-up, on jfed's side as options (both methods: the clients of `fl_pretrain.py` read
the same loaders):
- the reference resizes MNIST / FMNIST to 32x32 (`registry.py:82-107`, bilinear PIL `Resize`)
  and normalises to [-1, 1] (`NORMALIZE_DICT`, mean = std = 0.5; the generator's output is
  normalised before the models, `coboost.py:94`, and the KD loader normalises the pool):
  `dataset.image_size=32` and `dataset.normalization='half'` (the data and G(z) stay in [0, 1],
  the models normalise), so CNNCifar flattens 4x4x128 = 2048 features and the generator makes
  32x32 images (`datafree_kd.py:201-202,225`), as the code's;
- the ensemble weights are updated over the pool before the epoch's batch joins it
  (`coboost.py:135-157`, before `data_pool.add` at line 162): `coboosting.weight_update_order=
  'before_batch'`.
Left as it is: the released `cnn` takes 3-channel inputs; the shim gives it a 1-channel first
convolution (shims/coboosting_shim.py), which is what jfed's 'cnn_cifar' builds for a 1-channel
dataset.
"""

from typing import Any, Dict, Mapping

from experiments.parity.references import (
  SHIMS,
  Budget,
  ParityMethod,
  Reference,
  local_rows,
)

# co_boosting.sh / fl_pretrain.sh and the scripts' defaults, the epochs cut for a CPU
DEFAULT_BUDGET: Budget = {
  'local_epochs': 10,  # fl_pretrain.sh: 100
  'local_lr': 0.01,
  'local_batch': 128,
  'kd_epochs': 30,  # co_boosting.sh: 200
  'g_steps': 30,
  'lr_g': 1e-3,
  'kd_batch': 128,  # --batch_size: the KD and weight-update batch
  'synthesis_batch': 128,  # --synthesis_batch_size (default: --batch_size)
  'kd_lr': 0.01,
  'kd_weight_decay': 1e-4,
  'kd_T': 4.0,
  'adv': 1.0,
  'oh': 1.0,  # --ohg
  'bn': 0.0,
  'hs': 1.0,
  'odseta': 8.0,  # in 1/255 of the normalised input, as the script's flag
  'mu': 0.01,
  'wdc': 0.99,
  'wa_steps': 1,
}

MODEL = 'cnn'  # co_boosting.sh / fl_pretrain.sh: --model cnn, --teacher cnn --student cnn
JFED_MODEL = 'cnn_cifar'  # the same CNNCifar (jfed/models/cnn.py)
BETA, SIGMA = 0.5, 0.0  # fl_pretrain.py's defaults: they only name the saved file here
LOCAL_GRAD_CLIP = 10.0  # fl_pretrain.py:23,64 (max_norm = 10)
KD_GRAD_CLIP = G_GRAD_CLIP = 10.0  # datafree_kd.py:334, coboost.py:123
IMAGE_SIZE = 32  # registry.py:84,89 (mnist), 99,104 (fmnist): T.Resize((32, 32))
NORMALIZATION = 'half'  # registry.py:18-19 NORMALIZE_DICT: mean = std = 0.5 (mnist, fmnist)


def fl_model(names: Mapping[str, str], b: Budget, seed: int, clients: int) -> str:
  """`fl_pretrain.py`'s `args.identity` (its lines 116-117): the name of the saved clients."""
  return (
    f'{names["dataset"]}_clients{clients}_dir{float(BETA)}_sig{float(SIGMA)}_{names["model"]}'
    f'_Llr{float(b["local_lr"])}_Le{int(b["local_epochs"])}_seed{seed}'
  )


def stage_args(stage: str, names: Mapping[str, str], b: Budget, seed: int, clients: int):
  """The script (first) and its flags."""
  if stage == 'pretrain':
    return [
      'fl_pretrain.py',
      f'--dataset={names["dataset"]}',
      '--partition=dir',
      f'--beta={BETA}',
      f'--sigma={SIGMA}',
      f'--seed={seed}',
      f'--num_users={clients}',
      f'--model={names["model"]}',
      f'--local_lr={b["local_lr"]}',
      f'--local_ep={b["local_epochs"]}',
      f'--local_bs={b["local_batch"]}',
    ]
  epochs = int(b['kd_epochs'])
  return [
    'datafree_kd.py',
    '--method=co_boosting',
    f'--dataset={names["dataset"]}',
    f'--fl_model={fl_model(names, b, seed, clients)}',
    f'--teacher={names["model"]}',
    f'--student={names["model"]}',
    f'--batch_size={b["kd_batch"]}',
    f'--synthesis_batch_size={b["synthesis_batch"]}',
    f'--kd_lr={b["kd_lr"]}',
    f'--weight_decay={b["kd_weight_decay"]}',
    f'--kd_T={b["kd_T"]}',
    f'--epochs={epochs}',
    f'--g_steps={b["g_steps"]}',
    f'--lr_g={b["lr_g"]}',
    f'--adv={b["adv"]}',
    f'--ohg={b["oh"]}',
    f'--bn={b["bn"]}',
    f'--hs={b["hs"]}',
    f'--odseta={b["odseta"]}',
    f'--mu={b["mu"]}',
    f'--wdc={b["wdc"]}',
    f'--wa_steps={b["wa_steps"]}',
    f'--seed={seed}',
    # co_boosting.sh: 1, i.e. the student and the weighted ensemble tested (class_test) every
    # epoch besides the evaluator's test; once every `epochs` (the first and the last epoch)
    # saves ~2 test passes per epoch and changes no number of the run
    f'--print_freq={max(1, epochs)}',
  ]


def read(stage: str, recorded: Mapping[str, Any], clients: int, b: Budget) -> Dict[str, Any]:
  """What the shim recorded, in the order the scripts test."""
  tests = recorded['tests']
  if stage == 'pretrain':
    if len(tests) != 2:
      raise ValueError(f'fl_pretrain.py recorded {len(tests)} class_test calls, expected 2')
    curves = recorded['client_curves']
    e = int(b['local_epochs'])
    if len(curves) != clients or any(len(c) != e for c in curves):
      raise ValueError(f'fl_pretrain.py: expected {clients} client curves of {e} epochs')
    uniform, ensemble = (float(t['accuracy']) for t in tests)
    return {'rows': local_rows([c[-1] for c in curves], ensemble, uniform), 'client_curves': curves}
  curve = [float(t['accuracy']) for t in recorded['evals']]
  if len(curve) != int(b['kd_epochs']):
    raise ValueError(f'datafree_kd.py recorded {len(curve)} epochs, expected {b["kd_epochs"]}')
  weighted = [t for t in tests if 'weights' in t]
  return {
    'rows': {'Co-Boosting final': curve[-1], 'Co-Boosting best': max(curve)},
    'curve': curve,
    # the uniform ensemble before the first epoch (= pretrain's ensemble row) and the weighted
    # ensemble after the last, with its weights by client
    'teacher_at_start': weighted[0]['accuracy'],
    'weighted_teacher_final': weighted[-1]['accuracy'],
    'ensemble_weights': weighted[-1]['weights'],
  }


def _local(b: Budget) -> Dict[str, Any]:
  return {
    'dataset.image_size': IMAGE_SIZE,
    'dataset.normalization': NORMALIZATION,
    'model': JFED_MODEL,
    'optimizer.name': 'sgd',
    'optimizer.lr': b['local_lr'],
    'optimizer.momentum': 0.9,
    'optimizer.weight_decay': 0.0,
    'optimizer.grad_clip': LOCAL_GRAD_CLIP,
    'batch_size': b['local_batch'],
    'local.epochs': b['local_epochs'],
    'fedavg.rounds': 1,
    'fedavg.local_epochs': b['local_epochs'],
    'fedavg.reuse_local_models': True,
  }


def _coboosting(b: Budget) -> Dict[str, Any]:
  c = 'coboosting.'
  return {
    **_local(b),
    c + 'rounds': 1,
    c + 'local_epochs': b['local_epochs'],
    c + 'epochs': b['kd_epochs'],
    c + 'server_model': '',
    c + 'init': 'random',
    c + 'nz': 256,
    c + 'ngf': 64,
    c + 'lr_g': b['lr_g'],
    c + 'g_steps': b['g_steps'],
    c + 'synthesis_batch': b['synthesis_batch'],
    c + 'g_grad_clip': G_GRAD_CLIP,
    c + 'synthesis_augment': False,
    c + 'bn': b['bn'],
    c + 'oh': b['oh'],
    c + 'adv': b['adv'],
    c + 'hs': b['hs'],
    c + 'adv_T': 3.0,  # coboost.py:112
    c + 'mu': b['mu'],
    c + 'wdc': b['wdc'],
    c + 'wa_steps': b['wa_steps'],
    c + 'weight_update_order': 'before_batch',  # coboost.py: the update before data_pool.add
    c + 'odseta': b['odseta'] / 255,  # datafree_kd.py:144
    c + 'ods_T': 4.0,  # datafree_kd.py:314
    c + 'kd_T': b['kd_T'],
    c + 'kd_batch': b['kd_batch'],
    c + 'kd_optimizer': 'sgd',
    c + 'kd_lr': b['kd_lr'],
    c + 'kd_momentum': 0.9,
    c + 'kd_weight_decay': b['kd_weight_decay'],
    c + 'kd_schedule': 'cosine_epochs',  # CosineAnnealingLR(T_max=epochs), datafree_kd.py:243
    c + 'kd_grad_clip': KD_GRAD_CLIP,
    # the pool is read back with the dataset's train transform (datafree_kd.py:159,
    # coboost.py:163): for MNIST / FMNIST Resize + ToTensor + Normalize, no flip or crop
    c + 'kd_augment': 'none',
    c + 'pool_quantize': True,  # PNG files, uint8(clamp(0, 1) * 255)
  }


REFERENCE = Reference(
  name='coboosting',
  repository='rong-dai/Co-Boosting',
  marker='datafree_kd.py',
  shim=SHIMS / 'coboosting_shim.py',
  datasets={
    'fashion_mnist': {'dataset': 'fmnist', 'model': MODEL},
    'mnist': {'dataset': 'mnist', 'model': MODEL},
  },
  torchvision_folder={'fashion_mnist': 'FashionMNIST', 'mnist': 'MNIST'},
  default_budget=DEFAULT_BUDGET,
  stage_args=stage_args,
  read=read,
  methods={
    # the clients, their ensemble and their uniform average only (one stage)
    'fedavg': ParityMethod(('pretrain',), ('fedavg',), {'fedavg': 'FedAvg (jfed fedavg)'}, _local),
    'coboosting': ParityMethod(
      ('pretrain', 'kd'),
      ('coboosting',),
      {'coboosting': 'Co-Boosting'},
      _coboosting,
    ),
  },
)
