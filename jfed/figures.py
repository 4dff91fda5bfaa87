"""Every figure jfed and its experiments write goes through `save_png`."""

import io
import pathlib

from PIL import Image

from jfed.workdir import atomic_write_bytes

# Matplotlib's plots hold far fewer colours than this, and a grey-scale sample grid 256 at most.
PALETTE_COLOURS = 256


def save_png(fig, path) -> str:
  """Writes the matplotlib figure `fig` to `path` as a palette PNG; returns the path.

  A palette of PALETTE_COLOURS keeps the picture as drawn at about 40 % of the bytes of
  matplotlib's RGBA file, so that the curated figures of docs/results stay small (issue 84). The
  write is atomic (a run killed while drawing leaves no torn file, and a resumed run may keep
  the one it finds); parent directories are created.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  drawn = io.BytesIO()
  fig.savefig(drawn, format='png')
  drawn.seek(0)
  with Image.open(drawn) as image:
    palette = image.convert('RGB').quantize(PALETTE_COLOURS, method=Image.Quantize.MEDIANCUT)
  out = io.BytesIO()
  palette.save(out, format='PNG', optimize=True)
  atomic_write_bytes(path, out.getvalue())
  return str(path)
