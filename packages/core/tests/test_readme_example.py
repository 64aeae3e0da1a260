"""The docs' engine between two plain processes (docs/concepts/index.md, "An engine without
Ray") runs as written, where Ray cannot load."""

import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).parents[3] / "docs" / "concepts" / "index.md"
"""The docs site's concepts page (the tests run from a repository checkout)."""
MARKER = "<!-- example without Ray -->\n```python\n"

NO_RAY = '''import importlib.abc as _abc, sys as _sys
class _NoRay(_abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not installed here (blocked by the test)")
_sys.meta_path.insert(0, _NoRay())
'''


def test_an_engine_moves_weights_between_two_plain_processes_without_ray(tmp_path):
    text = PAGE.read_text()
    start = text.index(MARKER) + len(MARKER)
    example = text[start:text.index("```", start)]
    script = tmp_path / "example.py"
    script.write_text(NO_RAY + example + "\nassert 'ray' not in _sys.modules\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "{'w': [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 'b': [1.0, 1.0, 1.0]}" in done.stdout
