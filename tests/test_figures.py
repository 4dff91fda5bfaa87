"""jfed/figures.py: a figure written as a palette PNG is the picture matplotlib draws, smaller."""

import io

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from jfed.figures import save_png  # noqa: E402


def test_a_palette_png_is_the_drawn_picture_in_fewer_bytes(tmp_path):
  fig, ax = plt.subplots(figsize=(4, 3))
  x = np.linspace(0, 1, 200)
  for k in range(6):
    ax.plot(x, np.sin(6 * x + k), label=f'curve {k}')
    ax.fill_between(x, np.sin(6 * x + k) - 0.1, np.sin(6 * x + k) + 0.1, alpha=0.2)
  ax.legend()
  drawn = io.BytesIO()
  fig.savefig(drawn, format='png')
  path = tmp_path / 'deep' / 'figure.png'
  assert save_png(fig, path) == str(path)
  plt.close(fig)
  with Image.open(path) as written, Image.open(io.BytesIO(drawn.getvalue())) as reference:
    assert written.mode == 'P'
    got = np.asarray(written.convert('RGB'), np.int32)
    want = np.asarray(reference.convert('RGB'), np.int32)
  assert got.shape == want.shape
  assert np.abs(got - want).mean() < 1.0  # the same picture: off by a level or two at edges
  assert path.stat().st_size < 0.7 * len(drawn.getvalue())
  assert [p.name for p in path.parent.iterdir()] == ['figure.png']  # no temporary file left
