"""The reference codes a parity run can drive, one module each (`ref_<name>.py`).

A reference is run from a scratch copy of the user's checkout (`--reference_dir`; never from
this repository, which holds none of the authors' code), by the interpreter that has its
dependencies (`--reference_python`), through a shim in `experiments/parity/shims/` that is the
whole patch: device, data path, partition file, stubs for W&B. Budget values go to the reference
as its own flags.

A reference module defines `REFERENCE`, a `Reference`: its stages, the flags of each, how to
read what its shim recorded (rows of the parity table: name -> accuracy in %), and, per parity
method, the jfed methods and config values that run the same thing.
"""

import dataclasses
import pathlib
import shutil
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

SHIMS = pathlib.Path(__file__).resolve().parent / 'shims'

Budget = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParityMethod:
  """One `--method` of the harness."""

  stages: Tuple[str, ...]  # the reference's stages, in order (one subprocess each)
  jfed_methods: Tuple[str, ...]  # jfed methods run after the shared local models
  labels: Mapping[str, str]  # jfed method -> its rows' label ('DENSE' -> 'DENSE final' ...)
  # budget -> jfed config values (dotted keys) that run what the reference runs
  jfed_overrides: Callable[[Budget], Dict[str, Any]]
  # whether jfed's side also reports its shared local models (clients, ensemble, uniform
  # average: `jfed_side.local_results`, one architecture); False: the methods' summaries only
  jfed_local: bool = True


@dataclasses.dataclass(frozen=True)
class Reference:
  """How to run one authors' code and read it."""

  name: str
  repository: str  # owner/name of the public repository
  marker: str  # a file every checkout of it has (checks --reference_dir)
  shim: pathlib.Path
  datasets: Mapping[str, Mapping[str, str]]  # jfed dataset -> the reference's names for it
  default_budget: Budget
  # (stage, dataset names, budget, seed, clients) -> the reference's flags
  stage_args: Callable[[str, Mapping[str, str], Budget, int, int], Sequence[str]]
  # (stage, what the shim recorded, clients, budget) -> {'rows': {...}, ...}
  read: Callable[[str, Mapping[str, Any], int, Budget], Dict[str, Any]]
  methods: Mapping[str, ParityMethod]
  torchvision_folder: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def prepare(self, reference_dir: pathlib.Path, scratch: pathlib.Path) -> pathlib.Path:
    """A scratch copy of the user's checkout (their files are never edited)."""
    if not (reference_dir / self.marker).is_file():
      raise ValueError(
        f'{reference_dir} holds no {self.marker}: not a checkout of {self.repository}'
      )
    copy = scratch / f'{self.name}_code'
    if not copy.exists():
      tmp = scratch / f'.{self.name}_code.tmp'
      shutil.rmtree(tmp, ignore_errors=True)
      shutil.copytree(reference_dir, tmp, ignore=shutil.ignore_patterns('.git', '__pycache__'))
      tmp.rename(copy)
    return copy


def local_rows(
  clients: Sequence[float], ensemble: float, uniform: Optional[float]
) -> Dict[str, float]:
  """The rows every one-shot reference shares: each client's own model, their mean, the
  mean-logit teacher ensemble and the uniform parameter average."""
  rows = {f'client {k}': float(a) for k, a in enumerate(clients)}
  rows['mean of the clients'] = float(sum(clients) / len(clients))
  rows['teacher ensemble (mean logits)'] = float(ensemble)
  if uniform is not None:
    rows['FedAvg, uniform average'] = float(uniform)
  return rows


def parse_budget(default: Budget, pairs: Sequence[str]) -> Budget:
  """`default` with the `key=value` overrides, each converted to its default's type; ValueError
  naming the pair otherwise."""
  budget = dict(default)
  for pair in pairs:
    key, sep, value = pair.partition('=')
    if not sep or key not in budget:
      raise ValueError(f'{pair!r} is not KEY=VALUE with KEY one of {sorted(budget)}')
    kind = type(budget[key])
    try:
      budget[key] = kind(value)
    except ValueError:
      raise ValueError(f'{key} takes a {kind.__name__}, got {value!r}') from None
  return budget


def registry() -> Dict[str, Reference]:
  """Every reference, by name (imported here so a reference module may import this one)."""
  from experiments.parity import ref_coboosting, ref_dense, ref_fedcvae, ref_fedmho  # pylint: disable=g-import-not-at-top

  refs = [r.REFERENCE for r in (ref_dense, ref_fedcvae, ref_coboosting, ref_fedmho)]
  return {r.name: r for r in refs}


def find_method(method: str) -> Tuple[Reference, ParityMethod]:
  """The reference that runs parity method `method` (e.g. 'dense' or 'dense:fedavg')."""
  refs = registry()
  ref_name, _, name = method.partition(':')
  if not name:
    ref_name, name = ref_name, ref_name
  if ref_name not in refs or name not in refs[ref_name].methods:
    known = [f'{r}:{m}' for r, ref in refs.items() for m in ref.methods]
    raise ValueError(f'unknown parity method {method!r}; known: {", ".join(known)}')
  return refs[ref_name], refs[ref_name].methods[name]
