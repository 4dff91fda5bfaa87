"""Every relative link of the Markdown documents resolves: the file exists and, for `file.md#x`,
the file has a heading whose GitHub anchor is `x`. The reports link into each other by section,
so a renamed heading or a moved section would otherwise leave dead links silently."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [
  ROOT / 'README.md',
  ROOT / 'BUILD_NOTES.md',
  ROOT / 'experiments' / 'bench' / 'README.md',
  *sorted((ROOT / 'docs').glob('*.md')),
]
_FENCE = re.compile(r'^\s{0,3}(`{3,}|~{3,})')
_HEADING = re.compile(r'^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$')
_INLINE = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
_DEFINITION = re.compile(r'^\s{0,3}\[([^\]]+)\]:\s*(\S+)', re.M)
_REFERENCE = re.compile(r'\]\[([^\]]+)\]')


def _without_fenced_code(text: str) -> str:
  lines, fence = [], None
  for line in text.split('\n'):
    m = _FENCE.match(line)
    if m:
      if fence is None:
        fence = m.group(1)[0]
      elif m.group(1)[0] == fence:
        fence = None
      lines.append('')
    else:
      lines.append('' if fence else line)
  return '\n'.join(lines)


def _without_code(text: str) -> str:
  """Fenced blocks and inline code spans blanked: a `[a](b)` inside code is not a link."""
  return re.sub(
    r'(`+)(.+?)\1', lambda m: ' ' * len(m.group(0)), _without_fenced_code(text), flags=re.S
  )


def github_anchor(heading: str) -> str:
  """GitHub's anchor of a heading: link text kept, lower case, punctuation but '-' and '_'
  dropped, spaces to '-'."""
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading).strip().lower()
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(path: pathlib.Path) -> set:
  seen, found = {}, set()
  for line in _without_fenced_code(path.read_text()).split('\n'):
    m = _HEADING.match(line)
    if m:
      slug = github_anchor(m.group(1))
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      found.add(slug if n == 0 else f'{slug}-{n}')  # GitHub numbers repeated headings
  return found


def dead_links(path: pathlib.Path) -> list:
  """The links of `path` that do not resolve, each with the reason."""
  text = _without_code(path.read_text())
  definitions = {m.group(1).lower(): m.group(2) for m in _DEFINITION.finditer(text)}
  dead = [
    f'[{m.group(1)}]: undefined reference'
    for m in _REFERENCE.finditer(text)
    if m.group(1).lower() not in definitions
  ]
  for target in [m.group(1) for m in _INLINE.finditer(text)] + list(definitions.values()):
    if re.match(r'^[a-z]+:', target):  # http:, https:, mailto:
      continue
    file, _, fragment = target.partition('#')
    dest = (path.parent / file).resolve() if file else path
    if not dest.exists():
      dead.append(f'{target}: no such file')
    elif fragment and (dest.suffix != '.md' or fragment not in anchors(dest)):
      dead.append(f'{target}: no such heading')
  return dead


@pytest.mark.parametrize('path', DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_of_the_documents_resolves(path):
  assert dead_links(path) == []


def test_the_link_check_finds_a_missing_file_heading_and_reference(tmp_path):
  (tmp_path / 'other.md').write_text('# Its Title: one (two)\n\n## Repeated\n\n## Repeated\n')
  doc = tmp_path / 'doc.md'
  doc.write_text(
    '# Here\n'
    '[ok](other.md#its-title-one-two) [ok](other.md#repeated-1) [ok](#here) [ok][r]\n'
    '[gone](missing.md) [bad](other.md#its-title) [bad](#nowhere) [x][undefined]\n'
    '`[code](not-a-link.md)` [web](https://example.com/x#y)\n\n'
    '[r]: other.md#repeated\n'
  )
  assert dead_links(doc) == [
    '[undefined]: undefined reference',
    'missing.md: no such file',
    'other.md#its-title: no such heading',
    '#nowhere: no such heading',
  ]
  assert github_anchor('Issue 34 (CPU speed): not met, `x`') == 'issue-34-cpu-speed-not-met-x'
